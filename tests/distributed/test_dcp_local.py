"""DCP's format written by every rank alone (train/checkpoint/dcp_local.py): torch's own
`dcp.load` reads it, into torch's FSDP2 too, at the world size that wrote it and another.

Two ranks write a fully_shard model's and its AdamW's sharded state dicts with
`dcp_local.save` (one all-gather, no planning collective), and the same state
with torch's `dcp.save`; torch's `dcp.load` (not phalanx's reader) reads both
back into a torch FSDP2 model on 2 ranks and into a plain model on 1 rank,
and every tensor equals the saved one. The metadata is DCP's own, chunk for
chunk and byte for byte where the items are the same.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.harness import run_workers


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 5), nn.Linear(5, 3))


def _trained(sharder: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _net()
    for layer in model.children():
        if isinstance(layer, nn.Linear):
            sharder(layer)
    sharder(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    for _ in range(2):
        model(torch.randn(4, 6)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def _write_both(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    import phalanx
    from phalanx.train.checkpoint import dcp_local

    model, optimizer = _trained(phalanx.fully_shard)
    state = _state(model, optimizer)
    here = phalanx.init()
    gloo = dist.new_group(backend="gloo")
    writers = dataclasses.replace(here, process_group=gloo)
    dcp_local.save(state, Path(root) / "local", writers)
    dcp.save(state, checkpoint_id=str(Path(root) / "torch"))
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {k: v.tolist() for k, v in full.items()}


def _read_into_torch_fsdp2(rank: int, world: int, root: str, which: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.fsdp import fully_shard

    model = _net()
    for layer in model.children():
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(1, 6)).sum().backward()
    optimizer.step()  # AdamW's state exists: the load fills it
    optimizer.zero_grad()
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=str(Path(root) / which))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    full = {k: v.full_tensor().tolist() for k, v in model.state_dict().items()}
    moments = [v["exp_avg"].full_tensor().tolist() for v in optimizer.state.values()]
    return {"model": full, "exp_avg": moments}


@pytest.mark.timeout(200)
def test_torch_dcp_load_reads_a_checkpoint_every_rank_wrote_alone(tmp_path: Path) -> None:
    written = run_workers(_write_both, 2, str(tmp_path), timeout=120)
    saved = written[0].value
    for world in (2, 3):
        local = run_workers(_read_into_torch_fsdp2, world, str(tmp_path), "local", timeout=120)
        theirs = run_workers(_read_into_torch_fsdp2, world, str(tmp_path), "torch", timeout=120)
        assert local[0].value["model"] == saved
        assert local[0].value == theirs[0].value  # the optimizer state too


_COLLECTIVES = [
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
]


def _count_collectives(rank: int, world: int, root: str) -> dict[str, Any]:
    """torch.distributed's collectives made by the writer threads, and those the training
    thread made inside a save written there and then (DCP's planner among them)."""
    import threading
    from collections import Counter

    from tests.faults.trainkit import make_trainer

    counts: dict[str, Counter[str]] = {"writer": Counter(), "sync save": Counter()}
    in_save = [False]
    for name in _COLLECTIVES:
        original = getattr(dist, name)

        def counted(*args: Any, _name: str = name, _original: Any = original, **kw: Any) -> Any:
            thread = threading.current_thread().name
            if thread.startswith("phalanx-save"):
                counts["writer"][_name] += 1
            elif in_save[0]:
                counts["sync save"][_name] += 1
            return _original(*args, **kw)

        setattr(dist, name, counted)
    background = make_trainer(Path(root) / "async", save_steps=4, zero_stage=3)
    background.train()  # two background saves: steps 4 and 8
    sync = make_trainer(Path(root) / "sync", save_steps=0, zero_stage=3, save_async=False)
    sync.train()
    in_save[0] = True
    sync.save_checkpoint()
    in_save[0] = False
    return {kind: dict(c) for kind, c in counts.items()}


@pytest.mark.timeout(200)
def test_a_background_save_makes_two_exchanges_and_no_planning_collective(
    tmp_path: Path,
) -> None:
    runs = run_workers(_count_collectives, 2, str(tmp_path), init_pg=False, timeout=180)
    for run in runs:
        # Per save: the agreement (an all-gather of every rank's lengths: sizes, then
        # bytes) and the outcome (a broadcast: size, then bytes); nothing per entry.
        assert run.value["writer"] == {"all_gather": 2 * 2, "broadcast": 2 * 2}, run.value
        assert sum(run.value["sync save"].values()) > 4, run.value  # DCP's planning, per entry
    print("collectives per save:", runs[0].value)


def _phalanx_saves(rank: int, world: int, out: str) -> list[list[float]]:
    from tests.faults.trainkit import make_trainer

    trainer = make_trainer(out, model=_net_batch(), zero_stage=3, max_steps=4, save_steps=4)
    trainer.train()  # checkpoint-4, written in the background, every rank its part alone
    return _full(trainer.model)


def _torch_rewrites(rank: int, world: int, checkpoint: str) -> None:
    """torch's FSDP2 reads the phalanx checkpoint with torch's dcp.load, then writes the
    model and optimizer back with torch's dcp.save in place of phalanx's."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    model = _net_batch()
    for block in model.modules():
        if isinstance(block, nn.Linear):
            fully_shard(block)
    fully_shard(model)
    # The Trainer's AdamW: decay on matrices, none on vectors, a schedule (initial_lr).
    params = list(model.parameters())
    groups: list[dict[str, Any]] = [
        {"params": [p for p in params if p.dim() >= 2]},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    model([torch.randn(1, 6)]).sum().backward()
    optimizer.step()  # AdamW's state exists: the load fills it
    where = Path(checkpoint)
    entries = {
        "model": {"model": get_model_state_dict(model)},
        "optimizer": {"optimizer": get_optimizer_state_dict(model, optimizer)},
    }
    for name, state in entries.items():
        dcp.load(state, checkpoint_id=str(where / name))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(where / name)
        dist.barrier()
        dcp.save(state, checkpoint_id=str(where / name))


def _phalanx_resumes(rank: int, world: int, checkpoint: str) -> list[list[float]]:
    from tests.faults.trainkit import make_trainer

    out = Path(checkpoint).parent.with_name(f"resumed{world}")
    trainer = make_trainer(out, model=_net_batch(), zero_stage=3, max_steps=4)
    assert trainer.train(resume_from_checkpoint=checkpoint).resumed_from == checkpoint
    return _full(trainer.model)


def _full(model: nn.Module) -> list[list[float]]:
    """The whole parameters of a sharded model (a collective)."""
    return [p.full_tensor().reshape(-1).tolist() for p in model.parameters()]  # type: ignore[attr-defined]


class _Batched(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:
        return self.net(batch[0])


def _net_batch() -> nn.Module:
    torch.manual_seed(0)
    return _Batched()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_phalanx_resumes_a_checkpoint_torch_dcp_save_wrote(tmp_path: Path, world: int) -> None:
    from tests.checkpoints import rehash

    saved = run_workers(_phalanx_saves, 2, str(tmp_path / "run"), init_pg=False, timeout=120)
    checkpoint = tmp_path / "run" / "checkpoint-4"
    run_workers(_torch_rewrites, 2, str(checkpoint), timeout=120)
    rehash(checkpoint)  # the manifest agrees with torch's files (what a converter does)
    resumed = run_workers(_phalanx_resumes, world, str(checkpoint), init_pg=False, timeout=120)
    assert resumed[0].value == saved[0].value
