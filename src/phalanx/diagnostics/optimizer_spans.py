"""Every optimizer step of a process as a timeline span, whoever calls it.

The Trainer puts its optimizer step in a span of its own; a script that steps its
own optimizer (`opt.step()` after a phalanx DDP backward) had it in no span, so
`phalanx bench` counted it in "other" and printed an optimizer column of 0. torch
runs its global step hooks around every optimizer's `step` (each optimizer's class
wraps `step` in them), so two hooks time them all: the outermost step only (a
ZeroRedundancyOptimizer's step calls its inner optimizer's), and none inside a span
of the same name (the Trainer's).
"""

from __future__ import annotations

import time
from typing import Any

from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.hooks import RemovableHandle

from phalanx.diagnostics.timeline import Timeline
from phalanx.diagnostics.trace import OPTIMIZER_SPAN as SPAN


def time_optimizer_steps(timeline: Timeline) -> tuple[RemovableHandle, RemovableHandle]:
    """Record every optimizer step of this process in `timeline`; the hooks' handles."""
    started: list[int] = []  # the start of each step in progress, outermost first

    def before(optimizer: Any, args: Any, kwargs: Any) -> None:
        started.append(time.perf_counter_ns())

    def after(optimizer: Any, args: Any, kwargs: Any) -> None:
        start = started.pop() if started else None
        if start is not None and not started and not timeline.is_open(SPAN):
            timeline.add(SPAN, "compute", start, time.perf_counter_ns())

    return register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)
