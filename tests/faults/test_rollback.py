"""A rollback keeps the checkpoints it needs (issue 36, item 2).

A run resumed from an older checkpoint starts a new branch beside the old
one's later checkpoints. Ranked by step, the old branch's looked newer:
`save_total_limit` deleted the checkpoint resumed from and the new branch's
own saves (the save then crashed reading the manifest it had just deleted),
and a later `resume_from_checkpoint=True` picked the abandoned branch. A
`checkpoint-99` link did the same, and was resumed from.

The Trainer cases run in this process (a one-rank group, a few seconds each).
The 20 rollback trials drive the Checkpointer itself, with real files and a
one-rank group, without training: random save intervals, limits and resume
points, and a stray link now and then.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

import phalanx
from phalanx.train import ResumeWarning, Trainer, TrainingArguments
from phalanx.train.checkpoint.checkpointer import Checkpointer
from phalanx.train.checkpoint.directory import MANIFEST, list_checkpoints, verify_checkpoint

pytestmark = pytest.mark.faults


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, batch: list[Tensor]) -> Tensor:
        return self.net(batch[0])


def _xent(outputs: Tensor, batch: list[Tensor]) -> Tensor:
    return nn.functional.cross_entropy(outputs, batch[1])


def _trainer(out: Path, **overrides: Any) -> Trainer:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 4, generator=gen)
    settings: dict[str, Any] = {
        "output_dir": str(out),
        "max_steps": 12,
        "save_steps": 2,
        "per_device_train_batch_size": 4,
        "report_to": [],
        "disable_tqdm": True,
        **overrides,
    }
    data = TensorDataset(x, (x[:, 0] > 0).long())
    return Trainer(
        model=_Net(), args=TrainingArguments(**settings), train_dataset=data, loss_fn=_xent
    )


def _names(out: Path) -> list[str]:
    return sorted((p.name for p in out.iterdir()), key=lambda n: (len(n), n))


def _step_saved(checkpoint: Path) -> int:
    return int(torch.load(checkpoint / "trainer.pt", weights_only=True)["global_step"])


@pytest.mark.timeout(120)
def test_a_rollback_keeps_the_checkpoint_it_resumed_from_and_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's case: checkpoints 8, 10, 12; resumed from 8 with save_total_limit=2, the
    new branch's 10 replaced the old 10, 8 was deleted and the abandoned 12 kept; a later
    resume_from_checkpoint=True took 12."""
    _trainer(tmp_path, save_total_limit=3).train()
    assert _names(tmp_path) == ["checkpoint-8", "checkpoint-10", "checkpoint-12"]
    old_ten = json.loads((tmp_path / "checkpoint-10" / MANIFEST).read_text())["files"]
    branch = _trainer(tmp_path, save_total_limit=2, max_steps=10, learning_rate=1e-4)
    with pytest.warns(ResumeWarning, match="learning_rate"):  # the point of this rollback
        out = branch.train(resume_from_checkpoint=tmp_path / "checkpoint-8")
    assert out.global_step == 10
    printed = capsys.readouterr().out
    assert (tmp_path / "checkpoint-8").is_dir(), f"the checkpoint resumed from went: {printed}"
    verify_checkpoint(tmp_path / "checkpoint-8")
    new_ten = json.loads((tmp_path / "checkpoint-10" / MANIFEST).read_text())["files"]
    assert new_ten["model.pt"] != old_ten["model.pt"], "checkpoint-10 is still the old branch's"
    # the old branch's 10 was moved aside with one line, its 12 left alone (not this run's)
    aside = [n for n in _names(tmp_path) if n.endswith(".abandoned")]
    assert len(aside) == 1 and aside[0].startswith("checkpoint-10."), _names(tmp_path)
    assert f"moved aside to {aside[0]}" in printed
    assert (tmp_path / "checkpoint-12").is_dir()
    # resume_from_checkpoint=True: the newest written, this branch's 10, not the old 12
    later = _trainer(tmp_path, save_total_limit=2, max_steps=11, learning_rate=1e-4)
    assert later.train(resume_from_checkpoint=True).resumed_from == str(tmp_path / "checkpoint-10")


@pytest.mark.timeout(120)
def test_a_rollback_with_a_limit_of_one_keeps_its_new_checkpoint(tmp_path: Path) -> None:
    """save_total_limit=1 after a rollback from 8 (12 present): the new 10 was deleted by its
    own rotation, and the save crashed reading its manifest."""
    _trainer(tmp_path, save_steps=4, save_total_limit=2).train()
    assert _names(tmp_path) == ["checkpoint-8", "checkpoint-12"]
    branch = _trainer(tmp_path, save_total_limit=1, max_steps=10)
    out = branch.train(resume_from_checkpoint=tmp_path / "checkpoint-8")
    assert out.global_step == 10
    verify_checkpoint(tmp_path / "checkpoint-10")
    assert _step_saved(tmp_path / "checkpoint-10") == 10
    # 8 went only once 10, newer and the run's own, was complete; 12 is not this run's
    assert _names(tmp_path) == ["checkpoint-10", "checkpoint-12"]


