"""The rest of torch's DistributedDataParallel surface: thin helpers, and the refusals.

Code written for torch's DDP calls more than `forward` and `no_sync`: static
helpers (Lightning and accelerate use `_set_params_and_buffers_to_ignore_for_model`),
legacy multi-device helpers, and a few private methods. What means something
here is provided; what does not raises `NotSupportedError` naming the method
and the reason, instead of an AttributeError that says nothing.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn

import torch
from torch import nn
from torch.nn.parallel.scatter_gather import gather, scatter_kwargs

from phalanx.errors import ConfigurationError, NotSupportedError
from phalanx.runtime.nested import map_tensors


def _refuse(method: str, reason: str) -> NoReturn:
    raise NotSupportedError(f"DistributedDataParallel.{method} is not supported: {reason}")


class TorchSurface:
    """Mixed into DistributedDataParallel: torch's helpers that need nothing of the reducer."""

    dim: int
    _ddp_sink_clone: bool

    # ------------------------------------------------------------ provided
    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(
        module: nn.Module, params_and_buffers_to_ignore: Iterable[str]
    ) -> None:
        """Mark parameters and buffers (by qualified name) that DDP leaves alone.

        Call it on the plain module before wrapping: ignored parameters keep
        their local gradients and ignored buffers are never broadcast. The names
        are stored where torch stores them, `module._ddp_params_and_buffers_to_ignore`,
        which DDP reads (setting that attribute directly works too).
        """
        names = list(params_and_buffers_to_ignore)
        module._ddp_params_and_buffers_to_ignore = names  # type: ignore[assignment]
        wanted = set(names)
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if name in wanted:
                tensor._ddp_ignored = True  # type: ignore[attr-defined]

    @staticmethod
    def _get_data_parallel_params(module: nn.Module, named_params: bool = False) -> Iterator[Any]:
        """The parameters (or (name, parameter) pairs) DDP manages: all but the ignored ones."""
        items = module.named_parameters() if named_params else module.parameters()
        for item in items:
            param = item[1] if named_params else item
            if not hasattr(param, "_ddp_ignored"):
                yield item

    def scatter(self, inputs: Any, kwargs: Any, device_ids: Any) -> Any:
        """torch's legacy helper: split inputs along `dim` over `device_ids`."""
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def gather(self, outputs: Any, output_device: Any) -> Any:
        """torch's legacy helper: concatenate outputs along `dim` on `output_device`."""
        return gather(outputs, output_device, dim=self.dim)

    def to_kwargs(self, inputs: Any, kwargs: Any, device_id: int) -> Any:
        """torch's legacy helper: inputs and kwargs moved to CUDA device `device_id`."""
        device = torch.device("cuda", device_id)
        moved_inputs, moved_kwargs = map_tensors(lambda t: t.to(device), (inputs, kwargs))
        return (tuple(moved_inputs),), (moved_kwargs or {},)

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """Accepted: torch clones the outputs through its `_DDPSink` node unless told not to;
        phalanx has no such node and never clones outputs, whatever `val` is."""
        self._ddp_sink_clone = val

    # ------------------------------------------------------------ refused
    # Any arguments: whatever a caller passes, it gets the reason, not a TypeError.
    def _register_fused_optim(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(
            "_register_fused_optim()",
            "the reducer writes the averaged gradients at the end of backward and has no "
            "per-bucket optimizer step — call optimizer.step() after backward",
        )

    def _register_buffer_comm_hook(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(
            "_register_buffer_comm_hook()",
            "buffers are always broadcast from rank 0 before a training forward — keep that "
            "(broadcast_buffers=True), or turn it off and reduce your buffers yourself",
        )

    def _get_ddp_logging_data(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(
            "_get_ddp_logging_data()",
            "it reads torch's C++ DDP logger, which phalanx does not have — read the "
            "reducer's counters in model.reducer.stats",
        )

    def _set_ddp_runtime_logging_sample_rate(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(
            "_set_ddp_runtime_logging_sample_rate()",
            "phalanx has no runtime logger to sample — model.reducer.stats counts every step",
        )

    def _set_sparse_metadata(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(
            "_set_sparse_metadata()",
            "sparse gradients are not supported — use nn.Embedding(sparse=False)",
        )

    def _update_process_group(self, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(
            "_update_process_group()",
            "a live reducer keeps its group — wrap the module again with "
            "DistributedDataParallel(module, process_group=new_group), which detaches "
            "this wrapper",
        )


def refuse_torch_ddp_around(module: nn.Module) -> None:
    """Raise if torch's DistributedDataParallel is running `module`'s forward (accelerate's
    `accelerator.prepare(model)` wraps whatever model it is given): two reducers would each
    all-reduce every gradient, and gradient accumulation would double the traffic."""
    outer = torch.nn.parallel.DistributedDataParallel._get_active_ddp_module()
    if outer is not None and getattr(outer, "module", None) is module:
        raise ConfigurationError(
            "phalanx's DistributedDataParallel is wrapped again in torch's "
            "DistributedDataParallel (accelerate's prepare(model) does that): both would "
            "all-reduce every gradient — give prepare() the optimizer and the dataloader only, "
            "or give it the plain model without phalanx's DDP"
        )


def eager(method: Callable[..., None]) -> Callable[..., None]:
    """`torch.compiler.disable(method)`, made at its first call with torch._dynamo loaded.

    Marking it at import would load torch._dynamo in every process: seconds of CPU
    per rank, before the first step. Only a process that compiles loads it, and
    only there does the mark matter.
    """
    lazily = torch._disable_dynamo(method)  # torch's lazy form, as torch's own DDP uses

    @functools.wraps(method)
    def call(*args: Any) -> None:
        if "torch._dynamo" in sys.modules:
            return lazily(*args)
        return method(*args)

    return call
