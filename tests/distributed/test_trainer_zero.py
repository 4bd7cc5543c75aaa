"""ZeRO in the Trainer: sharded checkpoints through DCP that reshard between world sizes.

A world-4 run with zero_stage 1, 2 and 3 saves mid-epoch; a world-2 run resumes
that checkpoint and must hold exactly the state the world-4 run consolidated
(parameters and optimizer state, compared as whole tensors); it trains on
and saves, and a world-4 run resumes that and must hold exactly the world-2
state. The optimizer is the real `phalanx.ZeroRedundancyOptimizer`, whose
`save_sharded` / `load_sharded` the checkpointer calls as a "sharded" entry.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

import phalanx
from phalanx import zero3
from phalanx.errors import CheckpointError, ConfigurationError
from phalanx.train import Trainer, TrainingArguments
from phalanx.train.checkpoint.directory import MANIFEST, verify_checkpoint
from tests.distributed.test_zero_state import _same
from tests.harness import run_workers

STAGES = (1, 2, 3)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Dropout(0.2), nn.Linear(24, 3))

    def forward(self, batch: list[Tensor]) -> Tensor:
        return self.net(batch[0])


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(96, 6, generator=gen)
    return TensorDataset(x, torch.randint(0, 3, (96,), generator=gen))


def _xent(outputs: Tensor, batch: list[Tensor]) -> Tensor:
    return nn.functional.cross_entropy(outputs, batch[1])


def _args(out_dir: Path, **overrides: Any) -> TrainingArguments:
    base: dict[str, Any] = {
        "output_dir": str(out_dir),
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-2,
        "weight_decay": 0.1,
        "max_grad_norm": 0.5,
        "report_to": [],
        "disable_tqdm": True,
        "ddp_backend": "gloo",
        "ddp_timeout": 60,
    }
    return TrainingArguments(**{**base, **overrides})


def _train_and_consolidate(out_dir: Path, stage: int, max_steps: int, tag: str) -> dict[str, Any]:
    """Train (resuming from the newest checkpoint), then write the consolidated state."""
    args = _args(out_dir, zero_stage=stage, max_steps=max_steps, save_steps=max_steps)
    trainer = Trainer(model=_Net(), args=args, train_dataset=_data(), loss_fn=_xent)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = trainer.train(resume_from_checkpoint=True)
    optimizer = trainer.optimizer
    if stage == 3:  # the model holds pieces, the optimizer is a plain AdamW over them
        state = {
            "model": zero3.full_state_dict(trainer.model, to=0),
            "optimizer": zero3.full_optimizer_state_dict(trainer.model, optimizer, to=0),
        }
        local = optimizer
    else:
        assert isinstance(optimizer, phalanx.ZeroRedundancyOptimizer)
        optimizer.consolidate_state_dict(to=0)
        local = optimizer.optim
        if trainer.world.is_main:
            state = {"model": trainer.model.state_dict(), "optimizer": optimizer.state_dict()}
    if trainer.world.is_main:
        torch.save(state, out_dir / f"{tag}.pt")
    return {
        "step": out.global_step,
        "epoch": trainer.state.epoch,
        "batches_done": trainer.state.batches_done,
        "train_loss": out.train_loss,
        "warnings": [str(w.message) for w in caught],
        "local_numel": sum(_local_numel(s) for s in local.state_dict()["state"][0].values()),
    }


def _local_numel(value: Any) -> int:
    """Elements this rank holds (a stage-3 DTensor's local shard)."""
    return int(value.to_local().numel() if hasattr(value, "to_local") else value.numel())


def _phase(rank: int, world: int, root: str, runs: list[tuple[str, int]]) -> dict[str, Any]:
    phalanx.init(backend="gloo")  # one group for all the Trainers of this worker
    return {
        f"{stage}/{tag}": _train_and_consolidate(Path(root) / f"stage{stage}", stage, steps, tag)
        for stage in STAGES
        for tag, steps in runs
    }


def _saved(root: Path, stage: int, tag: str) -> Any:
    return torch.load(root / f"stage{stage}" / f"{tag}.pt", weights_only=True)


@pytest.mark.slow  # make test-slow: four ranks; test_zero_state reshards 2 -> 3 in make test
@pytest.mark.timeout(300)
def test_a_zero_checkpoint_reshards_from_four_ranks_to_two_and_back(tmp_path: Path) -> None:
    # 96 samples, batches of 4: world 4 has 6 micro-batches per epoch, world 2 has 12.
    four = run_workers(_phase, 4, str(tmp_path), [("w4", 5)], init_pg=False, timeout=150)
    two = run_workers(
        _phase, 2, str(tmp_path), [("w2-load", 5), ("w2", 9)], init_pg=False, timeout=150
    )
    back = run_workers(_phase, 4, str(tmp_path), [("w4-load", 9)], init_pg=False, timeout=150)
    for stage in STAGES:
        assert _same(_saved(tmp_path, stage, "w2-load"), _saved(tmp_path, stage, "w4"))
        assert _same(_saved(tmp_path, stage, "w4-load"), _saved(tmp_path, stage, "w2"))
        # Checkpoint-5 of world 4 stood at sample 80 of epoch 0: world 2 continues there,
        # with nothing to do (max_steps 5), and reports the loss of those 5 steps.
        loaded = two[0].value[f"{stage}/w2-load"]
        assert (loaded["step"], loaded["epoch"], loaded["batches_done"]) == (5, 0, 10)
        assert loaded["train_loss"] == four[0].value[f"{stage}/w4"]["train_loss"]
        changed = [w for w in loaded["warnings"] if "world size 4 → 2" in w]
        assert changed and "epoch 0 continues at sample 80 of 96" in changed[0]
        # Checkpoint-9 of world 2: epoch 1, 2 micro-batches of 2 ranks = 16 samples;
        # world 4 takes 16 // (4 ranks x 4) = 1 micro-batch as done.
        reloaded = back[0].value[f"{stage}/w4-load"]
        assert (reloaded["step"], reloaded["epoch"], reloaded["batches_done"]) == (9, 1, 1)
        # The state really is sharded: each of 4 ranks keeps a quarter of a parameter's.
        whole = two[0].value[f"{stage}/w2"]["local_numel"]
        assert back[0].value[f"{stage}/w4-load"]["local_numel"] < whole
    manifest = json.loads((tmp_path / "stage2" / "checkpoint-9" / MANIFEST).read_text())
    assert manifest["entries"]["optimizer"] == "sharded"
    written = sorted(n for n in manifest["files"] if n.startswith("optimizer/"))
    assert written == ["optimizer/.metadata", "optimizer/__0_0.distcp", "optimizer/__1_0.distcp"]
    assert "optimizer.pt" not in manifest["files"]


def test_a_corrupt_shard_fails_verification(tmp_path: Path) -> None:
    """The manifest covers the DCP files every rank wrote, not only rank 0's."""
    args = _args(tmp_path, zero_stage=1, max_steps=2, save_steps=2)
    Trainer(model=_Net(), args=args, train_dataset=_data(), loss_fn=_xent).train()
    shard = tmp_path / "checkpoint-2" / "optimizer" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"__0_0.distcp does not match its checksum"):
        verify_checkpoint(tmp_path / "checkpoint-2")


