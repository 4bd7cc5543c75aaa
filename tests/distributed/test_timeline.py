"""The timeline in real ranks: the Trainer's spans, DDP's wiring, and nothing when off."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from phalanx import zero3
from phalanx.diagnostics import timeline as timelines
from phalanx.diagnostics.trace import merge
from phalanx.train import Trainer, TrainingArguments
from tests.harness import run_workers

STEPS = 4


class _Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))

    def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)


def _train_with_timeline(rank: int, world: int, out: str) -> dict[str, Any]:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    path = Path(out) / f"trace-w{world}.json"
    args = TrainingArguments(
        output_dir=str(Path(out) / f"run-w{world}"), max_steps=STEPS, save_steps=2,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, report_to=[],
        disable_tqdm=True, ddp_backend="gloo", timeline=str(path),
    )  # fmt: skip
    return _trace_of(Trainer(_Regression(), args, train_dataset=data), path, rank, world)


def _trace_of(trainer: Trainer, path: Path, rank: int, world: int) -> dict[str, Any]:
    """Train, write this rank's spans; rank 0 merges them: (pid, tid, name) and the steps."""
    trainer.train()
    assert trainer.timeline is not None
    trainer.timeline.write()
    if rank != 0:
        return {}
    trace = merge(path, world, wait_s=30)
    spans = [(e["pid"], e["tid"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X"]
    return {"spans": spans, "steps": trace["phalanx"]["steps"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2])
def test_trainer_records_every_phase_of_its_steps(tmp_path: Path, world: int) -> None:
    outs = run_workers(_train_with_timeline, world, str(tmp_path), init_pg=False)
    spans, steps = outs[0].value["spans"], outs[0].value["steps"]
    for rank in range(world):
        names = [name for pid, _, name in spans if pid == rank]
        # Two micro-batches per step: two forwards, one synced backward and wait per step.
        assert names.count("forward") == 2 * STEPS
        assert names.count("backward") == STEPS
        assert names.count("wait for buckets") == STEPS
        assert names.count("optimizer step") == STEPS
        assert names.count("checkpoint save") == 2  # steps 2 and 4
        assert len(steps[str(rank)]) == STEPS
        assert all(s["samples"] == 8 for s in steps[str(rank)])  # 2 micro-batches of 4
    comm = [name for _, tid, name in spans if tid == 1]
    if world == 1:
        assert comm == []  # no DDP in a world of one: nothing to send
    else:
        assert len(comm) >= world * STEPS and all(n.startswith("bucket ") for n in comm)
        assert all(s["bytes"] > 0 for r in steps.values() for s in r)


def _ddp_timeline(rank: int, world: int, out: str) -> dict[str, Any]:
    from phalanx.ddp.module import DistributedDataParallel

    off = DistributedDataParallel(nn.Linear(4, 4))
    off(torch.randn(3, 4)).sum().backward()  # its first training forward: no timeline asked
    os.environ[timelines.ENV] = str(Path(out) / "ddp.json")
    on = DistributedDataParallel(nn.Linear(4, 4))
    other = DistributedDataParallel(nn.Linear(4, 4))
    with torch.no_grad():
        on(torch.randn(5, 4))  # not training: no forward span, and no timeline made yet
    assert on.timeline is None
    for model in (off, on, other):
        model(torch.randn(3, 4)).sum().backward()
    timeline = on.timeline
    assert timeline is not None and other.timeline is not None
    # A script's own optimizer step is a span; one inside the Trainer's span is not another.
    torch.optim.SGD(on.parameters(), lr=0.1).step()
    with timeline.span("optimizer step"):
        torch.optim.SGD(on.parameters(), lr=0.1).step()
    for model in (on, other):
        assert model.timeline is not None
        model.timeline.write()
    return {
        "off": off.timeline is None and off.reducer.timeline is None,
        "own": other.timeline is not timeline and on.reducer.timeline is timeline,
        "spans": [name for name, *_ in timeline.spans],
        "other spans": [name for name, *_ in other.timeline.spans],
        "samples": [s.samples for s in timeline.steps],
    }


@pytest.mark.timeout(60)
def test_ddp_makes_its_env_timeline_at_its_first_training_forward(tmp_path: Path) -> None:
    """Each wrapper records into its own timeline, made at its first training forward
    when PHALANX_TIMELINE is set (and none was handed to it); the merge puts both of a
    rank's files on its tracks, each optimizer step once."""
    for out in run_workers(_ddp_timeline, 2, str(tmp_path)):
        assert out.value["off"] and out.value["own"]
        assert out.value["spans"].count("forward") == 1
        assert out.value["spans"].count("backward") == 1
        assert out.value["spans"].count("optimizer step") == 2  # the script's, the span's
        assert out.value["other spans"].count("forward") == 1
        assert out.value["other spans"].count("optimizer step") == 2  # the same two, timed
        assert out.value["samples"] == [3]
    trace = merge(tmp_path / "ddp.json", 2, wait_s=30)
    for rank in (0, 1):
        names = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == rank]
        assert names.count("forward") == 2 and names.count("backward") == 2
        assert names.count("optimizer step") == 2  # each once, though two recorders timed it
        assert len(trace["phalanx"]["steps"][str(rank)]) == 2


def test_a_merge_leaves_out_files_of_an_earlier_run(tmp_path: Path) -> None:
    """A rank's files left at the same path by another process (an earlier run) are
    removed when this process's timeline starts, so the merge cannot mix them in."""
    path = tmp_path / "t.json"
    stale = path.with_name(f"{path.name}.rank-0.1-deadbeef.json")
    stale.write_text(json.dumps({"rank": 0, "origin_ns": 0, "spans": [["old", "compute", 0, 5, {}]],
                                 "steps": []}))  # fmt: skip
    timeline = timelines.Timeline(path, 0, 1)
    timeline.clear_stale_files()
    timeline.add("new", "compute", 0, 5)
    timeline.write()
    names = [e["name"] for e in merge(path, 1, wait_s=1)["traceEvents"] if e["ph"] == "X"]
    assert names == ["new"] and not stale.exists()


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:
        x, y = batch
        for block in self.blocks:
            x = torch.tanh(block(x))
        return nn.functional.mse_loss(self.head(x), y)


def _stage3_timeline(rank: int, world: int, out: str, reshard: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    path = Path(out) / f"trace-zero3-{reshard}.json"
    args = TrainingArguments(
        output_dir=str(Path(out) / f"run-zero3-{reshard}"), max_steps=STEPS, save_steps=0,
        zero_stage=3, zero3_reshard_after_forward=reshard, per_device_train_batch_size=4,
        report_to=[], disable_tqdm=True, ddp_backend="gloo", timeline=str(path),
    )  # fmt: skip
    trainer = Trainer(_Blocks(), args, train_dataset=data)
    trace = _trace_of(trainer, path, rank, world)
    params = zero3.full_state_dict(trainer.model, to=0) or {}  # rank 0's
    return {**trace, "params": {name: t.tolist() for name, t in params.items()}}


@pytest.mark.timeout(120)
def test_stage3_records_each_units_gathers_and_reductions(tmp_path: Path) -> None:
    """Three blocks and the root: per step, each block is gathered before its forward and
    again before its backward (it reshards after forward), the root once; every unit
    reduce-scatters once. Steps carry the bytes, what the thread waited, and samples.
    With zero3_reshard_after_forward=False each block is gathered once a step (it stays
    gathered until its backward), and the run trains the very same parameters."""
    runs = {
        reshard: run_workers(_stage3_timeline, 2, str(tmp_path), reshard, init_pg=False)[0].value
        for reshard in (True, False)
    }
    kept = runs[False]
    assert runs[True]["params"].keys() == kept["params"].keys()
    for name, tensor in runs[True]["params"].items():
        assert tensor == kept["params"][name], name
    for rank in range(2):
        comm = [name for pid, tid, name in kept["spans"] if pid == rank and tid == 1]
        assert all(comm.count(f"gather blocks.{i}") == STEPS for i in range(3)), comm
    value = runs[True]
    for rank in range(2):
        comm = [name for pid, tid, name in value["spans"] if pid == rank and tid == 1]
        for i in range(3):
            assert comm.count(f"gather blocks.{i}") == 2 * STEPS, comm
            assert comm.count(f"reduce-scatter blocks.{i}") == STEPS, comm
        assert comm.count("gather root") == STEPS and comm.count("reduce-scatter root") == STEPS
        compute = [name for pid, tid, name in value["spans"] if pid == rank and tid == 0]
        assert compute.count("forward") == STEPS and compute.count("backward") == STEPS
        steps = value["steps"][str(rank)]
        assert len(steps) == STEPS
        assert all(s["bytes"] > 0 and s["samples"] == 4 and s["exposed_ms"] > 0 for s in steps)
