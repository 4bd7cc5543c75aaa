"""Evaluation that counts every sample exactly once, whatever the world size.

Each rank scores its own shard from `DistributedSampler(pad=False)`, so no
padded duplicate is counted. The loss is reduced as (sum of loss x batch
size, sum of batch sizes) over all ranks: the mean over the whole set, not a
mean of per-rank means. For `compute_metrics`, every rank's predictions and
labels are gathered and put back in dataset order, and every rank calls
`compute_metrics` on the full set, so all ranks return the same metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sized
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from phalanx.data.lengths import check_same_length
from phalanx.data.sampler import DistributedSampler
from phalanx.errors import ConfigurationError
from phalanx.runtime import World
from phalanx.train.batches import (
    LossFn,
    batch_size,
    call_model,
    find_labels,
    find_loss,
    find_predictions,
    takes_keyword_batch,
    to_device,
)


@dataclass(frozen=True)
class EvalPrediction:
    """Everything `compute_metrics` sees: the whole eval set, in dataset order, on CPU.

    `predictions` are the model's logits (its output tensor, or the `logits`
    of a dict/object output); `label_ids` are the batch's "labels" (dict
    batches) or its last element (tuple batches), or None.
    """

    predictions: Tensor
    label_ids: Tensor | None


ComputeMetrics = Callable[[EvalPrediction], Mapping[str, float]]


@dataclass(frozen=True)
class EvalSetup:
    """What evaluation borrows from the Trainer."""

    world: World
    batch_size: int
    num_workers: int
    collate_fn: Callable[[list[Any]], Any] | None
    loss_fn: LossFn | None
    autocast: Callable[[], AbstractContextManager[Any]]


def _loader(dataset: Dataset[Any], setup: EvalSetup) -> DataLoader[Any]:
    world = setup.world
    sampler = DistributedSampler(
        dataset,
        num_replicas=world.world_size,
        rank=world.rank,
        shuffle=False,
        pad=False,
    )
    return DataLoader(
        dataset,
        batch_size=setup.batch_size,
        sampler=sampler,
        num_workers=setup.num_workers,
        collate_fn=setup.collate_fn,
        # Its own generator: creating the iterator must not draw from the global
        # RNG, or evaluating mid-run would shift the training dropout masks.
        generator=torch.Generator(),
    )


def _scores(
    model: nn.Module, dataset: Dataset[Any], setup: EvalSetup, keep: bool
) -> tuple[float, int, int, list[Tensor], list[Tensor]]:
    """This rank's (loss x count sum, count, counted loss samples, predictions, labels)."""
    loss_sum, seen, with_loss = 0.0, 0, 0
    predictions: list[Tensor] = []
    labels: list[Tensor] = []
    keyword: bool | None = None
    for raw in _loader(dataset, setup):
        batch = to_device(raw, setup.world.device)
        keyword = takes_keyword_batch(model, batch) if keyword is None else keyword
        with setup.autocast():
            outputs = call_model(model, batch, keyword)
            loss = find_loss(outputs, batch, setup.loss_fn)
        n = batch_size(batch)
        seen += n
        if loss is not None:
            loss_sum += float(loss.float()) * n
            with_loss += n
        if keep:
            predictions.append(_required(find_predictions(outputs), "predictions").cpu())
            found = find_labels(batch)
            if found is not None:
                labels.append(found.detach().cpu())
    return loss_sum, seen, with_loss, predictions, labels


def _required(value: Tensor | None, what: str) -> Tensor:
    if value is None:
        raise ConfigurationError(
            f"compute_metrics needs {what}, but the model output has no tensor or 'logits' — "
            "return the logits (a tensor, or a dict/object with 'logits') from forward"
        )
    return value.detach()


def _in_dataset_order(per_rank: list[Tensor | None], total: int, world: int) -> Tensor:
    """Interleave shards back: with pad=False, rank r scored samples r, r+world, ..."""
    present = [t for t in per_rank if t is not None]
    template = present[0]
    out = template.new_empty((total, *template.shape[1:]))
    for rank, shard in enumerate(per_rank):
        if shard is not None:
            out[rank::world] = shard
    return out


def _gather(parts: list[Tensor], world: World, total: int) -> Tensor | None:
    local = torch.cat(parts) if parts else None
    everyone = world.all_gather_state(local)
    if all(t is None for t in everyone):
        return None
    return _in_dataset_order(everyone, total, world.world_size)


def evaluate_model(
    model: nn.Module,
    dataset: Dataset[Any],
    setup: EvalSetup,
    compute_metrics: ComputeMetrics | None,
) -> dict[str, float]:
    """eval_loss (when there is a loss), eval_samples, and compute_metrics' results."""
    if isinstance(dataset, Sized):  # shards of different lengths: samples lost or a hang
        world = setup.world
        check_same_length(dataset, world.process_group, "evaluation set", world.device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            scores = _scores(model, dataset, setup, keep=compute_metrics is not None)
    finally:
        model.train(was_training)
    loss_sum, seen, with_loss, predictions, labels = scores
    total_loss, total_seen, total_with_loss = setup.world.all_reduce_sum(
        [loss_sum, seen, with_loss]
    )
    metrics = {"eval_samples": float(total_seen)}
    if total_with_loss > 0:
        metrics["eval_loss"] = total_loss / total_with_loss
    if compute_metrics is not None:
        total = len(dataset) if isinstance(dataset, Sized) else int(total_seen)
        gathered = _gather(predictions, setup.world, total)
        if gathered is not None:
            label_ids = _gather(labels, setup.world, total)
            result = compute_metrics(EvalPrediction(gathered, label_ids))
            for name, value in result.items():
                key = name if name.startswith("eval_") else f"eval_{name}"
                metrics[key] = float(value)
    return metrics