def test_zero_in_one_process_trains_as_adamw_does(tmp_path: Path) -> None:
    """A world of one runs ZeRO too (one shard): same parameters, sharded checkpoint."""
    params = {}
    for stage in (0, 1, 2):
        args = _args(tmp_path / str(stage), zero_stage=stage, max_steps=6, save_steps=6)
        trainer = Trainer(model=_Net(), args=args, train_dataset=_data(), loss_fn=_xent)
        trainer.train()
        params[stage] = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.close()
        manifest = json.loads((tmp_path / str(stage) / "checkpoint-6" / MANIFEST).read_text())
        assert manifest["entries"]["optimizer"] == ("sharded" if stage else "replicated")
    for stage in (1, 2):
        for ours, plain in zip(params[stage], params[0], strict=True):
            assert (ours - plain).abs().max() <= 1e-6


def _logged_traffic(rank: int, world: int, out_dir: str) -> dict[int, dict[str, float]]:
    phalanx.init(backend="gloo")
    rows = {}
    for stage in (0, 1, 3):
        root = Path(out_dir) / f"log{stage}"
        args = _args(
            root,
            zero_stage=stage,
            max_steps=4,
            logging_steps=4,
            max_grad_norm=0.0,
            report_to=["jsonl"],
        )
        Trainer(model=_Net(), args=args, train_dataset=_data(), loss_fn=_xent).train()
        lines = (root / "metrics.jsonl").read_text().splitlines()
        rows[stage] = next(r for r in map(json.loads, lines) if "comm_bytes_per_step" in r)
    return rows


