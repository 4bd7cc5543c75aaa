"""What a communication method really sent, counted where it hands tensors to a collective.

Every method here (the comm hooks, PowerSGD, local SGD, DiLoCo) reports its
own compression: bytes it passed to all-reduce ÷ bytes of the gradients a
plain fp32 all-reduce would have sent for the same steps. Both sides are
measured from the tensors themselves (`numel() * element_size()` at the call),
never from a formula for what the method ought to send, so a bug that sends
the whole bucket uncompressed shows up as a ratio of 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from phalanx.parallel.traffic import Collective, Traffic, TrafficCounter


@dataclass
class CommStats(TrafficCounter):
    """Counters of one rank's communication for gradients (or parameters, for local SGD):
    `traffic` is what it handed to collectives, the rest is what that replaced."""

    gradient_bytes: int = 0
    """Bytes of the gradients this rank had to share, in their own dtype: what a plain
    all-reduce of them would send."""
    steps: int = 0
    """Optimizer steps (synchronised backward passes) these counts cover."""

    @property
    def sent_bytes(self) -> int:
        """Payload bytes this rank handed to collectives (each tensor's size, once per call)."""
        return self.traffic.bytes_sent

    @property
    def collectives(self) -> int:
        """Collectives issued."""
        return self.traffic.collectives

    def compression_ratio(self) -> float:
        """Bytes sent ÷ bytes of the gradients: 1.0 for fp32 all-reduce, 0.5 for bf16.

        NaN before anything was counted.
        """
        return self.sent_bytes / self.gradient_bytes if self.gradient_bytes else math.nan

    def bytes_per_step(self) -> float:
        """Bytes sent per optimizer step on this rank (NaN before the first step)."""
        return self.sent_bytes / self.steps if self.steps else math.nan

    def state_dict(self) -> dict[str, int]:
        return {
            "gradient_bytes": self.gradient_bytes,
            "sent_bytes": self.sent_bytes,
            "collectives": self.collectives,
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.gradient_bytes, self.steps = int(state["gradient_bytes"]), int(state["steps"])
        sent, calls = int(state["sent_bytes"]), int(state["collectives"])
        self.traffic = Traffic(collectives=calls, gradient_bytes=sent)


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class HookState:
    """The state to pass to `register_comm_hook` when the hook should count its bytes.

    torch's hooks take a process group (or None) as their state; phalanx's take
    that too, and also this, which adds `stats`. PowerSGD's state is one of these.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.stats = CommStats()
        self.divisor: int | None = None
        """The ranks a bucket's sum is averaged over; None: the group's size. Set by the
        reducer (Join with divide_by_initial_world_size=False: the ranks still training)."""

    def state_dict(self) -> dict[str, Any]:
        """The counters, so they carry on across a resume (PowerSGD adds its memory)."""
        return {"stats": self.stats.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stats.load_state_dict(state["stats"])


def process_group_of(state: Any) -> dist.ProcessGroup:
    """The group a hook averages over: the state's, or the default group for None."""
    group = state.process_group if isinstance(state, HookState) else state
    if isinstance(group, dist.ProcessGroup):
        return group
    world = dist.group.WORLD
    assert isinstance(world, dist.ProcessGroup), "torch.distributed is not initialised"
    return world


def divisor_of(state: Any, group: dist.ProcessGroup) -> int:
    """What a hook divides a bucket's sum by: its HookState's divisor (Join's), else the
    group's size (torch's hooks, whose state is a process group, keep torch's rule)."""
    divisor = state.divisor if isinstance(state, HookState) else None
    return group.size() if divisor is None else divisor


def stats_of(state: Any) -> CommStats | None:
    return state.stats if isinstance(state, HookState) else None


def count_gradients(stats: CommStats | None, buffer: torch.Tensor, is_last: bool) -> None:
    """Record one bucket's gradients and, for the last bucket of a backward, one step."""
    if stats is not None:
        stats.gradient_bytes += tensor_bytes(buffer)
        stats.steps += int(is_last)


def all_reduce_counted(
    tensor: torch.Tensor, group: dist.ProcessGroup, stats: CommStats | None
) -> torch.futures.Future[list[torch.Tensor]]:
    """Start a sum all-reduce of `tensor` and count its bytes; return its future."""
    if stats is not None:
        stats.add(Traffic.of_tensor(Collective.ALL_REDUCE, tensor, group.size(), gradients=True))
    return dist.all_reduce(tensor, group=group, async_op=True).get_future()


def all_reduce_mean(
    tensor: torch.Tensor, group: dist.ProcessGroup, stats: CommStats | None, divisor: int
) -> torch.futures.Future[torch.Tensor]:
    """Average `tensor` in place across `group` over `divisor` ranks (divide, then sum:
    torch's default hook)."""
    tensor.div_(divisor)
    return all_reduce_counted(tensor, group, stats).then(lambda done: done.value()[0])
