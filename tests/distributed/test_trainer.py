"""The Trainer on real gloo ranks: accumulation, exact-once evaluation, errors, fallback.

The harness exports torchrun's variables and builds no group (`init_pg=False`),
so each Trainer joins the job itself through `phalanx.init`, as under a
launcher. Reference runs happen in the test process, where no launcher
variables are set: the Trainer then trains in a one-rank group, without DDP.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from phalanx import DistributedDataParallel
from phalanx.errors import ConfigurationError
from phalanx.train import (
    CheckpointError,
    CheckpointFallbackWarning,
    EvalPrediction,
    ResumeWarning,
    Trainer,
    TrainingArguments,
)
from tests.harness import run_workers, world_sizes

GA_STEPS = 6  # crosses an epoch: 64 samples make 4 steps of 16


def _xent(outputs: Tensor, batch: list[Tensor]) -> Tensor:
    return nn.functional.cross_entropy(outputs, batch[1])


class _OnFirst(nn.Module):
    """Feeds the first tensor of a (features, labels) batch to `net`."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, batch: list[Tensor]) -> Tensor:
        return self.net(batch[0])


def _mlp_and_data() -> tuple[nn.Module, TensorDataset]:
    torch.manual_seed(0)
    model = _OnFirst(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=gen)
    return model, TensorDataset(x, torch.randint(0, 3, (64,), generator=gen))


def _args(out_dir: str, **overrides: Any) -> TrainingArguments:
    base: dict[str, Any] = {
        "output_dir": out_dir,
        "report_to": [],
        "disable_tqdm": True,
        "ddp_backend": "gloo",
        "ddp_timeout": 60,
        "save_steps": 0,
    }
    return TrainingArguments(**{**base, **overrides})


