"""Non-finite gradients and parameters, caught before the optimizer or a checkpoint keeps them.

One rank's NaN reaches every replica at the all-reduce (torch DDP spreads it
the same way), and a run that goes on writes NaN checkpoints over its good
ones. So:

- The step's gradient is checked after the all-reduce, before the optimizer
  step: its global norm is finite or it is not (a NaN or an infinite element,
  or a norm beyond float32's range). With clipping on (`max_grad_norm > 0`, the
  default) that norm is computed anyway and the check costs one scalar read;
  without clipping, one norm over the gradients. The reduced gradient is the
  same on every rank (under ZeRO the norm is summed from the pieces in one
  all-reduce), so every rank reaches the same verdict without a message.
- Naming the rank: after the all-reduce every rank holds the same NaN, and
  where it came from is gone. What each rank still has is its own loss. "The
  rank whose local gradient was not finite" is, here, a rank on which a
  micro-batch of the step had a non-finite loss (the usual source: a NaN loss
  gives a NaN gradient). The ranks tell each other in one all-reduce, made
  only when the gradient was not finite. If every loss was finite, the
  non-finite values arose inside a backward pass (an overflow, the derivative
  of sqrt at 0) on a rank that can no longer be told, and the error says so.
- Parameters are checked before a checkpoint is written, each rank its own
  (ZeRO stage 3's pieces included), by their largest magnitude, which cannot
  overflow: a checkpoint holding a NaN is never written, so rotation never
  deletes the last finite one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor, nn

from phalanx.errors import NonFiniteError
from phalanx.runtime import World

if TYPE_CHECKING:
    from phalanx.train.trainer_state import TrainState

NonFiniteAction = Literal["stop", "skip", "off"]
_FIX = (
    "look at those steps' batches for what makes the loss NaN (a log or a division by 0, "
    "bad data) or lower the learning rate"
)


class NonFiniteGuard:
    """Each step's verdict: step it, skip it, or stop the run; the same on every rank."""

    def __init__(
        self,
        world: World,
        action: NonFiniteAction,
        max_consecutive: int,
        say: Callable[[str], None],
    ) -> None:
        self.world = world
        self.action = action
        self.max_consecutive = max_consecutive
        self.say = say
        """Rank 0's status line (the Trainer's report)."""

    def allows_step(self, grad_norm: Tensor, local_loss: Tensor, state: TrainState) -> bool:
        """True: step. False: skip this step (the caller clears the gradients). Or raise.

        Every rank calls it with the same norm, so all take the same branch; only a
        non-finite step costs a collective (naming the ranks).
        """
        if bool(torch.isfinite(grad_norm)):
            state.skipped_in_a_row = 0
            return True
        what = self._describe(state.global_step + 1, local_loss)
        if self.action == "stop":
            raise NonFiniteError(
                f"{what} — nothing was stepped; {_FIX}, or set on_nonfinite_grad='skip' to "
                "skip such steps"
            )
        state.skipped_steps += 1
        state.skipped_in_a_row += 1
        if state.skipped_in_a_row >= self.max_consecutive:
            raise NonFiniteError(
                f"{what}; that is {state.skipped_in_a_row} skipped steps in a row "
                f"(max_consecutive_skips={self.max_consecutive}), so the run stops — {_FIX}, "
                "and resume from the last checkpoint"
            )
        self.say(
            f"{what} — skipped it ({state.skipped_in_a_row} in a row, at most "
            f"{self.max_consecutive}; {state.skipped_steps} in all)"
        )
        return False

    def _describe(self, step: int, local_loss: Tensor) -> str:
        """Collective: which ranks' losses were not finite, in words."""
        flags = [0.0] * self.world.world_size
        flags[self.world.rank] = 0.0 if bool(torch.isfinite(local_loss)) else 1.0
        if self.world.is_distributed:
            flags = self.world.all_reduce_sum(flags)
        ranks = [rank for rank, flag in enumerate(flags) if flag]
        if ranks:
            return (
                f"step {step}: the gradient is not finite (NaN or inf), and the loss was not "
                f"finite on rank(s) {ranks}"
            )
        return (
            f"step {step}: the gradient is not finite (NaN or inf) though every rank's loss "
            "was finite, so it arose in a backward pass (an overflow, a derivative such as "
            "sqrt's at 0) on a rank the all-reduce no longer shows"
        )


def first_nonfinite(model: nn.Module) -> str | None:
    """The name of this rank's first parameter (or shard) holding a NaN or an inf, or None.

    Rank-local: a stage-3 (DTensor) parameter is looked at through its local shard, which
    may be empty; the DTensor itself would make every norm a collective.
    """
    return first_nonfinite_in((name, p.detach()) for name, p in model.named_parameters())


def first_nonfinite_in(named: Iterable[tuple[str, Tensor]]) -> str | None:
    """The first name whose tensor (a DTensor: its local shard) holds a NaN or an inf."""
    tensors = [(name, local_of(t)) for name, t in named]
    tensors = [(name, t) for name, t in tensors if t.numel() and t.is_floating_point()]
    if not tensors:
        return None
    # The largest magnitude: NaN and inf show, and unlike a 2-norm it cannot overflow.
    worst = torch.nn.utils.get_total_norm([t for _, t in tensors], norm_type=math.inf)
    if bool(torch.isfinite(worst)):
        return None
    return next(name for name, t in tensors if not bool(torch.isfinite(t).all()))


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    to_local = getattr(tensor, "to_local", None)  # a DTensor
    return to_local() if callable(to_local) else tensor


def nonfinite_error(name: str, step: int) -> NonFiniteError:
    """Why checkpoint-<step> is not written: parameter `name` is not finite."""
    return NonFiniteError(
        f"parameter {name!r} is not finite (NaN or inf) at step {step}, so "
        f"checkpoint-{step} is not written and the checkpoints already saved stay as they "
        "are — resume from the newest of them, with a lower learning rate or "
        "on_nonfinite_grad='stop'"
    )


def check_parameters(model: nn.Module, world: World, step: int) -> None:
    """Collective: raise NonFiniteError on every rank if any rank's parameters are not finite."""
    name = first_nonfinite(model)
    world.barrier_or_raise(None if name is None else nonfinite_error(name, step))
