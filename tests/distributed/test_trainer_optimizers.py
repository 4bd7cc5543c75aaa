"""A user's own optimizer at every stage (issue 35): `optimizer=`, Hugging Face's
`optimizers=(optimizer, scheduler)` and `optimizer_cls_and_kwargs=(cls, kwargs)` train
exactly as the Trainer's built-in AdamW does, at stages 0-3; under zero_offload="disk" the
user's optimizer state lives in the run's offload files; what cannot work is one line.

Real gloo ranks. Each route trains the same model, data and seed for 6 steps; the final
whole parameters must equal the built-in's (≤ 1e-6; they are bit-identical here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import phalanx
from phalanx import zero3
from phalanx.errors import ConfigurationError
from phalanx.train import Trainer
from tests.distributed.test_trainer_zero import _args, _data, _Net, _xent
from tests.harness import run_workers

STEPS = 6
ROUTES = ("built-in", "optimizer", "optimizers", "cls_and_kwargs")


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """The Trainer's own two groups: weight decay on matrices only."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}]


def _route(stage: int, route: str, out: Path) -> dict[str, torch.Tensor] | None:
    model: nn.Module = _Net()
    kwargs: dict[str, Any] = {}
    if route in ("optimizer", "optimizers"):
        if stage == 3:
            zero3.shard_model(model)  # stage 3: the optimizer steps the units' shards
        optimizer = torch.optim.AdamW(_groups(model), lr=1e-2)
        if route == "optimizer":
            kwargs["optimizer"] = optimizer
        else:  # the Trainer's default schedule, written by hand: linear to 0, no warmup
            schedule = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda s: max(0.0, (STEPS - s) / STEPS)
            )
            kwargs["optimizers"] = (optimizer, schedule)
    elif route == "cls_and_kwargs":
        kwargs["optimizer_cls_and_kwargs"] = (torch.optim.AdamW, {"lr": 1e-2})
    args = _args(out / f"{stage}-{route}", zero_stage=stage, max_steps=STEPS)
    trainer = Trainer(model=model, args=args, train_dataset=_data(), loss_fn=_xent, **kwargs)
    trainer.train()
    if stage == 3:
        return zero3.full_state_dict(trainer.model, to=0)
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _all_routes(rank: int, world: int, out_dir: str) -> dict[int, dict[str, float]]:
    phalanx.init(backend="gloo")
    gaps: dict[int, dict[str, float]] = {}
    for stage in (0, 1, 2, 3):
        finals = {route: _route(stage, route, Path(out_dir)) for route in ROUTES}
        builtin = finals["built-in"]
        gaps[stage] = {}
        for route in ROUTES[1:]:
            theirs = finals[route]
            if rank == 0 or stage != 3:  # stage 3's whole state is gathered on rank 0
                assert builtin is not None and theirs is not None
                assert builtin.keys() == theirs.keys()
                gaps[stage][route] = max(
                    float((theirs[k] - builtin[k]).abs().max()) for k in theirs
                )
    return gaps


@pytest.mark.timeout(240)
def test_every_route_of_your_optimizer_trains_as_the_built_in_at_every_stage(
    tmp_path: Path,
) -> None:
    outs = run_workers(_all_routes, 2, str(tmp_path), init_pg=False, timeout=200)
    for stage, gaps in outs[0].value.items():
        assert set(gaps) == set(ROUTES[1:]), (stage, gaps)
        for route, gap in gaps.items():
            assert gap <= 1e-6, f"stage {stage}, {route}: {gap}"


def _offloaded_state(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """Stage 3 under zero_offload="disk", your optimizer built after sharding: where its
    state lives once it has stepped."""
    phalanx.init(backend="gloo")
    args = _args(Path(out_dir), zero_stage=3, max_steps=3, zero_offload="disk")
    model = zero3.shard_model(_Net())
    trainer = Trainer(model=model, args=args, train_dataset=_data(), loss_fn=_xent,
                      optimizer=torch.optim.Adam(model.parameters(), lr=1e-2))  # fmt: skip
    trainer.train()
    files = trainer.strategy.offload.files()  # type: ignore[union-attr]
    states = [
        getattr(t, "_local_tensor", t)
        for state in trainer.optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0
    ]
    held = [files.holds(t) for t in states if t.numel() > 1]  # one number stays in memory
    on_disk = sum(f.stat().st_size for f in files.directory.rglob("*") if f.is_file())
    trainer.close()
    return {"states": len(states), "in_files": all(held), "bytes": on_disk,
            "removed": not files.directory.exists(), "held": held}  # fmt: skip


@pytest.mark.timeout(120)
def test_your_optimizer_under_disk_offload_keeps_its_state_in_files(tmp_path: Path) -> None:
    for o in run_workers(_offloaded_state, 2, str(tmp_path), init_pg=False, timeout=90):
        v = o.value
        assert v["states"] > 0 and v["in_files"], str(v)  # exp_avg, exp_avg_sq: file mappings
        assert v["bytes"] > 0 and v["removed"], v  # on disk while training, gone at close


def _refusals(rank: int, world: int, out_dir: str) -> list[str]:
    phalanx.init(backend="gloo")
    model = _Net()
    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(list(_data()[:4])).sum().backward()
    stepped.step()
    zero = phalanx.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
    foreign = torch.optim.SGD(_Net().parameters(), lr=0.1)
    attempts: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"zero_stage": 1}, {"optimizer": stepped}),
        ({"zero_stage": 0}, {"optimizer": zero}),
        ({"zero_stage": 1}, {"optimizer_cls_and_kwargs": (torch.optim.Adafactor, {})}),
        ({"zero_offload": "disk", "zero_stage": 3},
         {"optimizer_cls_and_kwargs": (torch.optim.LBFGS, {})}),
        ({}, {"optimizer": stepped, "optimizers": (stepped, None)}),
        ({"zero_stage": 2}, {"optimizer": foreign}),
    ]  # fmt: skip
    messages = []
    for i, (settings, kwargs) in enumerate(attempts):
        args = _args(Path(out_dir) / str(i), max_steps=2, **settings)
        try:
            Trainer(model=model, args=args, train_dataset=_data(), loss_fn=_xent, **kwargs)
            messages.append("accepted")
        except ConfigurationError as exc:
            messages.append(str(exc))
    return messages


@pytest.mark.timeout(90)
def test_optimizers_that_cannot_work_are_one_line_on_every_rank(tmp_path: Path) -> None:
    outs = run_workers(_refusals, 2, str(tmp_path), init_pg=False)
    said = outs[0].value
    assert said == outs[1].value and len(said) == 6, said
    assert "has stepped already: ZeRO shards an optimizer before its first step" in said[0]
    assert "pass zero_stage=1 or 2 instead of optimizer=ZeroRedundancyOptimizer" in said[1]
    assert "Adafactor cannot be sharded by elements" in said[2]
    assert "LBFGS re-evaluates the loss several times per step through a closure" in said[3]
    assert "optimizer= and optimizers=(optimizer, scheduler) both give an optimizer" in said[4]
    assert "steps 4 tensors that are not parameters of the model" in said[5]
    assert all("\n" not in m and " — " in m for m in said)
