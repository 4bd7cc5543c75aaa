"""The failure summary: who failed first, how, and, when a rank stalled, which one did.

A rank that stalls makes its peers wait in their next collective until the
timeout; the first process to exit is then a healthy rank, and its traceback
("Timed out waiting ... for recv") blames nobody. Each worker records its
position (`phalanx.ground.progress_record`): when the rank that failed had
entered more collectives than a rank that is still running, that running rank
did not arrive, and the summary names it, says where every rank stood, and
shows the stuck rank's Python stacks, which it dumps on the launcher's signal
just before the workers are stopped.

The same records tell a rank that ran out of data: when a rank that had entered
fewer collectives exited cleanly, it finished its loop while the failed rank
still had steps to go, and gloo's "Connection closed by peer" was only the
echo of its leaving. The summary then says that the ranks ran different
numbers of steps, and how to even them out.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from phalanx.ground.progress_record import Position, read_record, record_path, stacks_path
from phalanx.launch.procgroup import describe_returncode

__all__ = ["Stall", "failure_summary", "find_stall"]

_STACK_WAIT_S = 3.0
_STACK_SETTLE_S = 0.2
_MAX_STACK_LINES = 40


class _Worker(Protocol):
    rank: int
    local_rank: int

    @property
    def pid(self) -> int: ...

    def alive(self) -> bool: ...

    def exit_status(self) -> int | None: ...

    def stderr_tail(self) -> list[str]: ...


@dataclass(frozen=True)
class Stall:
    """Where every rank of this node stood when the first one failed."""

    positions: dict[int, Position]
    laggards: list[int]
    """Live ranks that had entered fewer collectives than the failed rank: they did not arrive."""
    stacks: dict[int, list[str]]
    finished: list[int] = field(default_factory=list)
    """Ranks that exited cleanly having entered fewer collectives than the failed rank: they
    ran out of steps while it went on."""

    @property
    def uneven(self) -> bool:
        """The ranks ran different numbers of steps: the script's bug, not the machinery's."""
        return not self.laggards and bool(self.finished)


def find_stall(failed_rank: int, workers: Sequence[_Worker], directory: Path) -> Stall:
    """Read every rank's record; ask the ranks that lag for their stacks (before any stop)."""
    positions = {
        w.rank: pos for w in workers if (pos := read_record(record_path(directory, w.rank)))
    }
    failed = positions.get(failed_rank)
    behind = [
        w
        for w in workers
        if failed is not None
        and w.rank in positions
        and positions[w.rank].collectives < failed.collectives
    ]
    # A rank that exited cleanly will never arrive: it finished, it did not stall. (Its
    # connections close only as its process ends, so its status is known by the time
    # a peer fails on them.)
    finished = [w for w in behind if w.exit_status() == 0]
    laggards = [w for w in behind if w.alive() and w not in finished]
    stacks = collect_stacks(laggards, positions, directory)
    return Stall(positions, [w.rank for w in laggards], stacks, [w.rank for w in finished])


def collect_stacks(
    workers: Sequence[_Worker], positions: Mapping[int, Position], directory: Path
) -> dict[int, list[str]]:
    """Signal each worker to dump its stacks (faulthandler, armed by progress.start) and
    read the dumps once they stop growing."""
    asked = []
    for worker in workers:
        signum = positions[worker.rank].dump_signal
        if signum:
            try:
                os.kill(worker.pid, signum)
                asked.append(worker.rank)
            except OSError:
                pass
    deadline = time.monotonic() + _STACK_WAIT_S
    sizes: dict[int, int] = {}
    while asked and time.monotonic() < deadline:
        now = {r: _size(stacks_path(directory, r)) for r in asked}
        if all(now.values()) and now == sizes:
            break
        sizes = now
        time.sleep(_STACK_SETTLE_S)
    out = {}
    for rank in asked:
        text = stacks_path(directory, rank).read_text(errors="replace").splitlines()
        out[rank] = text[:_MAX_STACK_LINES] + (["..."] if len(text) > _MAX_STACK_LINES else [])
    return out


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _stall_lines(failed: _Worker, code: str, node_rank: int, stall: Stall) -> list[str]:
    failed_at = stall.positions[failed.rank]
    many = len(stall.laggards) > 1
    names = ", ".join(str(r) for r in stall.laggards)
    return [
        f"FAILED: rank{'s' if many else ''} {names} did not arrive at collective "
        f"{failed_at.collective_text()}: rank {failed.rank} (local rank {failed.local_rank} "
        f"on node {node_rank}, pid {failed.pid}) waited for {'them' if many else 'it'} there "
        f"and failed first: {code}"
    ]


def _uneven_lines(failed: _Worker, code: str, node_rank: int, stall: Stall) -> list[str]:
    """The failed rank went on after a peer's loop ended: different numbers of steps."""
    many = len(stall.finished) > 1
    names = ", ".join(str(r) for r in stall.finished)
    ended = min(stall.positions[r].collectives for r in stall.finished)
    return [
        f"FAILED: the ranks ran different numbers of steps: rank{'s' if many else ''} {names} "
        f"finished (exit code 0) after collective #{ended}, while rank {failed.rank} (local "
        f"rank {failed.local_rank} on node {node_rank}, pid {failed.pid}) went on to "
        f"{stall.positions[failed.rank].collective_text()} and failed there: {code} — give "
        "every rank the same number of batches (DistributedSampler pads them unless "
        "drop_last; the Trainer's even_batches=True), or run the loop under "
        "`with phalanx.Join([model]):`"
    ]


def _positions(stall: Stall, now: float, failed_rank: int) -> list[str]:
    lines = ["where each rank stood:"]
    for rank, pos in sorted(stall.positions.items()):
        note = (
            "  <- failed first"
            if rank == failed_rank
            else "  <- did not arrive"
            if rank in stall.laggards
            else "  <- finished"
            if rank in stall.finished
            else ""
        )
        lines.append(f"  rank {rank}: {pos.where()}; {now - pos.updated:.1f}s ago{note}")
    for rank, stack in sorted(stall.stacks.items()):
        lines.append(f"the Python stacks of rank {rank}:")
        lines.extend(f"  | {line}" for line in stack)
    return lines


def failure_summary(
    failed: _Worker, returncode: int, node_rank: int, stall: Stall | None = None
) -> str:
    """Who failed first, how, where each rank stood, and the end of its stderr."""
    code = describe_returncode(returncode)
    if stall is not None and stall.laggards:
        lines = _stall_lines(failed, code, node_rank, stall)
    elif stall is not None and stall.uneven:
        lines = _uneven_lines(failed, code, node_rank, stall)
    else:
        lines = [
            f"FAILED: rank {failed.rank} (local rank {failed.local_rank} on node {node_rank}, "
            f"pid {failed.pid}) was the first to fail: {code}"
        ]
    if stall is not None and stall.positions:
        lines += _positions(stall, time.time(), failed.rank)
    tail = failed.stderr_tail()
    if tail:
        lines.append(f"the end of rank {failed.rank}'s stderr:")
        lines.extend(f"  | {line}" for line in tail)
    else:
        lines.append(f"rank {failed.rank} wrote nothing to stderr")
    return "\n".join(lines)
