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

Import this module where it is used: torch.distributed.checkpoint costs
seconds of CPU at import.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
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
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from phalanx.errors import CheckpointError

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


class SafeReader(FileSystemReader):
    """`FileSystemReader` whose metadata is read through the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = _MetadataUnpickler(cast(IO[bytes], stream), str(path)).load()
            except UnsafeCheckpointError:
                raise
            except Exception as exc:  # torn or foreign bytes
                raise CheckpointError(
                    f"{path} is not a readable torch.distributed.checkpoint metadata file "
                    f"({type(exc).__name__}: {exc}) — resume from an earlier checkpoint"
                ) from exc
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(
                f"{path} holds a {type(metadata).__name__}, not DCP metadata — the file was "
                "replaced; restore the checkpoint from a trusted copy"
            )
        storage_meta = metadata.storage_meta or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


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
