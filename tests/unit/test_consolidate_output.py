"""`phalanx consolidate` writes its output atomically: old file or whole new file, one-line errors.

The full disk is a real 4 MiB tmpfs, the read-only folder a read-only mount
(both need root; tests/disks.py). The object written is 8 MiB of tensors, too
big for what is left of the disk, so the write fails midway.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from phalanx.errors import CheckpointError
from phalanx.train.checkpoint.consolidate import write_atomically
from tests.disks import fill

BIG = {"model": {"w": torch.ones(2 * 1024 * 1024)}}  # 8 MiB


def _one_line(exc: pytest.ExceptionInfo[CheckpointError]) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


def test_a_full_disk_keeps_the_good_file_already_there(small_disk: Path) -> None:
    out = small_disk / "plain.pt"
    torch.save({"good": torch.arange(10)}, out)
    before = out.read_bytes()
    fill(small_disk)
    with pytest.raises(CheckpointError) as exc:
        write_atomically(BIG, out)
    assert "the disk is full" in _one_line(exc)
    assert out.read_bytes() == before
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "plain.pt"]


def test_a_read_only_folder_is_one_line(read_only_dir: Path) -> None:
    with pytest.raises(CheckpointError) as exc:
        write_atomically(BIG, read_only_dir / "plain.pt")
    text = _one_line(exc)
    assert "read-only file system" in text or "permission denied" in text, text


def test_an_output_that_is_a_directory_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as exc:
        write_atomically(BIG, tmp_path)
    assert "is a directory" in _one_line(exc)


def test_a_parent_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError) as exc:
        write_atomically(BIG, tmp_path / "file" / "plain.pt")
    assert "not a directory" in _one_line(exc)


def test_a_good_write_replaces_the_file_whole(tmp_path: Path) -> None:
    out = tmp_path / "plain.pt"
    out.write_text("old")
    write_atomically(BIG, out)
    assert torch.equal(torch.load(out, weights_only=True)["model"]["w"], BIG["model"]["w"])
    assert [p.name for p in tmp_path.iterdir()] == ["plain.pt"]


def test_a_run_directory_is_answered_with_its_checkpoints(tmp_path: Path) -> None:
    from phalanx.train.checkpoint.consolidate import consolidate

    for step in (4, 2):
        (tmp_path / f"checkpoint-{step}").mkdir()
    with pytest.raises(CheckpointError) as exc:
        consolidate(tmp_path, tmp_path / "out.pt")
    text = _one_line(exc)
    assert "a run's output_dir" in text and "checkpoint-2, checkpoint-4" in text, text
