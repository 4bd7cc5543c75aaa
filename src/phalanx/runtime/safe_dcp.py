"""torch.distributed.checkpoint, read without running anything the files say.

DCP trusts its files: `FileSystemReader.read_metadata` unpickles
`.metadata` with plain `pickle`, and the default load planner turns every
non-tensor entry back into an object with `torch.load(weights_only=False)`.
Either runs whatever code a planted file names, on every rank that resumes
and in `phalanx consolidate`; a manifest's hashes cannot stop it, since who
can write the folder can rewrite the manifest too.

Every phalanx read of a DCP directory goes through this module instead:
`.metadata` through an unpickler that admits only DCP's own metadata classes,
torch sizes, dtypes and layouts, and plain containers; non-tensor entries
through `torch.load(weights_only=True)` (tensors, numbers, strings, lists,
tuples, dicts). Anything else is refused with one line naming the file.

What `.metadata` says about storage is checked against the directory before
anything is opened or allocated (`check_storage`): every storage file a
regular file inside the DCP directory, reached through no link (another
run's shard, `/etc/...` or a FIFO, which would block `open()` forever, are
refused without being opened); every byte range inside its file and apart
from the others; every tensor's chunks inside its declared size, covering it
exactly, each backed by at least its bytes of storage. So a declared size
cannot make a reader allocate more than the files hold. Every file this
reader opens is opened without following a link and without blocking. Each
tensor is read by the rows a rank asks for, not whole (dcp_ranges.py).

Import this module where it is used: torch.distributed.checkpoint costs
seconds of CPU at import.
"""

from __future__ import annotations

