"""A checkpoint cannot run code: planted pickles are refused on every path that reads one.

A 2-rank Trainer saves one checkpoint of each kind (DDP, ZeRO stages 1-3,
PowerSGD's and local SGD's per-rank state). Then, as an attacker who can
write the folder would, the test replaces one file with a pickle whose
loading creates a marker directory, and rewrites the manifest's hashes to
match. Resuming (every rank) and `phalanx consolidate` must refuse with one
line naming the file, and the marker must never appear.

The planted files: DCP's `.metadata` (plain `pickle` in torch's reader); a
non-tensor entry inside a `.distcp` file (torch's planner unpickles those
with `weights_only=False`); the replicated and per-rank `.pt` files.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from phalanx.errors import CheckpointError
from tests.checkpoints import rehash
from tests.faults.trainkit import make_trainer
from tests.harness import run_workers

KINDS: dict[str, dict[str, Any]] = {
    "ddp": {},
    "zero1": {"zero_stage": 1},
    "zero2": {"zero_stage": 2},
    "zero3": {"zero_stage": 3},
    "powersgd": {"ddp_comm_hook": "powersgd", "powersgd_start_iter": 2},
    "local_sgd": {"sync_method": "local_sgd", "sync_every": 2},
}


class Payload:
    """Unpickling it runs os.mkdir(marker): what an attacker's code would do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (self.marker,)


def _save_all(rank: int, world: int, root: str) -> None:
    for kind, overrides in KINDS.items():
        make_trainer(Path(root) / kind, max_steps=2, save_steps=2, **overrides).train()


def _resume(rank: int, world: int, root: str, kind: str) -> str:
    trainer = make_trainer(Path(root) / kind, max_steps=4, save_steps=2, **KINDS[kind])
    try:
        trainer.train(resume_from_checkpoint=True)
    except CheckpointError as exc:
        return str(exc)
    return "resumed"


def _plant_metadata(checkpoint: Path, entry: str, marker: Path) -> Path:
    target = checkpoint / entry / ".metadata"
    target.write_bytes(pickle.dumps(Payload(str(marker))))
    return target


def _plant_bytes_entry(checkpoint: Path, entry: str, marker: Path) -> Path:
    """Rewrite a DCP entry with one non-tensor value replaced by the payload."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    from phalanx.runtime import safe_dcp

    directory = checkpoint / entry
    state = safe_dcp.read_whole(directory)
    state["param_groups"]["0"]["lr"] = Payload(str(marker))
    for old in directory.iterdir():
        old.unlink()
    _save_state_dict(state, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)
    return directory


def _plant_file(checkpoint: Path, name: str, marker: Path) -> Path:
    target = checkpoint / name
    torch.save(Payload(str(marker)), target)
    return target


def _plant(checkpoint: Path, kind: str, how: str, marker: Path) -> str:
    """Plant the payload; return the name the refusal must mention."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    if how == "metadata":
        entry = "model" if kind == "zero3" else "optimizer"
        planted = _plant_metadata(checkpoint, entry, marker)
        name = f"{entry}/.metadata"
    elif how == "bytes":
        planted = _plant_bytes_entry(checkpoint, "optimizer", marker)
        name = "param_groups.0.lr"
    else:
        entries = manifest["entries"]
        entry = "model" if kind == "ddp" else "comm"
        if entry not in entries:
            raise AssertionError(f"test bug: no {entry!r} entry in {sorted(entries)}")
        files = sorted(f for f in manifest["files"] if f.startswith(entry))
        planted = _plant_file(checkpoint, files[0], marker)
        name = files[0]
    rehash(checkpoint)
    assert planted.exists()
    return name


CASES = [
    ("zero1", "metadata"),
    ("zero2", "bytes"),
    ("zero3", "metadata"),
    ("ddp", "file"),
    ("powersgd", "file"),
    ("local_sgd", "file"),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("planted")
    run_workers(_save_all, 2, str(root), init_pg=False, timeout=200)
    return root


@pytest.mark.faults
@pytest.mark.timeout(250)
@pytest.mark.parametrize(("kind", "how"), CASES, ids=[f"{k}-{h}" for k, h in CASES])
def test_a_planted_pickle_is_refused_on_every_rank_and_never_runs(
    saved: Path, kind: str, how: str
) -> None:
    marker = saved / f"pwned-{kind}-{how}"
    name = _plant(saved / kind / "checkpoint-2", kind, how, marker)
    outcomes = run_workers(_resume, 2, str(saved), kind, init_pg=False, timeout=120)
    for o in outcomes:
        assert name in o.value, f"rank {o.rank}: {o.value}"
        assert "\n" not in o.value, f"rank {o.rank}: not one line: {o.value}"
    assert not marker.exists(), "the planted pickle ran"


@pytest.mark.faults
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["zero1", "zero3"])
def test_consolidate_refuses_a_planted_metadata_file(saved: Path, kind: str) -> None:
    marker = saved / f"pwned-consolidate-{kind}"
    checkpoint = saved / kind / "checkpoint-2"
    name = _plant(checkpoint, kind, "metadata", marker)
    out = saved / f"{kind}-consolidated.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx", "consolidate", str(checkpoint), str(out)],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and name in lines[0], proc.stderr
    assert not marker.exists(), "the planted pickle ran"
    assert not out.exists()
