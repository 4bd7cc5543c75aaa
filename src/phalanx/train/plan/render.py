"""The plan as a table with its reasons: the chosen configuration beside the best of each
other stage, each column's predicted peak per rank by part and its step time, and a
line per column saying why it was or was not chosen."""

from __future__ import annotations

import dataclasses
from typing import Any

from phalanx.train.plan.choose import TIME_SLACK, Candidate, Choice
from phalanx.train.plan.count import ModelCount
from phalanx.train.plan.predict import Parts
from phalanx.train.plan.probe import Rates

__all__ = ["choice_json", "render"]

_ROWS = (
    ("parameters", "parameters"),
    ("gradients", "gradients"),
    ("optimizer state", "optimizer_state"),
    ("activations", "activations"),
    ("collective buffers", "collective_buffers"),
    ("libraries", "libraries"),
)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.0f} MB"


def columns(choice: Choice) -> list[Candidate]:
    """The chosen candidate first, then each other stage's best: the fastest that fits, or
    if none of that stage does, its smallest."""
    shown = [choice.chosen]
    for stage in sorted({c.config.stage for c in choice.candidates}):
        if stage == choice.chosen.config.stage:
            continue
        own = [c for c in choice.candidates if c.config.stage == stage]
        fitting = [c for c in own if c.fits]
        best = (
            min(fitting, key=lambda c: c.step_s)
            if fitting
            else min(own, key=lambda c: c.memory.total)
        )
        shown.append(best)
    return shown


def _reason(candidate: Candidate, choice: Choice) -> str:
    ratio = candidate.step_s / choice.chosen.step_s
    if candidate is choice.chosen:
        fastest = min(c.step_s for c in choice.candidates if c.fits)
        if candidate.step_s <= fastest:
            return "chosen: the fastest that fits"
        return f"chosen: the simplest within {TIME_SLACK:.0%} of the fastest that fits"
    if not candidate.fits:
        return f"does not fit: needs {_mb(candidate.memory.total)}"
    if ratio < 1:
        return f"fits, {ratio:.2f}x the time: a tie, and less simple"
    return f"fits, {ratio:.2f}x slower"


def render(choice: Choice, world: int, global_batch: int) -> str:
    """The plan: a heading, the table, and the settings to train with."""
    shown = columns(choice)
    head = ["", *(c.config.describe() for c in shown)]
    rows = [head, ["---"] * len(head)]
    for label, name in _ROWS:
        rows.append([label, *(_mb(getattr(c.memory, name)) for c in shown)])
    rows.append(["peak per rank", *(_mb(c.memory.total) for c in shown)])
    rows.append(["step time", *(f"{c.step_s:.2f} s" for c in shown)])
    rows.append(["", *(_reason(c, choice) for c in shown)])
    table = "\n".join("| " + " | ".join(r) + " |" for r in rows)
    config = choice.chosen.config
    settings = f"zero_stage={config.stage}"
    if config.keep_gathered:
        settings += ", zero3_reshard_after_forward=False"
    if config.offload != "none":
        settings += f', zero_offload="{config.offload}"'
    if config.offload == "disk" and config.fraction < 1:
        settings += f", zero_offload_fraction={config.fraction:g}"
    settings += (
        f", per_device_train_batch_size={config.micro_batch}, "
        f"gradient_accumulation_steps={config.accumulation}"
    )
    return (
        f"budget {_mb(choice.budget)} per rank ({choice.budget_source}), world {world}, "
        f"global batch {global_batch}\n\n{table}\n\ntrain with: {settings}"
    )


def parts_json(parts: Parts) -> dict[str, float]:
    """The parts by name, and their total, in bytes."""
    return {name: getattr(parts, name) for _, name in _ROWS} | {"total": parts.total}


def choice_json(choice: Choice, count: ModelCount, rates: Rates) -> dict[str, Any]:
    """The plan as JSON: the chosen configuration, every candidate, and what they came from."""

    def one(c: Candidate) -> dict[str, Any]:
        return {
            "config": dataclasses.asdict(c.config),
            "memory": parts_json(c.memory),
            "step_s": c.step_s,
            "fits": c.fits,
        }

    return {
        "budget_bytes": choice.budget,
        "budget_source": choice.budget_source,
        "chosen": one(choice.chosen),
        "candidates": [one(c) for c in choice.candidates],
        "count": dataclasses.asdict(count),
        "rates": rates.to_json(),
    }
