"""What the Trainer does with a batch: move it, feed it to the model, find the loss.

The contract is small on purpose. The model gets the collated batch as its
one argument, except that a dict batch is spread into keyword arguments when
the model's forward names them (Hugging Face models: `model(**batch)`). The
loss is `loss_fn(outputs, batch)`, or else whatever loss the model returned.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from phalanx.errors import ConfigurationError
from phalanx.runtime import World
from phalanx.runtime.nested import map_tensors

LossFn = Callable[[Any, Any], Tensor]
_LABEL_KEYS = ("labels", "label", "label_ids")
_LOGIT_KEYS = ("logits", "predictions")


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor inside the batch; containers keep their types, the rest stays."""
    return map_tensors(lambda t: t.to(device, non_blocking=True), batch)


def batch_size(batch: Any) -> int:
    """Samples in a batch: the leading size of its first tensor, else its length."""
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    if isinstance(batch, Mapping):
        values = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        values = list(batch)
    else:
        return 1
    for value in values:
        if isinstance(value, (Tensor, Mapping, list, tuple)):
            return batch_size(value)
    return len(values)  # a list of plain samples (strings, numbers)


def step_groups(
    batches: Iterable[Any], done: int, accumulation: int, per_epoch: int
) -> Iterator[tuple[list[Any], int]]:
    """The micro-batches of each optimizer step of an epoch, `done` micro-batches into it,
    each with the number the step has: `accumulation`, fewer for the epoch's last step.

    A step's micro-batches are loaded before it starts, since weighting their
    losses needs every size (`loss_weights`). A rank whose data ends before
    `per_epoch` (even_batches=False: the longest rank's count) gets the rest of
    the epoch's steps with fewer micro-batches, or none: it shadows the others.
    """
    start, group = done, []
    for batch in batches:
        group.append(batch)
        if len(group) == min(accumulation, per_epoch - start):
            yield group, len(group)
            start, group = start + len(group), []
    while start < per_epoch:
        expected = min(accumulation, per_epoch - start)
        yield group, expected
        start, group = start + expected, []


def loss_weights(sizes: list[int], world: World, reduced: bool = True) -> list[float]:
    """Each micro-batch's loss weight, so that the step's gradient is the mean over every
    sample of the step on every rank (`reduced`), or over this rank's own, whatever the
    batch sizes.

    A loss is a mean over its micro-batch, and the reducer divides the sum over
    ranks by their number N; so rank r's micro-batch of n samples is weighted
    N * n / (the step's samples on all ranks), the total agreed in one small
    all-reduce (one process needs none). Equal batches get 1 / (micro-batches).
    With no reducer (local SGD, DiLoCo: each rank steps on its own gradient) a
    micro-batch is weighted n / (this rank's samples in the step), with no collective.
    """
    total = float(sum(sizes))
    if reduced and world.is_distributed:
        total = world.all_reduce_sum([total])[0]
    if total <= 0:
        return [0.0] * len(sizes)
    ranks = world.world_size if reduced else 1
    return [ranks * size / total for size in sizes]


def takes_keyword_batch(model: nn.Module, sample: Any) -> bool:
    """Whether `model(**batch)` is meant: a dict batch whose keys the forward names.

    At least one key must match a named parameter, so a `forward(self, batch)`
    that takes the whole dict, or a catch-all `forward(*args, **kwargs)`
    wrapper, still gets the dict as its one argument.
    """
    if not isinstance(sample, Mapping) or not sample:
        return False
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    named = {name for name, p in params.items() if p.kind is not p.VAR_KEYWORD}
    catch_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    keys = [str(key) for key in sample]
    if not any(key in named for key in keys):
        return False
    return catch_all or all(key in named for key in keys)


def call_model(model: nn.Module, batch: Any, keyword: bool) -> Any:
    return model(**batch) if keyword else model(batch)


_CONVENTION_SLIPS = (TypeError, AttributeError, IndexError, KeyError, ValueError)
"""What a model or loss_fn written for another calling convention raises at its first call."""


