"""What a DCP `.metadata` says about storage is checked before anything is read (issue 36,
item 4).

An attacker who can write a checkpoint folder rewrites `.metadata` (and the
manifest, tests/checkpoints.rehash) so that it names another run's shard, a
FIFO (which blocked `open()` forever), or a tensor far larger than the bytes
behind it (which made `consolidate` allocate it and write 64 MB of the wrong
shape). Each is refused in one line, by `phalanx consolidate` and by the
reader every resume uses, before anything is opened or allocated.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from phalanx.errors import CheckpointError
from phalanx.runtime import safe_dcp
from phalanx.train.checkpoint.consolidate import consolidate
from phalanx.train.checkpoint.directory import begin, seal, write_file
from tests.checkpoints import rehash

Edit = Callable[[Any], None]


def _checkpoint(root: Path, scale: float) -> Path:
    """checkpoint-1 of a run in `root`: the model as DCP (as stage 3 saves it), a plain
    optimizer; its weights are `scale` times ones."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    state = {"w": torch.full((4, 3), scale), "b": torch.full((3,), scale)}
    staging = begin(root, 1)
    _save_state_dict(
        {"model": state}, storage_writer=FileSystemWriter(staging / "model"), no_dist=True
    )
    optimizer: dict[str, Any] = {"state": {}, "param_groups": []}
    written = {"optimizer.pt": write_file(staging, "optimizer.pt", optimizer)}
    return seal(staging, 1, {"model": "sharded", "optimizer": "replicated"}, written)


def _edit_metadata(checkpoint: Path, edit: Edit) -> None:
    """Rewrite model/.metadata with `edit` applied, and the manifest to match it."""
    path = checkpoint / "model" / ".metadata"
    with path.open("rb") as file:
        metadata = pickle.load(file)
    edit(metadata)
    path.write_bytes(pickle.dumps(metadata))
    rehash(checkpoint)


def _storage_of(metadata: Any, fqn: str) -> Any:
    return next(info for index, info in metadata.storage_data.items() if index.fqn == fqn)


@pytest.fixture
def two_runs(tmp_path: Path) -> tuple[Path, Path]:
    return _checkpoint(tmp_path / "ours", 1.0), _checkpoint(tmp_path / "theirs", 7.0)


def _one_line(exc: pytest.ExceptionInfo[CheckpointError]) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


def test_a_storage_file_of_another_run_is_refused(two_runs: tuple[Path, Path]) -> None:
    ours, theirs = two_runs
    shard = next(p.name for p in (theirs / "model").iterdir() if p.suffix == ".distcp")
    outside = f"../../../theirs/checkpoint-1/model/{shard}"
    assert (ours / "model" / outside).is_file()

    def point_outside(metadata: Any) -> None:
        for info in metadata.storage_data.values():
            info.relative_path = outside

    _edit_metadata(ours, point_outside)
    with pytest.raises(CheckpointError) as exc:
        safe_dcp.read_whole(ours / "model")
    assert f"names the storage file {outside!r}" in _one_line(exc)
    with pytest.raises(CheckpointError):
        consolidate(ours, ours.parent / "out.pt")
    assert not (ours.parent / "out.pt").exists()


def test_a_storage_file_that_is_a_link_is_refused(two_runs: tuple[Path, Path]) -> None:
    ours, theirs = two_runs
    shard = next(p for p in (ours / "model").iterdir() if p.suffix == ".distcp")
    shard.unlink()
    shard.symlink_to(theirs / "model" / shard.name)
    with pytest.raises(CheckpointError) as exc:
        safe_dcp.read_whole(ours / "model")
    assert "is a symbolic link, which phalanx does not follow" in _one_line(exc)


@pytest.mark.timeout(90)
def test_a_fifo_named_as_storage_is_refused_without_blocking(two_runs: tuple[Path, Path]) -> None:
    """In a child process with a deadline: before, open() of the FIFO never returned."""
    ours, _ = two_runs
    os.mkfifo(ours / "model" / "pipe")

    def point_at_the_fifo(metadata: Any) -> None:
        _storage_of(metadata, "model.w").relative_path = "pipe"

    _edit_metadata(ours, point_at_the_fifo)
    out = ours.parent / "out.pt"
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "consolidate", str(ours), str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "'pipe'" in lines[0] and "regular file" in lines[0], done.stderr
    assert not out.exists()


def test_a_declared_size_beyond_the_file_is_refused_before_allocating(
    two_runs: tuple[Path, Path],
) -> None:
    """The whole tensor declared 4096 x 4096 (64 MB) over the 48 bytes stored: consolidate
    allocated it, filled its corner and wrote it out."""
    ours, _ = two_runs

    def inflate(metadata: Any) -> None:
        metadata.state_dict_metadata["model.w"].size = torch.Size([4096, 4096])

    _edit_metadata(ours, inflate)
    out = ours.parent / "out.pt"
    with pytest.raises(CheckpointError) as exc:
        consolidate(ours, out)
    assert "'model.w' of size (4096, 4096), which its chunks do not tile" in _one_line(exc)
    assert not out.exists()


def test_a_chunk_larger_than_its_storage_is_refused(two_runs: tuple[Path, Path]) -> None:
    ours, _ = two_runs

    def inflate(metadata: Any) -> None:
        meta = metadata.state_dict_metadata["model.w"]
        meta.size = torch.Size([4096, 4096])
        meta.chunks[0].sizes = torch.Size([4096, 4096])

    _edit_metadata(ours, inflate)
    with pytest.raises(CheckpointError) as exc:
        safe_dcp.read_whole(ours / "model")
    assert "declares 67108864 bytes of 'model.w'" in _one_line(exc)


def test_byte_ranges_past_the_end_or_overlapping_are_refused(two_runs: tuple[Path, Path]) -> None:
    ours, _ = two_runs

    def past_the_end(metadata: Any) -> None:
        _storage_of(metadata, "model.w").offset = 1 << 30

    _edit_metadata(ours, past_the_end)
    with pytest.raises(CheckpointError, match=r"places 'model\.w' at bytes 1073741824"):
        safe_dcp.read_whole(ours / "model")

    def overlapping(metadata: Any) -> None:
        w, b = _storage_of(metadata, "model.w"), _storage_of(metadata, "model.b")
        w.offset, w.length = b.offset, b.length

    _edit_metadata(ours, overlapping)
    with pytest.raises(CheckpointError, match="two entries on the same bytes"):
        safe_dcp.read_whole(ours / "model")


def test_an_untouched_checkpoint_still_reads(two_runs: tuple[Path, Path]) -> None:
    ours, _ = two_runs
    whole = consolidate(ours, ours.parent / "out.pt")
    assert torch.equal(whole["model"]["w"], torch.ones(4, 3))