def _train_accumulating(rank: int, world: int, out_dir: str, batch: int, accumulation: int) -> Any:
    model, data = _mlp_and_data()
    args = _args(
        out_dir,
        max_steps=GA_STEPS,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        lr_scheduler_type="constant",
        max_grad_norm=0.05,  # small enough to clip: clipping must see the synced gradient
        seed=3,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    trainer = Trainer(
        model=model, args=args, train_dataset=data, loss_fn=_xent, optimizer=optimizer
    )
    out = trainer.train()
    result: dict[str, Any] = {
        # Plain lists: tensors sent through the harness's queue would be shared memory
        # that vanishes with the worker.
        "params": [p.detach().tolist() for p in trainer.model.parameters()],
        "global_step": out.global_step,
    }
    reducer = getattr(trainer.wrapped_model, "reducer", None)
    if reducer is not None:
        result["sync_rounds"] = reducer.stats.sync_rounds
        result["buckets_launched"] = reducer.stats.buckets_launched
        result["buckets"] = len(reducer.buckets)
    return result


@pytest.mark.timeout(120)
def test_accumulation_on_two_ranks_equals_one_process_with_the_whole_batch(
    tmp_path: Path,
) -> None:
    per_rank, accumulation = 2, 4
    outs = run_workers(
        _train_accumulating, 2, str(tmp_path / "ddp"), per_rank, accumulation, init_pg=False
    )
    single = _train_accumulating(0, 1, str(tmp_path / "one"), per_rank * 2 * accumulation, 1)
    for out in outs:
        assert out.value["global_step"] == GA_STEPS
        for ours, reference in zip(out.value["params"], single["params"], strict=True):
            gap = (torch.tensor(ours) - torch.tensor(reference)).abs().max()
            assert gap <= 1e-6, gap
        # One all-reduce round per optimizer step, not one per micro-batch.
        assert out.value["sync_rounds"] == GA_STEPS
        assert out.value["buckets_launched"] == GA_STEPS * out.value["buckets"]
    assert "sync_rounds" not in single  # one process without a launcher: no DDP at all


EVAL_SIZES = (7, 11)


def _eval_set(n: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(n)
    return TensorDataset(torch.randn(n, 4, generator=gen), torch.arange(n, dtype=torch.float32))


def _eval_model() -> nn.Module:
    torch.manual_seed(5)
    return _OnFirst(nn.Linear(4, 1))


def _mse(outputs: Tensor, batch: list[Tensor]) -> Tensor:
    return nn.functional.mse_loss(outputs.squeeze(1), batch[1])


def _count_and_order(prediction: EvalPrediction) -> dict[str, float]:
    labels = prediction.label_ids
    assert labels is not None
    n = len(labels)
    return {
        "count": float(len(prediction.predictions)),
        "labels_in_order": float(torch.equal(labels, torch.arange(n, dtype=torch.float32))),
        "prediction_sum": float(prediction.predictions.sum()),
    }


def _evaluate_sizes(rank: int, world: int, out_dir: str) -> dict[int, dict[str, float]]:
    trainer = Trainer(
        model=_eval_model(),
        # Batches of 3 give ranks different batch counts: no collective may run per batch.
        args=_args(out_dir, per_device_eval_batch_size=3),
        loss_fn=_mse,
        compute_metrics=_count_and_order,
    )
    return {n: trainer.evaluate(_eval_set(n)) for n in EVAL_SIZES}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", world_sizes(2, 3))
def test_evaluate_counts_every_sample_exactly_once(world: int, tmp_path: Path) -> None:
    outs = run_workers(_evaluate_sizes, world, str(tmp_path), init_pg=False)
    model = _eval_model()
    for n in EVAL_SIZES:
        data = _eval_set(n)
        with torch.no_grad():
            predictions = model([data.tensors[0]])
            expected_loss = float(_mse(predictions, list(data.tensors)))
        for out in outs:
            metrics = out.value[n]
            assert metrics["eval_samples"] == n
            assert metrics["eval_count"] == n
            assert metrics["eval_labels_in_order"] == 1.0
            assert metrics["eval_loss"] == pytest.approx(expected_loss, rel=1e-5)
            assert metrics["eval_prediction_sum"] == pytest.approx(float(predictions.sum()), 1e-5)
        assert all(out.value[n] == outs[0].value[n] for out in outs)  # every rank agrees


def test_a_plain_process_trainer_owns_its_one_rank_group(tmp_path: Path) -> None:
    import torch.distributed as dist

    model, data = _mlp_and_data()
    trainer = Trainer(model=model, args=_args(str(tmp_path)), train_dataset=data, loss_fn=_xent)
    assert dist.is_initialized() and trainer.world.process_group is dist.group.WORLD
    assert (trainer.world.rank, trainer.world.world_size) == (0, 1)
    assert trainer.wrapped_model is trainer.model  # one rank: nothing to all-reduce
    trainer.close()
    assert not dist.is_initialized()


def test_a_trainer_keeps_a_group_it_did_not_create(tmp_path: Path) -> None:
    import torch.distributed as dist

    import phalanx

    world = phalanx.init(backend="gloo")
    model, data = _mlp_and_data()
    trainer = Trainer(model=model, args=_args(str(tmp_path)), train_dataset=data, loss_fn=_xent)
    assert trainer.world == world
    trainer.close()
    assert dist.is_initialized()


def test_a_trainer_that_cannot_be_made_lets_go_of_its_group() -> None:
    import torch.distributed as dist

    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ConfigurationError, match="no trainable parameter"):
        Trainer(model=frozen, args=_args("unused"))
    assert not dist.is_initialized()


def _try_backends(rank: int, world: int, backends: list[str]) -> list[str]:
    """Each bad backend fails before any group exists, so one worker can try them all."""
    errors = []
    for backend in backends:
        try:
            Trainer(model=nn.Linear(2, 2), args=_args("unused", ddp_backend=backend))
        except ConfigurationError as exc:
            errors.append(str(exc))
        else:
            errors.append("no error")
    return errors


@pytest.mark.timeout(60)
def test_an_unavailable_backend_is_a_clear_error_on_every_rank() -> None:
    backends = ["no-such-backend"] + ([] if torch.cuda.is_available() else ["nccl"])
    outs = run_workers(_try_backends, 2, backends, init_pg=False)
    for out in outs:
        for backend, message in zip(backends, out.value, strict=True):
            assert backend in message and " — " in message, message


def _fallback_scenario(rank: int, world: int, out_dir: str) -> dict[str, Any]:
    import torch.distributed as dist

    model, data = _mlp_and_data()
    args = _args(out_dir, max_steps=8, save_steps=4, per_device_train_batch_size=4)
    first = Trainer(model=model, args=args, train_dataset=data, loss_fn=_xent)
    first.train()
    newest = Path(out_dir) / "checkpoint-8" / "model.pt"
    if rank == 0:
        newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a torn write
    dist.barrier()
    result: dict[str, Any] = {}
    fresh, _ = _mlp_and_data()
    try:
        Trainer(model=fresh, args=args, train_dataset=data, loss_fn=_xent).train(
            resume_from_checkpoint=newest.parent
        )
    except CheckpointError as exc:
        result["explicit_error"] = str(exc)
    longer = _args(out_dir, max_steps=10, save_steps=4, per_device_train_batch_size=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # The same model again: the first Trainer's reducer must be unhooked from it.
        out = Trainer(model=model, args=longer, train_dataset=data, loss_fn=_xent).train(
            resume_from_checkpoint=True
        )
    assert isinstance(first.wrapped_model, DistributedDataParallel)
    result["first_reducer_rounds"] = first.wrapped_model.reducer.stats.sync_rounds
    result["warnings"] = [
        str(w.message) for w in caught if issubclass(w.category, CheckpointFallbackWarning)
    ]
    result["resumed_from"] = out.resumed_from
    result["global_step"] = out.global_step
    return result


@pytest.mark.timeout(120)
def test_a_torn_checkpoint_is_refused_or_skipped_back_to_the_previous_one(
    tmp_path: Path,
) -> None:
    outs = run_workers(_fallback_scenario, 2, str(tmp_path), init_pg=False)
    for out in outs:
        result = out.value
        assert "checkpoint-8" in result["explicit_error"] and "bytes" in result["explicit_error"]
        assert result["resumed_from"] == str(tmp_path / "checkpoint-4")
        assert result["global_step"] == 10
        assert result["first_reducer_rounds"] == 8
    assert any("checkpoint-8" in w for w in outs[0].value["warnings"])  # rank 0 says why
    # Two ranks wrote it; one process resumes it (the state is replicated) and says that
    # the data order changes: 4 steps of 2 x 4 samples = sample 32 of epoch 0, which for
    # one rank is micro-batch 8 of 16.
    model, data = _mlp_and_data()
    args = _args(str(tmp_path), max_steps=10, per_device_train_batch_size=4)
    trainer = Trainer(model=model, args=args, train_dataset=data, loss_fn=_xent)
    with pytest.warns(ResumeWarning) as caught:
        resumed = trainer.train(resume_from_checkpoint=tmp_path / "checkpoint-4")
    message = str(caught[0].message)
    assert "resuming checkpoint-4 with changed arguments: world size 2 → 1" in message
    assert "epoch 0 continues at sample 32 of 64" in message
    assert (resumed.global_step, trainer.state.epoch, trainer.state.batches_done) == (10, 0, 14)
