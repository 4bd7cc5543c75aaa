"""A checkpoint's state copied to host memory at the step boundary, so the files can be
written while training goes on (checkpointer.py's background saves).

The copy is what the writer will write, made before the next step changes it:

- a plain tensor: its whole storage copied once, and the tensor re-made as the same
  view of the copy (offset, size, stride), so `torch.save` writes the very bytes
  it would have written from the live state, and two entries sharing a storage (a
  tied weight) still share it;
- a DTensor (a ZeRO or fully_shard shard, written through DCP): its local tensor
  copied, the same placement kept (`_spec`), so DCP plans it as the live one; DCP
  writes only the local tensor's own elements;
- containers copied (a module's state_dict with its `_metadata`; an optimizer's
  per-parameter state dicts, which the next step updates in place), other values
  deep-copied.

On a GPU the copy goes to pinned memory with non-blocking copies, then one
synchronize: the step after waits for nothing else. On the CPU it is a copy:
benchmarks/async_staging.py measured it against a copy-on-write fork
(docs/trainer.md, "Background saves").

Offloaded state (a disk offload's file-backed tensors) is not copied: a `SaveHold`
keeps it still until the writer has written it (offload/held.py), so the step
boundary does not read the whole state back out of its files.

The memory of one save's copy is the next one's (`pool`): a fresh allocation
costs a page fault per 4 KB page, 3 to 5 times the copy itself on the 2-core
machine (async_staging.py, `copy` against `reused`), and pinned memory is slow
to allocate. So a run that saves in the background keeps host memory the size
of its part of the state between saves, as DCP's cached staging does; a buffer
of a size the next state no longer has is let go.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from phalanx.offload.held import SaveHold


class Stager:
    """Copies one checkpoint's state to host memory; `bytes` counts what it copied."""

    def __init__(
        self, pin: bool, pool: list[torch.Tensor] | None = None, hold: SaveHold | None = None
    ) -> None:
        self.pin = pin
        """Pinned host memory (a CUDA state): the device copies run without a sync each."""
        self.bytes = 0
        self.buffers: list[torch.Tensor] = []
        """The byte buffers this copy lives in: the next copy's pool, once this is written."""
        self._pool: dict[int, list[torch.Tensor]] = {}
        for buffer in pool or ():
            self._pool.setdefault(buffer.numel(), []).append(buffer)
        self._storages: dict[tuple[str, int], torch.Tensor] = {}
        self._device_copies = False
        self.hold = hold
        """Where the file-backed tensors are kept still instead of copied (None: copied)."""

    def copy(self, obj: Any) -> Any:
        """`obj` with every tensor in it copied to host memory (module docstring)."""
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj)
        if isinstance(obj, Mapping):
            return self._mapping(obj)
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
            return type(obj)(*(self.copy(v) for v in obj))
        if isinstance(obj, list | tuple):
            items_ = [self.copy(v) for v in obj]
            return items_ if isinstance(obj, list) else tuple(items_)
        return copy.deepcopy(obj)

    def _mapping(self, obj: Mapping[Any, Any]) -> dict[Any, Any]:
        items = [(key, self.copy(value)) for key, value in obj.items()]
        out = OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
        metadata = getattr(obj, "_metadata", None)  # a module's state_dict: its versions
        if metadata is not None:
            out._metadata = copy.deepcopy(metadata)  # type: ignore[attr-defined]
        return out

    def finish(self) -> None:
        """Wait for the device copies (CUDA): after this the copy is complete."""
        if self._device_copies and torch.cuda.is_available():
            torch.cuda.synchronize()

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(tensor, DTensor):
            local = tensor._local_tensor.detach()
            local = self._held(local) if self._holds(local) else self._whole(local)
            return DTensor(local, tensor._spec, requires_grad=False)
        tensor = tensor.detach()
        if self._holds(tensor):
            return self._held(tensor)
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
            return tensor.to("cpu", copy=True)  # no storage to share: as it is
        if tensor.untyped_storage().data_ptr() == 0:
            return self._whole(tensor)
        storage = self._storage(tensor)
        view = torch.empty(0, dtype=tensor.dtype)
        return view.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())

    def _holds(self, tensor: torch.Tensor) -> bool:
        return self.hold is not None and self.hold.holds(tensor)

    def _held(self, tensor: torch.Tensor) -> torch.Tensor:
        assert self.hold is not None
        return self.hold.hold(tensor)

    def _storage(self, tensor: torch.Tensor) -> torch.UntypedStorage:
        """The host copy of `tensor`'s whole storage, made once per storage."""
        source = tensor.untyped_storage()
        key = (str(tensor.device), source.data_ptr())
        copied = self._storages.get(key)
        if copied is None:
            raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(source)
            copied = self._empty(raw)
            self._copy_into(copied, raw)
            self._storages[key] = copied
        return copied.untyped_storage()

    def _whole(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous host copy of `tensor`'s elements alone."""
        out = self._empty(tensor)
        self._copy_into(out, tensor)
        return out

    def _empty(self, like: torch.Tensor) -> torch.Tensor:
        """Host memory shaped as `like` (contiguous): a buffer of the pool, or a new one."""
        nbytes = like.numel() * like.element_size()
        spare = self._pool.get(nbytes)
        if spare:
            buffer = spare.pop()
        else:
            pin = self.pin and like.device.type == "cuda" and nbytes > 0
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.buffers.append(buffer)
        return buffer.view(like.dtype).view(like.size())

    def _copy_into(self, out: torch.Tensor, source: torch.Tensor) -> None:
        device = source.device.type != "cpu"
        out.copy_(source, non_blocking=device and out.is_pinned())
        self._device_copies = self._device_copies or device
        self.bytes += out.nbytes


def stage(obj: Any, pin: bool = False) -> tuple[Any, int]:
    """`obj` copied to host memory (the Stager's rules, fresh memory), complete; and the
    bytes copied."""
    stager = Stager(pin)
    staged = stager.copy(obj)
    stager.finish()
    return staged, stager.bytes
