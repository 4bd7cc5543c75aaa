"""HSDP in the Trainer (zero_stage=3 with zero3_shard_size): the model sharded over rows of
ranks and replicated across them, exactly as a hand-sharded model on the same 2-D mesh
trains; its checkpoint resumes with every rank sharding (a 1-D mesh); a world the size
does not divide is refused on every rank in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import phalanx
from phalanx import zero3
from phalanx.errors import ConfigurationError
from phalanx.train import Trainer
from tests.distributed.test_trainer_zero import _args, _data, _Net, _xent
from tests.harness import run_workers

STEPS = 6


def _full(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The whole parameters on rank 0 (empty elsewhere)."""
    return dict(zero3.full_state_dict(trainer.model, to=0) or {})


def _gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((float((a[k] - b[k]).abs().max()) for k in a), default=0.0)


def _hsdp(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    phalanx.init(backend="gloo")
    root = Path(out_dir)
    trainer = Trainer(
        model=_Net(),
        args=_args(root / "hsdp", zero_stage=3, zero3_shard_size=2, max_steps=STEPS,
                   save_steps=STEPS),
        train_dataset=_data(), loss_fn=_xent,
    )  # fmt: skip
    trainer.train()
    params = list(trainer.model.parameters())
    placements = {str(tuple(p.placements)) for p in params if isinstance(p, DTensor)}
    assert all(isinstance(p, DTensor) for p in params)
    hsdp = _full(trainer)
    # The same run by hand: the user shards over the (2, 2) mesh and brings the optimizer.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _Net()
    for unit in (model.net[0], model.net[3]):
        zero3.fully_shard(unit, mesh=mesh)
    zero3.fully_shard(model, mesh=mesh)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
        lr=1e-2,
    )
    by_hand = Trainer(model=model, args=_args(root / "hand", zero_stage=3, max_steps=STEPS),
                      train_dataset=_data(), loss_fn=_xent, optimizer=optimizer)  # fmt: skip
    by_hand.train()
    hand = _full(by_hand)
    # Its checkpoint, resumed by every rank sharding (no zero3_shard_size): the same state.
    resumed = Trainer(model=_Net(), args=_args(root / "hsdp", zero_stage=3, max_steps=STEPS),
                      train_dataset=_data(), loss_fn=_xent)  # fmt: skip
    resumed.train(resume_from_checkpoint=True)
    flat = _full(resumed)
    refused = ""
    try:
        Trainer(model=_Net(), args=_args(root / "three", zero_stage=3, zero3_shard_size=3),
                train_dataset=_data(), loss_fn=_xent)  # fmt: skip
    except ConfigurationError as exc:
        refused = str(exc)
    return {
        "placements": sorted(placements),
        "hand_gap": _gap(hsdp, hand),
        "resumed_gap": _gap(hsdp, flat),
        "compared": len(hsdp),
        "refused": refused,
    }


@pytest.mark.timeout(240)
def test_hsdp_trains_as_the_same_mesh_by_hand_and_resumes_flat(tmp_path: Path) -> None:
    outs = [o.value for o in run_workers(_hsdp, 4, str(tmp_path), timeout=200, init_pg=False)]
    assert outs[0]["compared"] == 4, outs  # rank 0 holds the whole model
    for out in outs:
        assert out["placements"] == ["(Replicate(), Shard(dim=0))"], out
        assert out["hand_gap"] == 0.0 and out["resumed_gap"] == 0.0, out
        assert "zero3_shard_size=3 does not divide the 4 ranks" in out["refused"], out
        assert "\n" not in out["refused"]