@pytest.mark.timeout(120)
def test_a_checkpoint_link_is_neither_resumed_from_nor_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A `checkpoint-99` link to another run's checkpoint: it was resumed from, and, ranked
    newest, made save_total_limit delete the run's own checkpoints."""
    other, run = tmp_path / "other", tmp_path / "run"
    _trainer(other, max_steps=4).train()
    _trainer(run, max_steps=4, save_total_limit=1).train()
    (run / "checkpoint-99").symlink_to(other / "checkpoint-4", target_is_directory=True)
    resumed = _trainer(run, max_steps=6, save_total_limit=1)
    out = resumed.train(resume_from_checkpoint=True)
    assert out.resumed_from == str(run / "checkpoint-4")
    assert "checkpoint-99 is a symbolic link" in capsys.readouterr().out
    assert _names(run) == ["checkpoint-6", "checkpoint-99"]
    assert (run / "checkpoint-99").is_symlink()
    verify_checkpoint(other / "checkpoint-4")  # the link's target, untouched
    assert _names(other) == ["checkpoint-2", "checkpoint-4"]


# ------------------------------------------------------------ 20 trials, no training


class _Counter:
    """A Stateful holding the step it was saved at, and a token naming the save."""

    def __init__(self, step: int = 0) -> None:
        self.step = step

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def _token(checkpoint: Path) -> str:
    return (checkpoint / "token.txt").read_text()


def _tokens_in(out: Path) -> set[str]:
    """The token of every checkpoint directory in `out`, under any name (moved aside too)."""
    if not out.is_dir():
        return set()
    return {_token(p) for p in out.iterdir() if p.is_dir() and not p.is_symlink()}


class _Trial:
    """One output_dir: a first run, then rollbacks to random checkpoints, each a new run."""

    def __init__(self, out: Path, stray: Path, rng: random.Random) -> None:
        self.out, self.stray, self.rng = out, stray, rng
        self.world = phalanx.init(backend="gloo")
        self.saved = 0
        self.ancestry: dict[str, set[str]] = {}
        """Each save's token -> the tokens of the checkpoints its lineage continued."""

    def save(self, checkpointer: Checkpointer, step: int) -> str:
        self.saved += 1
        token = f"{self.out.name}-{self.saved}"
        checkpointer.save({"counter": _Counter(step)}, step, {"token.txt": token.encode()})
        return token

    def run(self, resume: Path | None, limit: int | None, every: int, saves: int) -> None:
        """One run: resume from `resume` (None: from scratch), save `saves` times."""
        checkpointer = Checkpointer(self.world, self.out, limit)
        start, resumed_token, ancestors = 0, None, set[str]()
        if resume is not None:
            chosen = checkpointer.choose(resume)
            assert chosen == resume
            counter = _Counter()
            checkpointer.load(chosen, {"counter": counter})
            start, resumed_token = counter.step, _token(chosen)
            ancestors = self.ancestry.get(resumed_token, set()) | {resumed_token}
        before = _tokens_in(self.out)
        own: list[str] = []
        for step in range(start + every, start + every * saves + 1, every):
            own.append(self.save(checkpointer, step))
            self.ancestry[own[-1]] = ancestors | set(own[:-1])
            self.check(checkpointer, step, own, resumed_token, limit, before - ancestors)

    def check(
        self,
        checkpointer: Checkpointer,
        step: int,
        own: list[str],
        resumed: str | None,
        limit: int | None,
        others: set[str],
    ) -> None:
        newest = self.out / f"checkpoint-{step}"
        verify_checkpoint(newest)
        assert _token(newest) == own[-1], f"checkpoint-{step} is not the save just made"
        present = _tokens_in(self.out)
        if resumed is not None and (limit is None or len(own) < limit):
            assert resumed in present, f"the checkpoint resumed from ({resumed}) was deleted"
        assert others <= present, f"another branch's checkpoints went: {others - present}"
        assert checkpointer.choose(True) == newest, "resume_from_checkpoint=True missed it"
        assert _tokens_in(self.stray) == {"stray"}, "the link's target was touched"


def _one_trial(root: Path, index: int, rng: random.Random) -> None:
    out, stray = root / f"trial{index}", root / f"stray{index}"
    (stray / "checkpoint-3").mkdir(parents=True)
    (stray / "checkpoint-3" / "token.txt").write_text("stray")
    trial = _Trial(out, stray, rng)
    every = rng.choice([1, 2, 3])
    trial.run(None, rng.choice([1, 2, 3, None]), every, rng.randint(2, 6))
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.3 and not (out / "checkpoint-99").is_symlink():
            (out / "checkpoint-99").symlink_to(stray / "checkpoint-3", target_is_directory=True)
        choices = [path for _, path in list_checkpoints(out)]
        resume = rng.choice(choices)
        trial.run(resume, rng.choice([1, 2, 3, None]), rng.choice([1, 2, 3]), rng.randint(1, 5))


@pytest.fixture
def quick_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder in memory (tmpfs) where there is one: real files whose fsyncs cost nothing
    (the trials test which checkpoints stay, not durability; fsyncs on a shared disk took
    two thirds of their time)."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(prefix="phalanx-rollback-", dir=shm) as folder:
        yield Path(folder)


@pytest.mark.timeout(120)
def test_20_rollback_trials_lose_neither_the_resumed_from_nor_the_newest(quick_dir: Path) -> None:
    rng = random.Random(36)
    for index in range(20):
        _one_trial(quick_dir, index, rng)
        shutil.rmtree(quick_dir / f"trial{index}")
