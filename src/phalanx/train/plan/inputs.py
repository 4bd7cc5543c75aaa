"""What `phalanx plan` counts: the model built on the meta device, its micro-step, the
optimizer, and the budget (cli/plan_cmd.py imports it when the command runs)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from phalanx.train.config.args import TrainingArguments
from phalanx.train.plan.budget import detect_budget, parse_size
from phalanx.train.plan.choose import EVERYTHING, Allowed
from phalanx.train.plan.count import MicroStep, ModelCount, count_model, meta_batch
from phalanx.train.setup import OPTIMIZERS, optimizer_recipe


def plan_inputs(
    ns: argparse.Namespace, load: Callable[[str], Any]
) -> tuple[ModelCount, float, str, Allowed]:
    """(the model's count, the budget in bytes, where it came from, what may be chosen)."""
    with torch.device("meta"):
        model = load(ns.model)()
    if not isinstance(model, nn.Module):
        raise ValueError(f"{ns.model} returned a {type(model).__name__}, not an nn.Module")
    step = micro_step(ns, load)
    args = TrainingArguments(optim=ns.optim, report_to=[], disable_tqdm=True)
    cls, _, options = optimizer_recipe(model, args)
    units = ns.units.split(",") if ns.units else None
    count = count_model(model, step, lambda params: cls(params, **options), units)
    assert cls is OPTIMIZERS[ns.optim][0]
    if ns.budget is not None:
        budget, source = float(parse_size(ns.budget)), "--budget"
    else:
        found, source = detect_budget("cpu", ns.world)
        budget = float(found)
    allowed = [(s, t) for s, t in EVERYTHING if not (ns.no_offload and t != "none")]
    return count, budget, source, allowed


def micro_step(ns: argparse.Namespace, load: Callable[[str], Any]) -> MicroStep:
    """The model called on a micro-batch of n samples, and its loss."""
    if (ns.input is None) == (ns.batch is None):
        raise ValueError("give the batch: --input SHAPE[:DTYPE] or --batch MODULE:FN")
    loss_fn = load(ns.loss) if ns.loss else None
    make = load(ns.batch) if ns.batch else _inputs(ns.input)

    def step(model: nn.Module, n: int) -> torch.Tensor:
        with torch.device("meta"):
            batch = meta_batch(make(n))
        outputs = model(batch)
        if loss_fn is not None:
            return loss_fn(outputs, batch).float()
        loss = outputs.get("loss") if isinstance(outputs, dict) else getattr(outputs, "loss", None)
        return (loss if loss is not None else outputs).float().mean()

    return step


def _inputs(spec: str) -> Callable[[int], torch.Tensor]:
    """'1024' -> n x 1024 floats; '64:int64' -> n x 64 int64s (token ids)."""
    shape_text, _, dtype_text = spec.partition(":")
    try:
        shape = tuple(int(d) for d in shape_text.lower().split("x") if d)
    except ValueError:
        raise ValueError(f"--input {spec!r} is not SHAPE[:DTYPE] — e.g. 1024 or 64:int64") from None
    dtype = getattr(torch, dtype_text or "float32", None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"--input {spec!r}: {dtype_text!r} is not a torch dtype (e.g. int64)")
    if dtype.is_floating_point:
        return lambda n: torch.empty((n, *shape), dtype=dtype)
    return lambda n: torch.zeros((n, *shape), dtype=dtype)