def first_loss(
    model: nn.Module, batch: Any, keyword: bool, loss_fn: LossFn | None
) -> tuple[Any, Tensor]:
    """The first micro-batch's outputs and loss, with a slip of convention said in one line
    (what the Trainer passed, and how) instead of a raw error from inside the step."""
    call = "model(**batch)" if keyword else "model(batch)"
    try:
        outputs = call_model(model, batch, keyword)
    except _CONVENTION_SLIPS as exc:
        raise ConfigurationError(
            f"the first step's {call} failed with {type(exc).__name__}: {_first(exc)} — the "
            f"Trainer calls {call} with the collated batch ({_describe(batch)}) as its one "
            "argument (a dict whose keys forward names is spread: model(**batch)); unpack "
            "the batch inside forward (PHALANX_TRACEBACK=1 shows where it failed)"
        ) from exc
    if loss_fn is None:
        return outputs, require_loss(outputs, batch, None)
    try:
        return outputs, require_loss(outputs, batch, loss_fn)
    except _CONVENTION_SLIPS as exc:
        raise ConfigurationError(
            f"the first step's loss_fn(outputs, batch) failed with {type(exc).__name__}: "
            f"{_first(exc)} — the Trainer calls loss_fn(outputs, batch) with the model's "
            f"outputs ({_describe(outputs)}) and the whole batch ({_describe(batch)}); take "
            "the labels from the batch inside loss_fn (PHALANX_TRACEBACK=1 shows where)"
        ) from exc


def _first(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:200] if lines else "(no message)"


def _returned_loss(outputs: Any) -> Tensor | None:
    if isinstance(outputs, Tensor):
        return outputs if outputs.numel() == 1 else None
    if isinstance(outputs, Mapping):
        return outputs.get("loss")
    loss = getattr(outputs, "loss", None)
    if isinstance(loss, Tensor):
        return loss
    if isinstance(outputs, (list, tuple)) and outputs and isinstance(outputs[0], Tensor):
        return outputs[0] if outputs[0].numel() == 1 else None  # HF's return_dict=False
    return None


def find_loss(outputs: Any, batch: Any, loss_fn: LossFn | None) -> Tensor | None:
    """The batch's loss, or None when neither loss_fn nor the model provides one."""
    loss = loss_fn(outputs, batch) if loss_fn is not None else _returned_loss(outputs)
    if loss is None:
        return None
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        where = "loss_fn" if loss_fn is not None else "the model"
        raise ConfigurationError(
            f"{where} gave a loss of {_describe(loss)}, not a single-element tensor — "
            "reduce it to a scalar (e.g. .mean()) before returning it"
        )
    return loss.reshape(())


def require_loss(outputs: Any, batch: Any, loss_fn: LossFn | None) -> Tensor:
    loss = find_loss(outputs, batch, loss_fn)
    if loss is None:
        raise ConfigurationError(
            f"the model returned {_describe(outputs)} with no loss in it — pass "
            "loss_fn=lambda outputs, batch: ... to the Trainer, or return the loss from "
            "forward (a scalar tensor, or a dict/object with a 'loss')"
        )
    return loss


def find_predictions(outputs: Any) -> Tensor | None:
    """What compute_metrics sees as predictions: the logits, or the output tensor itself."""
    if isinstance(outputs, Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        return next((outputs[k] for k in _LOGIT_KEYS if k in outputs), None)
    logits = getattr(outputs, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(outputs, (list, tuple)) and outputs and isinstance(outputs[0], Tensor):
        return outputs[0]
    return None


def find_labels(batch: Any) -> Tensor | None:
    """A dict batch's "labels" (or "label"), or the last element of a tuple batch."""
    if isinstance(batch, Mapping):
        return next((batch[k] for k in _LABEL_KEYS if k in batch), None)
    if isinstance(batch, (list, tuple)) and len(batch) >= 2 and isinstance(batch[-1], Tensor):
        return batch[-1]
    return None


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, Mapping):
        keys = ", ".join(repr(k) for k in list(value)[:6])
        return f"a {type(value).__name__} with keys {keys}"
    if isinstance(value, (list, tuple)):
        shown = ", ".join(_short(v) for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"a {type(value).__name__} of {len(value)}: {shown}"
    return f"a {type(value).__name__}"


def _short(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"tensor{list(value.shape)}"
    return type(value).__name__