@pytest.mark.timeout(120)
def test_the_log_counts_zero_traffic(tmp_path: Path) -> None:
    """comm_bytes_per_step counts every stage's collectives: ZeRO-1's parameter all-gather
    after the step, and stage 3's gathers and reduce-scatters (it read 0 before)."""
    from phalanx.parallel.sharding import piece_of, row_numel

    rows = run_workers(_logged_traffic, 2, str(tmp_path), init_pg=False)[0].value
    params = list(_Net().parameters())
    whole = 4 * sum(p.numel() for p in params)  # fp32 bytes of the model
    # Stage 3's units are the two Linears (the Sequential's members that hold parameters);
    # each gathers for forward, again for backward (resharded after forward), and
    # reduce-scatters once, every parameter padded to 2 shards.
    padded = 4 * sum(2 * piece_of(p.numel(), 2, 0, row_numel(p.shape) or 1).chunk for p in params)
    assert rows[3]["comm_bytes_per_step"] == 3 * padded
    assert rows[3]["collectives_per_step"] == 6
    assert rows[3]["comm_wait_s"] > 0
    # ZeRO-1: DDP's all-reduce of the gradients, then the all-gather of the parameters.
    assert rows[1]["comm_bytes_per_step"] > rows[0]["comm_bytes_per_step"] + whole * 0.99


def _resume_old_stage3(rank: int, world: int, out_dir: str) -> str:
    args = _args(Path(out_dir), zero_stage=3, max_steps=4, save_steps=2)
    trainer = Trainer(model=_Net(), args=args, train_dataset=_data(), loss_fn=_xent)
    try:
        trainer.train(resume_from_checkpoint=True)
    except CheckpointError as exc:
        return str(exc)
    return "resumed"


def _write_flat_pieces(directory: Path, state: dict[str, torch.Tensor]) -> None:
    """The model entry as phalanx wrote it before stage 3 had DTensors: each parameter
    flattened to 1-D, with its shape beside it."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    shutil.rmtree(directory)
    flat = {k: v.reshape(-1).clone() for k, v in state.items()}
    shapes = {k: list(v.shape) for k, v in state.items()}
    writer = dcp.FileSystemWriter(str(directory))
    _save_state_dict({"model": flat, "shapes": shapes}, storage_writer=writer, no_dist=True)


@pytest.mark.timeout(120)
def test_a_stage3_checkpoint_of_flat_pieces_is_refused_with_its_bridge(tmp_path: Path) -> None:
    """A stage-3 checkpoint written before DTensor parameters is refused in one line on
    every rank, naming `phalanx consolidate`; consolidate reads it whole."""
    from phalanx.train.checkpoint.consolidate import consolidate
    from tests.checkpoints import rehash

    run_workers(_resume_old_stage3, 2, str(tmp_path), init_pg=False)
    checkpoint = tmp_path / "checkpoint-4"
    whole = consolidate(checkpoint, tmp_path / "now.pt")["model"]
    _write_flat_pieces(checkpoint / "model", whole)
    rehash(checkpoint)
    outs = run_workers(_resume_old_stage3, 2, str(tmp_path), init_pg=False)
    for o in outs:
        assert "written by an older phalanx" in o.value and "phalanx consolidate" in o.value
        assert "\n" not in o.value
    bridged = consolidate(checkpoint, tmp_path / "bridged.pt")["model"]
    assert bridged.keys() == whole.keys()
    assert all(torch.equal(bridged[k], whole[k]) for k in whole)


class _OneOutput(nn.Module):
    """A head of one row: at world 2, rank 1's shard of it is empty."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, batch: list[Tensor]) -> Tensor:
        return self.net(batch[0]).squeeze(-1)


