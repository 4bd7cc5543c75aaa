"""The few collectives the Trainer needs, written once for "one process" and "many".

A plain single-process run has no process group at all; every method here
then returns its local answer, so the training loop has no special cases.
`agree` is how a failure on one rank becomes the same error on every rank
instead of a hang at the next collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from phalanx.errors import ConfigurationError, PhalanxError
from phalanx.train.checkpoint import CheckpointError

# The error types `agree` re-raises by name on the ranks that did not fail themselves.
_KINDS: dict[str, type[PhalanxError]] = {
    "ConfigurationError": ConfigurationError,
    "CheckpointError": CheckpointError,
}


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job, and the group it talks over (None alone)."""

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup | None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.group is not None

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum each number over ranks, in float64 so counts stay exact."""
        if self.group is None:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, group=self.group)
        return [float(v) for v in tensor.tolist()]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def agree(self, error: PhalanxError | None) -> None:
        """Meet every rank; if any rank failed, raise its error on all of them.

        Doubles as the barrier after rank 0 writes a checkpoint.
        """
        mine = None if error is None else (type(error).__name__, str(error))
        failures = [
            (rank, failure)
            for rank, failure in enumerate(self.all_gather_object(mine))
            if failure is not None
        ]
        if not failures:
            return
        if error is not None:
            raise error
        rank, (kind, message) = failures[0]
        raise _KINDS.get(kind, PhalanxError)(f"rank {rank}: {message}")
