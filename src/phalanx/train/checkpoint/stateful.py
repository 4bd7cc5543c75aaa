"""The checkpoint protocol: everything saved is an entry of one `dict[str, Stateful]`.

An entry is any object with torch's `state_dict()` / `load_state_dict()`
(a module, an optimizer, a scheduler, a scaler, or a small adapter), as in
torchtitan's checkpointer. Adding a piece of state to the Trainer's
checkpoints is one more entry; the checkpointer knows nothing about what
the entries are, only where each one's state lives (its *placement*):

- "replicated": the same on every rank; rank 0 writes `<name>.pt` and every
  rank loads it (the model, a plain optimizer, the scheduler, counters).
- "per_rank": each rank has its own; rank 0 gathers them and writes
  `<name>/rank-XXXXX.pt`, and each rank loads its own (the RNG streams).
- "sharded": each rank holds a part; the entry writes and reads the parts
  itself, with torch.distributed.checkpoint, through `save_sharded(directory)`
  and `load_sharded(directory)`, both collectives called on every rank
  (ZeroRedundancyOptimizer). DCP reshards on load, so a sharded entry can
  resume at another world size.

A sharded entry that can also hand over its state as a DCP state dict
(`sharded_state_dict()`, tensors as DTensors of its shards: `DcpStateful`) can
be saved in the background: the checkpointer copies that state to host memory
at the step boundary and writes it with DCP while training goes on. Without
the method, its saves are written before the loop goes on.

An object declares its placement with a `checkpoint_placement` attribute;
without one, an object that has `save_sharded`/`load_sharded` is sharded and
anything else is replicated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final, Literal, Protocol, get_args, runtime_checkable

from phalanx.errors import CheckpointError

Placement = Literal["replicated", "per_rank", "sharded"]
PLACEMENTS: Final[tuple[Placement, ...]] = get_args(Placement)


@runtime_checkable
class Stateful(Protocol):
    """torch's protocol: a state made of tensors and plain values, and its loader."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@runtime_checkable
class ShardedStateful(Protocol):
    """State spread over ranks: written and read by every rank at once (collectives)."""

    def save_sharded(self, directory: Path) -> None: ...

    def load_sharded(self, directory: Path) -> None: ...


@runtime_checkable
class DcpStateful(ShardedStateful, Protocol):
    """A sharded entry whose state the checkpointer can copy and write itself, later."""

    def sharded_state_dict(self) -> dict[str, Any]:
        """The state `save_sharded` writes, as the dict it hands DCP (its tensors this rank's
        shards as DTensors): local work only, no collective."""
        ...


Entry = Stateful | ShardedStateful
"""What a checkpoint holds under each name: torch's protocol, or the sharded one."""


def placement_of(entry: object) -> Placement:
    """Where `entry`'s state lives: its declared placement, else sharded or replicated."""
    declared = getattr(entry, "checkpoint_placement", None)
    if declared in PLACEMENTS:
        return declared
    return "sharded" if isinstance(entry, ShardedStateful) else "replicated"


def replicated_file(name: str) -> str:
    return f"{name}.pt"


def per_rank_file(name: str, rank: int) -> str:
    return f"{name}/rank-{rank:05d}.pt"


def stateful_of(name: str, entry: object) -> Stateful:
    if not isinstance(entry, Stateful):
        why = "has no state_dict/load_state_dict — give it those methods, or declare it"
        raise _not_usable(name, why + " sharded (save_sharded/load_sharded)")
    return entry


def sharded_of(name: str, entry: object) -> ShardedStateful:
    if not isinstance(entry, ShardedStateful):
        why = "is declared sharded but has no save_sharded/load_sharded — give it those"
        raise _not_usable(name, why + " methods, or declare it replicated")
    return entry


def dcp_of(name: str, entry: object) -> DcpStateful:
    if not isinstance(entry, DcpStateful):
        why = "has no sharded_state_dict, so it cannot be saved in the background — this"
        raise _not_usable(name, why + " is a phalanx bug (can_stage decides)")
    return entry


def _not_usable(name: str, why: str) -> CheckpointError:
    return CheckpointError(f"checkpoint entry {name!r} {why}")