import io
import itertools
import math
import os
import pickle
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from phalanx.errors import CheckpointError
from phalanx.ground.safe_files import open_regular, regular_inside

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, set[str]] = {
    _METADATA_MODULE: {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name ("torch.strided")
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file asks to run code (or build an object) that no checkpoint needs."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self._path} asks to load {module}.{name}, which no checkpoint's metadata holds "
            "— the file was planted or is not a torch.distributed.checkpoint file; nothing "
            "was run: restore the checkpoint from a trusted copy, or resume from another one"
        )


def read_metadata(directory: str | Path) -> Metadata:
    """The DCP directory's `.metadata`, unpickled with only DCP's own classes admitted."""
    return SafeReader(directory).read_metadata()


class _NoFollowFileSystem(FileSystem):
    """DCP's file system, opening for reading only regular files, through no final link,
    without blocking (a FIFO would block `open()` forever)."""

    @contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        if mode != "rb":
            raise CheckpointError(f"{path}: the safe reader only reads — this is a phalanx bug")
        with open_regular(Path(path)) as stream:
            yield cast(io.IOBase, stream)


class SafeReader(FileSystemReader):
    """`FileSystemReader` whose metadata is read through the restricted unpickler and whose
    storage is checked against the directory (`check_storage`) before anything is read."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self.fs = _NoFollowFileSystem()
        self.bytes_read = 0
        """Bytes read so far by read_data (dcp_ranges.py: each tensor by its rows)."""

    def read_data(self, plan: Any, planner: Any) -> Any:
        """torch's read_data, reading of each tensor item only the rows asked for."""
        from phalanx.runtime import dcp_ranges

        done, read = dcp_ranges.read_data(self, plan, planner, Path(self.path), self.storage_data)
        self.bytes_read += read
        return done

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as stream:
                metadata = _MetadataUnpickler(cast(IO[bytes], stream), str(path)).load()
        except UnsafeCheckpointError:
            raise
        except FileNotFoundError:
            raise CheckpointError(
                f"{path} is missing — this is not a torch.distributed.checkpoint directory, or "
                "it is incomplete; resume from an earlier checkpoint"
            ) from None
        except Exception as exc:  # torn or foreign bytes, a link, a FIFO
            raise CheckpointError(
                f"{path} is not a readable torch.distributed.checkpoint metadata file "
                f"({type(exc).__name__}: {exc}) — resume from an earlier checkpoint"
            ) from None
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(
                f"{path} holds a {type(metadata).__name__}, not DCP metadata — the file was "
                "replaced; restore the checkpoint from a trusted copy"
            )
        check_storage(metadata, Path(self.path), str(path))
        storage_meta = metadata.storage_meta or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


def _refuse(path: str, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{path} {what} — the checkpoint was changed or planted; nothing was read from it: "
        "restore it from a trusted copy, or resume from another one"
    )


def check_storage(metadata: Metadata, directory: Path, path: str) -> None:
    """Refuse metadata whose storage is outside `directory`, not regular files, or smaller
    than the tensors it declares (module docstring); `path` names it in the error."""
    storage = metadata.storage_data
    if not isinstance(storage, dict) or not isinstance(metadata.state_dict_metadata, dict):
        raise _refuse(path, "has no storage table")
    sizes: dict[str, int] = {}
    ranges: dict[str, list[tuple[int, int]]] = {}
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise _refuse(path, "holds a storage entry of the wrong kind")
        name = info.relative_path
        if not isinstance(name, str):
            raise _refuse(path, f"names storage by a {type(name).__name__}")
        if name not in sizes:
            try:
                sizes[name] = regular_inside(directory, name).st_size
            except OSError as exc:
                raise _refuse(path, f"names the storage file {name!r}, which {_why(exc)}") from None
        if info.transform_descriptors:
            raise _refuse(path, f"asks for transforms {list(info.transform_descriptors)!r}")
        start, length = info.offset, info.length
        if not _counts(start, length) or start + length > sizes[name]:
            raise _refuse(
                path,
                f"places {index.fqn!r} at bytes {start}+{length} of {name!r}, "
                f"which has {sizes[name]}",
            )
        ranges.setdefault(name, []).append((start, start + length))
    for name, spans in ranges.items():
        spans.sort()
        if any(a[1] > b[0] for a, b in itertools.pairwise(spans)):
            raise _refuse(path, f"places two entries on the same bytes of {name!r}")
    for fqn, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            _check_tensor(fqn, meta, storage, path)


def _why(exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return "does not exist in the checkpoint"
    return exc.strerror or str(exc)


def _counts(*values: object) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)


def _check_tensor(
    fqn: str, meta: TensorStorageMetadata, storage: dict[Any, Any], path: str
) -> None:
    """Chunks inside the declared size, apart, covering it, each backed by its bytes."""
    size = tuple(meta.size)
    itemsize = getattr(meta.properties.dtype, "itemsize", None)
    if not _counts(*size) or not isinstance(itemsize, int):
        raise _refuse(
            path, f"declares {fqn!r} with the size {size} and dtype {meta.properties.dtype!r}"
        )
    covered = 0
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for chunk in meta.chunks:
        box = _chunk_box(chunk, size)
        if box is None:
            raise _refuse(path, f"declares a chunk of {fqn!r} outside its size {size}")
        numel = math.prod(box[1])
        info = storage.get(MetadataIndex(fqn, box[0]))
        if info is None or info.length < numel * itemsize:
            stored = "none" if info is None else f"{info.length} bytes"
            raise _refuse(
                path,
                f"declares {numel * itemsize} bytes of {fqn!r} at {box[0]} "
                f"with {stored} of storage",
            )
        covered += numel
        boxes.append(box)
    if covered != math.prod(size) or _overlapping(boxes):
        raise _refuse(path, f"declares {fqn!r} of size {size}, which its chunks do not tile")


def _chunk_box(
    chunk: ChunkStorageMetadata, size: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    if not isinstance(chunk, ChunkStorageMetadata):
        return None
    offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
    if len(offsets) != len(size) or len(sizes) != len(size) or not _counts(*offsets, *sizes):
        return None
    if any(o + n > whole for o, n, whole in zip(offsets, sizes, size, strict=True)):
        return None
    return offsets, sizes


def _overlapping(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether two chunks share an element: a sweep along dim 0, so row shards cost n log n."""
    if not boxes or not boxes[0][0]:
        return len(boxes) > 1  # a scalar has one chunk
    ordered = sorted(boxes)
    for i, (offsets, sizes) in enumerate(ordered):
        for other, other_sizes in ordered[i + 1 :]:
            if other[0] >= offsets[0] + sizes[0]:
                break
            if all(
                o < p + m and p < o + n
                for o, n, p, m in zip(offsets, sizes, other, other_sizes, strict=True)
            ):
                return True
    return False


def _load_plain(value: io.BytesIO, fqn: str) -> Any:
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"checkpoint entry '{fqn}' is not plain data ({str(exc).splitlines()[0]}) — a "
            "file of the checkpoint was planted or damaged; nothing was run: resume from "
            "another checkpoint"
        ) from exc


class _PlainBytes(DefaultLoadPlanner):
    """Reads a non-tensor entry as plain data, then stores it where DCP's planner would."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = _load_plain(value, fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafeLoadPlanner(_PlainBytes):
    """DCP's default planner, with every non-tensor entry read as plain data."""


class _SafeEmptyPlanner(_PlainBytes, _EmptyStateDictLoadPlanner):
    """The planner that rebuilds a state dict from the metadata alone, reading plain data."""


def load(
    state_dict: dict[str, Any],
    directory: str | Path,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """`dcp.load` of `directory` into `state_dict`, in place, through the safe reader.

    The metadata is read first, here, so that a refusal is raised as itself on
    every rank (inside DCP it would come back as an AssertionError about
    missing metadata).
    """
    reader = SafeReader(directory)
    reader.read_metadata()
    with _unwrapped():
        dcp.load(
            state_dict,
            storage_reader=reader,
            planner=SafeLoadPlanner(),
            process_group=process_group,
        )


def read_whole(directory: str | Path) -> dict[str, Any]:
    """One process, no group: the whole checkpoint as a nested dict of whole tensors."""
    reader = SafeReader(directory)
    reader.read_metadata()
    state: dict[str, Any] = {}
    with _unwrapped():
        _load_state_dict(state, storage_reader=reader, planner=_SafeEmptyPlanner(), no_dist=True)
    return state


def read_into(state_dict: dict[str, Any], directory: str | Path) -> None:
    """One process, no group: fill the tensors of `state_dict` (nested as saved) from
    `directory`, in place; entries it does not name are not read."""
    reader = SafeReader(directory)
    reader.read_metadata()
    with _unwrapped():
        _load_state_dict(state_dict, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)


@contextmanager
def _unwrapped() -> Iterator[None]:
    """DCP gathers every rank's failure into one CheckpointException: a refusal of ours
    among them is raised as itself (every rank sees every rank's failures)."""
    try:
        yield
    except CheckpointException as exc:
        for _rank, (failure, _trace) in sorted(exc.failures.items()):
            if isinstance(failure, CheckpointError):
                raise failure from None
        raise
