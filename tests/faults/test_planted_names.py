"""A link planted under a temporary name phalanx would use never redirects a write
(issue 36, item 3).

Whoever can write output_dir (or the folder of `phalanx consolidate`'s output)
could plant a symbolic link under the name phalanx was about to use: its
write then went to the link's target, a file outside the run, and the rename
that followed put the link in the output's place. Each test plants a link to a
victim file (or folder) under exactly the name phalanx used to make, in this
process (so the pid in it is right), and checks that the victim is untouched
and that phalanx's own output is a regular file. Three names blocked a save
instead, with a misleading "free space or fix permissions": those must save.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from phalanx.train import Trainer, TrainingArguments
from phalanx.train.checkpoint.consolidate import write_atomically
from phalanx.train.checkpoint.directory import verify_checkpoint
from phalanx.train.checkpoint.failures import probe as _probe
from phalanx.train.checkpoint.hf_export import staging_beside
from phalanx.train.checkpoint.outputdir import check_writable
from phalanx.train.logging.metrics import JSONL_NAME, JsonlSink, forget_after

pytestmark = pytest.mark.faults

VICTIM = b"a file outside the run\n"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "elsewhere" / "victim.txt"
    victim.parent.mkdir(exist_ok=True)
    victim.write_bytes(VICTIM)
    return victim


def test_consolidate_does_not_write_through_its_temporary_name(tmp_path: Path) -> None:
    victim, out = _victim(tmp_path), tmp_path / "out" / "plain.pt"
    out.parent.mkdir()
    (out.parent / f".{out.name}.tmp-{os.getpid()}").symlink_to(victim)
    write_atomically({"model": {"w": torch.ones(3)}}, out)
    assert victim.read_bytes() == VICTIM
    assert not out.is_symlink() and out.is_file()
    assert torch.equal(torch.load(out, weights_only=True)["model"]["w"], torch.ones(3))


def test_the_trainer_probe_of_output_dir_does_not_write_through_a_link(tmp_path: Path) -> None:
    victim, out = _victim(tmp_path), tmp_path / "run"
    out.mkdir()
    (out / f".phalanx-write-test-{os.getpid()}").symlink_to(victim)
    check_writable(out)
    assert victim.read_bytes() == VICTIM


def test_the_failed_save_probe_does_not_write_through_a_link(tmp_path: Path) -> None:
    victim, staging = _victim(tmp_path), tmp_path / "run" / "checkpoint-2.tmp"
    staging.mkdir(parents=True)
    (staging / f".phalanx-probe-{os.getpid()}").symlink_to(victim)
    assert _probe(staging) is None
    assert victim.read_bytes() == VICTIM


def test_trimming_the_metric_files_does_not_write_through_a_link(tmp_path: Path) -> None:
    """The fixed `.partial` name needed no pid at all; afterwards metrics.jsonl itself was
    the link, and every later line went to the victim."""
    victim, out = _victim(tmp_path), tmp_path / "run"
    out.mkdir()
    lines = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3))
    (out / JSONL_NAME).write_text(lines)
    (out / f"{JSONL_NAME}.partial").symlink_to(victim)
    forget_after(out, 2)
    assert victim.read_bytes() == VICTIM
    assert not (out / JSONL_NAME).is_symlink()
    assert [json.loads(line)["step"] for line in (out / JSONL_NAME).read_text().splitlines()] == [
        1,
        2,
    ]


def test_a_metric_file_that_is_a_link_is_refused(tmp_path: Path) -> None:
    victim, out = _victim(tmp_path), tmp_path / "run"
    out.mkdir()
    (out / JSONL_NAME).symlink_to(victim)
    with pytest.raises(OSError, match="is a symbolic link, which phalanx does not follow"):
        JsonlSink(out / JSONL_NAME)
    assert victim.read_bytes() == VICTIM


def test_the_hf_export_staging_folder_is_not_blocked_by_a_link(tmp_path: Path) -> None:
    victim_dir, out = tmp_path / "elsewhere", tmp_path / "export"
    victim_dir.mkdir()
    (tmp_path / f".{out.name}.tmp-{os.getpid()}").symlink_to(victim_dir)
    staging = staging_beside(out)
    assert staging.is_dir() and not staging.is_symlink() and staging.parent == tmp_path
    assert list(victim_dir.iterdir()) == []


# ------------------------------------------------------------ a Trainer in this process


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 2)

    def forward(self, batch: list[Tensor]) -> Tensor:
        return self.net(batch[0])


def _trainer(out: Path, **overrides: Any) -> Trainer:
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(2))
    settings: dict[str, Any] = {
        "output_dir": str(out),
        "max_steps": 2,
        "save_steps": 2,
        "per_device_train_batch_size": 4,
        "report_to": [],
        "disable_tqdm": True,
        **overrides,
    }
    return Trainer(
        model=_Net(),
        args=TrainingArguments(**settings),
        train_dataset=TensorDataset(x, (x[:, 0] > 0).long()),
        loss_fn=lambda outputs, batch: nn.functional.cross_entropy(outputs, batch[1]),
    )


@pytest.mark.timeout(120)
def test_a_link_at_the_staging_name_does_not_block_the_save(tmp_path: Path) -> None:
    victim_dir, out = tmp_path / "elsewhere", tmp_path / "run"
    victim_dir.mkdir()
    out.mkdir()
    (out / "checkpoint-2.tmp").symlink_to(victim_dir)
    _trainer(out).train()
    verify_checkpoint(out / "checkpoint-2")
    assert list(victim_dir.iterdir()) == []


@pytest.mark.timeout(120)
def test_a_link_at_the_old_name_does_not_block_saving_a_step_again(tmp_path: Path) -> None:
    """The same step saved twice: the first checkpoint-2 is moved aside under a name a
    planted link used to block."""
    victim_dir, out = tmp_path / "elsewhere", tmp_path / "run"
    victim_dir.mkdir()
    trainer = _trainer(out)
    trainer.train()
    (out / "checkpoint-2.old").symlink_to(victim_dir)
    trainer.save_checkpoint()
    verify_checkpoint(out / "checkpoint-2")
    assert list(victim_dir.iterdir()) == []
    assert (out / "checkpoint-2.old").is_symlink()  # left as it was: never followed
