"""Reading of a DCP checkpoint only the bytes each rank needs, at any world size.

DCP stores every chunk as one item: a `torch.save` of the tensor at a byte
range of a `.distcp` file. torch's reader loads a whole item for any part of
it, so a rank that resumes at another world size (2 -> 3: each new rank holds
a third of a tensor that two items of a half each cover) reads every item it
touches whole — up to the whole tensor for a third of it. Here each request
reads its item's zip directory and `data.pkl` (a few hundred bytes, through
torch's own zip reader and weights_only unpickler, the storage made on the
meta device so that nothing is read) to learn where the item's data lies and how it is laid out,
then reads just the rows of its request with one `pread`: a contiguous
stored tensor's rows [a, b) are one byte range. Anything else (a layout that
is not contiguous, a big-endian save, a value) is read whole, as torch reads it.

`bytes_read` counts every byte read, directories and pickles included
(benchmarks/async_save.py reports it against the bytes each rank holds).
"""

from __future__ import annotations

import io
import math
import os
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from phalanx.ground.safe_files import open_regular


class Window(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file, as a seekable file of their own
    (pread: several windows of one file never disturb each other); counts what is read."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self.fd, self.offset, self.length = fd, offset, length
        self.position = 0
        self.read_bytes = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = max(0, min(self.length, base + position))
        return self.position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        wanted = min(len(view), self.length - self.position)
        data = self.pread(self.position, wanted)
        view[: len(data)] = data
        self.position += len(data)
        return len(data)

    def pread(self, start: int, count: int) -> bytes:
        data = os.pread(self.fd, count, self.offset + start) if count > 0 else b""
        self.read_bytes += len(data)
        return data


def read_item(fd: int, info: _StorageInfo, request: ReadItem) -> tuple[torch.Tensor, int]:
    """The part of the item at `info` that `request` asks for (its storage offsets and
    lengths), as a CPU tensor; and the bytes read for it."""
    from torch.distributed._shard._utils import narrow_tensor_by_index

    window = Window(fd, info.offset, info.length)
    reader: Any = torch._C.PyTorchFileReader(cast(IO[bytes], window))  # stubs lack offsets
    records = [r for r in reader.get_all_records() if r.startswith("data/")]
    little = reader.has_record("byteorder") and reader.get_record("byteorder") == b"little"
    pickled = [r for r in reader.get_all_records() if r == "data.pkl"]
    layout = _layout(reader.get_record("data.pkl")) if pickled and len(records) == 1 else None
    starts, sizes = list(request.storage_offsets), list(request.lengths)
    if layout is None or not little or not _row_major(layout):
        stream = cast(IO[bytes], window)
        window.seek(0)
        whole = torch.load(stream, map_location="cpu", weights_only=True)
        return narrow_tensor_by_index(whole, starts, sizes), window.read_bytes
    row = math.prod(layout.shape[1:]) * layout.element_size()
    first, rows = (starts[0], sizes[0]) if layout.dim() else (0, 1)
    begin = reader.get_record_offset(records[0]) + layout.storage_offset() * layout.element_size()
    data = window.pread(begin + first * row, rows * row)
    block = torch.frombuffer(bytearray(data), dtype=layout.dtype) if data else None
    if block is None:
        block = torch.empty(0, dtype=layout.dtype)
    if not layout.dim():
        return block.view(()), window.read_bytes
    block = block.view(rows, *layout.shape[1:])
    return narrow_tensor_by_index(block, [0, *starts[1:]], [rows, *sizes[1:]]), window.read_bytes


def _layout(pickled: bytes) -> torch.Tensor | None:
    """The saved tensor's dtype, shape, strides and offset, as a meta tensor: its `data.pkl`
    through torch's weights_only unpickler, the storage made on the meta device (nothing
    read, nothing run); None when the pickle is not one tensor of one storage."""
    from torch._weights_only_unpickler import Unpickler

    def meta_storage(saved: Any) -> Any:
        _, kind, _key, _location, numel = saved
        dtype = torch.uint8 if kind is torch.UntypedStorage else kind.dtype
        untyped = torch.UntypedStorage(numel * dtype.itemsize, device="meta")
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)

    unpickler = Unpickler(io.BytesIO(pickled))
    unpickler.persistent_load = meta_storage  # type: ignore[method-assign]
    try:
        layout = unpickler.load()
    except Exception:  # not what a tensor's save holds: read it whole, as torch does
        return None
    return layout if isinstance(layout, torch.Tensor) else None


def _row_major(layout: torch.Tensor) -> bool:
    """A tensor laid out row by row, one row after the other (what a slice of rows needs)."""
    return layout.is_contiguous() and not layout.is_quantized and layout.layout == torch.strided


def read_data(
    reader: Any, plan: LoadPlan, planner: LoadPlanner, path: Any, storage: dict[Any, Any]
) -> tuple[Future[None], int]:
    """FileSystemReader.read_data, each tensor read by its rows (module docstring); and the
    bytes read."""
    per_file: dict[str, list[ReadItem]] = {}
    for item in plan.items:
        per_file.setdefault(storage[item.storage_index].relative_path, []).append(item)
    total = 0
    for relative, items in per_file.items():
        with open_regular(path / relative) as file:
            total += _read_file(file, items, planner, storage)
    done: Future[None] = Future()
    done.set_result(None)  # read already: DCP waits on it
    return done, total


def _read_file(
    file: IO[bytes], items: list[ReadItem], planner: LoadPlanner, storage: dict[Any, Any]
) -> int:
    total = 0
    for item in items:
        info = storage[item.storage_index]
        if item.type == LoadItemType.BYTE_IO:
            window = Window(file.fileno(), info.offset, info.length)
            planner.load_bytes(item, io.BytesIO(window.pread(0, info.length)))
            total += window.read_bytes
            continue
        tensor, read = read_item(file.fileno(), info, item)
        total += read
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise ValueError(
                f"{item.storage_index} is {tuple(tensor.size())}, the request asks for "
                f"{tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)
    return total
