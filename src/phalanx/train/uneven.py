"""even_batches=False in the Trainer: an epoch under `Join`, so ranks may run out of data.

The step counts are agreed first (every rank counts the longest rank's steps),
so a rank whose loader ran out mid-step shadows the others' remaining
micro-batches of that step, up to its reduction, and its optimizer steps with
theirs on the same averaged gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from phalanx.ddp.join import Join, Shadowed
from phalanx.ddp.module import DistributedDataParallel

Shadow = Callable[[], None]
"""Called by a rank out of batches in place of its missing micro-batches."""


@contextmanager
def uneven_inputs(wrapped_model: DistributedDataParallel) -> Iterator[Shadow]:
    """The epoch's context under Join: yields the shadow callable (the strategy decides
    when there is someone to shadow: train/strategy/base.py)."""
    with Join([wrapped_model]) as join:
        yield functools.partial(_shadow_until_reduced, join)


def _shadow_until_reduced(join: Join) -> None:
    """Take part in the other ranks' remaining micro-batches of this step, up to its
    reduction; this rank's own accumulated gradient stays in the average."""
    while (shadowed := join.shadow_round(send_local=True)) is not Shadowed.REDUCED:
        if shadowed is Shadowed.NOTHING_LEFT:  # the step counts are agreed: cannot happen
            raise RuntimeError("phalanx: every rank ran out of batches inside a step")