def _empty_shards(rank: int, world: int, out_dir: str) -> int:
    args = _args(Path(out_dir), zero_stage=3, max_steps=4, save_steps=2)
    loss = lambda out, batch: nn.functional.mse_loss(out, batch[1].float())  # noqa: E731
    trainer = Trainer(model=_OneOutput(), args=args, train_dataset=_data(), loss_fn=loss)
    return trainer.train().global_step


@pytest.mark.timeout(120)
def test_stage3_trains_and_saves_with_an_empty_shard(tmp_path: Path) -> None:
    """The checks around a save look at each rank's own shard: an empty one is no error,
    and no rank starts a collective the others do not (a DTensor norm would)."""
    outs = run_workers(_empty_shards, 2, str(tmp_path), init_pg=False)
    assert [o.value for o in outs] == [4, 4]
    assert (tmp_path / "checkpoint-4").is_dir()


def _user_sharded(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    """docs/trainer.md's route for your own optimizer at stage 3: shard the model yourself,
    build the optimizer over its parameters, hand both over. The Trainer moves the model to
    its device (a `.to()`, which swaps each DTensor parameter's contents in place), and the
    optimizer's parameters must still be the units' own. Against the built-in AdamW."""
    phalanx.init(backend="gloo")
    finals: dict[str, Any] = {}
    for route in ("built-in", "yours"):
        args = _args(Path(out_dir) / route, zero_stage=3, max_steps=6)
        model: nn.Module = _Net()
        optimizer: torch.optim.Optimizer | None = None
        if route == "yours":
            zero3.shard_model(model)  # the units the Trainer would pick: each Linear, the root
            matrices = [p for p in model.parameters() if p.dim() >= 2]
            vectors = [p for p in model.parameters() if p.dim() < 2]
            groups: list[dict[str, Any]] = [
                {"params": matrices, "weight_decay": 0.1},
                {"params": vectors},
            ]
            optimizer = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.0)
        trainer = Trainer(
            model=model, args=args, train_dataset=_data(), loss_fn=_xent, optimizer=optimizer
        )
        trainer.train()
        finals[route] = zero3.full_state_dict(trainer.model, to=0)
    messages = []
    for stage in (0, 1):  # a model sharded already, at a stage that trains plain parameters
        model = zero3.shard_model(_Net())
        args = _args(Path(out_dir) / f"s{stage}", zero_stage=stage, max_steps=2)
        try:
            Trainer(model=model, args=args, train_dataset=_data(), loss_fn=_xent).train()
            messages.append("trained")
        except ConfigurationError as exc:
            messages.append(str(exc))
    gap = 0.0
    if rank == 0:
        ours, builtin = finals["yours"], finals["built-in"]
        assert ours is not None and builtin is not None and ours.keys() == builtin.keys()
        gap = max(float((ours[k] - builtin[k]).abs().max()) for k in ours)
    return {"gap": gap, "refused": messages}


@pytest.mark.timeout(120)
def test_your_optimizer_over_a_model_you_sharded_trains_as_the_built_in_adamw(
    tmp_path: Path,
) -> None:
    """Stage 3 with optimizer=: it was refused (the Trainer's move to the device lost the
    parameters' sharded mark). And a sharded model at stages 0-2 is refused in one line
    naming zero_stage=3, on every rank (it raised DTensor's NotImplementedError)."""
    outs = run_workers(_user_sharded, 2, str(tmp_path), init_pg=False)
    assert outs[0].value["gap"] <= 1e-6, outs[0].value
    assert outs[0].value["refused"] == outs[1].value["refused"]
    for message in outs[0].value["refused"]:
        assert "sharded with fully_shard" in message and "pass zero_stage=3" in message
        assert "\n" not in message and " — " in message
