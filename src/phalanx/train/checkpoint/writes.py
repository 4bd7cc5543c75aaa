"""A save in two halves: `stage` at the step boundary, `write` then or in the background.

`stage` (the training thread, every rank, collective) takes what the save
needs while the state is the step's: every rank's per-rank states gathered on
rank 0, the staging folder made by rank 0 and its name told to every rank, and
the entries' states. Saved now (`copy=False`) the entries are kept as they are
and read by `write` right after; saved in the background (`copy=True`) each
rank copies its part to host memory (staging.py): rank 0 the replicated
entries, every rank its sharded ones.

`write` takes turns in the staging folder (directory.py makes it atomic), on
the World it is given (the training group, or the writer thread's own):

1. every rank writes each sharded entry into `<tmp>/<name>` (DCP: each rank its
   own files);
2. rank 0 writes the replicated entries as `<name>.pt`, the per-rank ones as
   `<name>/rank-XXXXX.pt`, the notes, and what `derived` makes of them;
3. rank 0 hashes and fsyncs every file (the others' shards too), writes the
   manifest, renames, rotates (within the run's own lineage: lineage.py).

After each turn all ranks meet in `World.barrier_or_raise`: a failure on any
rank (a full disk, a read-only directory, a state that cannot be pickled) is
one `CheckpointError` on every rank, saying which file and why; rank 0 then
removes the partial `.tmp`, and the previous checkpoints stay as they were.

A copied state (a background save, on the writer thread) takes no turns: every
rank checks its copy (`validate`: a NaN model) and writes its parts with no
collective (the sharded ones in DCP's format, each rank's plan computed alone:
dcp_local.py; rank 0 its files), one all-gather agrees that all did, rank 0
writes the `.metadata` files and the derived ones, seals and rotates, and one
broadcast says how that ended: two exchanges per save, the same failure on
every rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from phalanx import errors
from phalanx.errors import CheckpointError, PeerLost, PhalanxError
from phalanx.offload.held import SaveHold
from phalanx.runtime import World
from phalanx.train.checkpoint.dcp_local import LocalPlan, metadata, write_metadata, write_part
from phalanx.train.checkpoint.directory import (
    PREFIX,
    begin,
    checkpoint_bytes,
    discard,
    read_manifest,
    write_file,
)
from phalanx.train.checkpoint.failures import failures, reason
from phalanx.train.checkpoint.lineage import Lineage, resume_order
from phalanx.train.checkpoint.staging import Stager
from phalanx.train.checkpoint.stateful import (
    DcpStateful,
    Entry,
    Placement,
    dcp_of,
    per_rank_file,
    placement_of,
    replicated_file,
    sharded_of,
    stateful_of,
)

Derived = Callable[[Path, Mapping[str, Placement]], None]
"""Run on rank 0 once the entries are written: files made from them (HF's weights)."""


@dataclass(frozen=True)
class Saved:
    """What a save wrote."""

    path: Path
    bytes: int
    """Every file of the checkpoint, all ranks' parts included."""
    seconds: float
    """From the step boundary to the checkpoint in place."""
    blocked_s: float
    """Of which the training loop waited (all of it for a save written there and then)."""


@dataclass
class Staged:
    """A save between its halves: what `stage` took at the step boundary, for `write`."""

    step: int
    tmp: Path
    placements: dict[str, Placement]
    started: float
    notes: Mapping[str, bytes]
    derived: Derived | None
    copied: bool
    """The entries' states were copied to host memory (a background save)."""
    sharded: dict[str, Any] = field(default_factory=dict)
    """Each sharded entry's part: its copied DCP state dict, or the entry itself (now)."""
    replicated: dict[str, Any] = field(default_factory=dict)
    """Rank 0: each replicated entry's copied state, or the entry itself (now)."""
    per_rank: dict[str, list[Any]] = field(default_factory=dict)
    """Rank 0: every rank's state of each per-rank entry."""
    written: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Rank 0: the manifest entries of the files it wrote (hashed on the way)."""
    failure: BaseException | None = None
    """Why this rank could not take its part (raised in the write's first turn)."""
    validate: Callable[[Staged, Callable[[Any], Any]], PhalanxError | None] | None = None
    """Run by every rank's writer on the copy before a byte is written: a refusal (a NaN
    model) fails the save on every rank, as a failed write does. Its second argument gives
    each staged tensor's values of the step (a held one's may be its copy aside)."""
    bytes: int = 0
    """Host memory the copy took on this rank."""
    buffers: list[Any] = field(default_factory=list)
    """The byte buffers the copy lives in (the next save's pool once this one is written)."""
    hold: SaveHold | None = None
    """The offloaded tensors written from their files, not copied (offload/held.py)."""
    blocked_s: float = 0.0


def can_stage(states: Mapping[str, Entry]) -> bool:
    """Whether every sharded entry hands its state over to be copied (DcpStateful)."""
    return all(
        isinstance(entry, DcpStateful)
        for entry in states.values()
        if placement_of(entry) == "sharded"
    )


def stage(
    world: World,
    output_dir: Path,
    states: Mapping[str, Entry],
    step: int,
    notes: Mapping[str, bytes] | None,
    derived: Derived | None,
    copy: bool,
    pool: list[Any] | None = None,
    hold: SaveHold | None = None,
) -> Staged:
    """Collective: the save's first half (module docstring); `copy`: to host memory, into
    the buffers of `pool` where their sizes fit (staging.py), but for the file-backed
    tensors that `hold` keeps still instead."""
    started = time.perf_counter()
    placements = {name: placement_of(entry) for name, entry in states.items()}
    per_rank = {
        name: world.all_gather_state(stateful_of(name, entry).state_dict())
        for name, entry in states.items()
        if placements[name] == "per_rank"
    }
    tmp = _begin(world, output_dir, step)
    staged = Staged(step, tmp, placements, started, dict(notes or {}), derived, copy)
    if world.is_main:
        staged.per_rank = per_rank
    stager = Stager(pin=world.device.type == "cuda", pool=pool, hold=hold if copy else None)
    staged.hold = stager.hold
    try:
        for name, entry in states.items():
            if placements[name] == "sharded":
                part = dcp_of(name, entry).sharded_state_dict() if copy else entry
                staged.sharded[name] = stager.copy(part) if copy else part
            elif placements[name] == "replicated" and world.is_main:
                part = stateful_of(name, entry).state_dict() if copy else entry
                staged.replicated[name] = stager.copy(part) if copy else part
        stager.finish()
    except Exception as exc:  # raised, on every rank together, in the write's first turn
        staged.failure = exc
    staged.bytes, staged.buffers = stager.bytes, stager.buffers
    staged.blocked_s = time.perf_counter() - started
    return staged


def write(world: World, lineage: Lineage, staged: Staged) -> Saved:
    """Collective over `world`: the save's second half (module docstring)."""
    if staged.copied:
        try:
            return _write_agreed(world, lineage, staged)
        finally:
            if staged.hold is not None:
                staged.hold.close()
    turn = partial(_turn, world, lineage.output_dir, staged)
    for name, part in staged.sharded.items():
        turn(partial(_write_sharded, staged, name, part), everyone=True, part=name)
    turn(partial(_write_on_main, staged), everyone=False)
    sizes: list[int] = []

    def seal_on_main() -> None:
        sealed = lineage.seal(staged.tmp, staged.step, staged.placements, staged.written)
        sizes.append(checkpoint_bytes(read_manifest(sealed)))  # before anything is deleted
        lineage.rotate()

    turn(seal_on_main, everyone=False)
    size = int(world.broadcast_json(sizes[0] if sizes else 0))
    path = lineage.output_dir / f"{PREFIX}{staged.step}"
    seconds = time.perf_counter() - staged.started
    return Saved(path, size, seconds, staged.blocked_s if staged.copied else seconds)


def _write_sharded(staged: Staged, name: str, part: Any) -> None:
    _raise_failure(staged)
    sharded_of(name, part).save_sharded(staged.tmp / name)


def _write_agreed(world: World, lineage: Lineage, staged: Staged) -> Saved:
    """A copied state's write, in two collectives whatever its size and entries: every rank
    writes its parts with none (dcp_local.py: DCP's format, the plan computed alone), rank 0
    its own files too; one all-gather agrees that all did and carries each rank's item
    lengths; rank 0 writes each entry's `.metadata`, the derived files, seals and rotates;
    one broadcast says how that ended. A failure anywhere is raised on every rank."""
    plans: dict[str, LocalPlan] = {}
    mine: dict[str, Any] = {"error": None, "lengths": {}}
    error: PhalanxError | None = None
    try:
        _raise_failure(staged)
        with staged.hold.still() if staged.hold is not None else nullcontext(_as_is) as of_step:
            refused = staged.validate(staged, of_step) if staged.validate is not None else None
        if refused is not None:
            raise refused
        for name, part in staged.sharded.items():
            plans[name] = LocalPlan(part, world.rank)
            mine["lengths"][name] = write_part(plans[name], staged.tmp / name, staged.hold)
        if world.is_main:
            _write_files(staged)
    except PhalanxError as exc:
        error = exc
    except failures() as exc:
        part = next((n for n in staged.sharded if n not in mine["lengths"]), None)
        error = CheckpointError(
            _write_failure(lineage.output_dir, staged.tmp, staged.step, exc, part)
        )
    if error is not None:
        mine["error"] = [type(error).__name__, str(error)]
    outcome: dict[str, Any] | None = None
    try:
        agreed = world.all_gather_json(mine)  # the agreement: every rank's part is written
        if world.is_main:
            outcome = _seal_agreed(lineage, staged, plans, agreed)
        outcome = world.broadcast_json(outcome)  # how rank 0's seal ended
    except PeerLost:  # live recovery: the generation ended under the write
        if world.is_main:
            discard(staged.tmp)  # gone already if it was sealed before the loss
        raise
    if outcome["error"] is not None:
        rank, kind, message = outcome["error"]
        if rank == world.rank and error is not None:
            raise error
        raise getattr(errors, kind, PhalanxError)(
            message if rank == 0 else f"rank {rank}: {message}"
        )
    path = lineage.output_dir / f"{PREFIX}{staged.step}"
    return Saved(path, outcome["size"], time.perf_counter() - staged.started, staged.blocked_s)


def _as_is(tensor: Any) -> Any:
    return tensor


def _raise_agreed(failure: list[Any], rank: int, mine: PhalanxError | None) -> None:
    """The agreed failure, as barrier_or_raise raises one: the failing rank its own, the
    others its message prefixed with its rank."""
    failing, kind, message = failure
    cls = getattr(errors, kind, PhalanxError)
    if failing == rank:
        raise mine if mine is not None else cls(message)
    raise cls(f"rank {failing}: {message}")


def _seal_agreed(
    lineage: Lineage, staged: Staged, plans: dict[str, LocalPlan], agreed: list[Any]
) -> dict[str, Any]:
    """Rank 0, once every rank said how its part went: the first failure, or the metadata,
    the derived files, the seal and the rotation; the partial staging folder goes on any
    failure."""
    failed = [(rank, a["error"]) for rank, a in enumerate(agreed) if a["error"] is not None]
    if failed:
        discard(staged.tmp)
        rank, (kind, message) = failed[0]
        return {"error": [rank, kind, message]}
    try:
        for name, plan in plans.items():
            lengths = [a["lengths"][name] for a in agreed]
            write_metadata(metadata(plan, lengths), staged.tmp / name)
        if staged.derived is not None:
            staged.derived(staged.tmp, staged.placements)
        sealed = lineage.seal(staged.tmp, staged.step, staged.placements, staged.written)
        size = checkpoint_bytes(read_manifest(sealed))  # before anything is deleted
        lineage.rotate()
    except PhalanxError as exc:
        discard(staged.tmp)
        return {"error": [0, type(exc).__name__, str(exc)]}
    except failures() as exc:
        discard(staged.tmp)
        why = _write_failure(lineage.output_dir, staged.tmp, staged.step, exc, None)
        return {"error": [0, "CheckpointError", why]}
    return {"error": None, "size": size}


def _write_on_main(staged: Staged) -> None:
    _write_files(staged)
    if staged.derived is not None:
        staged.derived(staged.tmp, staged.placements)


def _write_files(staged: Staged) -> None:
    """Rank 0's files: the replicated entries, every rank's per-rank ones, the notes."""
    _raise_failure(staged)
    written, tmp = staged.written, staged.tmp
    for name, part in staged.replicated.items():
        state = part if staged.copied else stateful_of(name, part).state_dict()
        written[replicated_file(name)] = write_file(tmp, replicated_file(name), state)
    for name, states in staged.per_rank.items():
        for rank, state in enumerate(states):
            written[per_rank_file(name, rank)] = write_file(tmp, per_rank_file(name, rank), state)
    for file, data in staged.notes.items():
        written[file] = write_file(tmp, file, data)


def _raise_failure(staged: Staged) -> None:
    failure, staged.failure = staged.failure, None
    if failure is not None:
        raise failure


def _begin(world: World, output_dir: Path, step: int) -> Path:
    """Rank 0 makes the staging folder (a random name) and every rank learns it."""
    made: list[Path] = []
    action = lambda: made.append(begin(output_dir, step))  # noqa: E731
    _turn_at(world, output_dir, None, step, action, everyone=False)
    return Path(world.broadcast_json(str(made[0]) if made else None))


def _turn(
    world: World,
    output_dir: Path,
    staged: Staged,
    action: Callable[[], object],
    everyone: bool,
    part: str | None = None,
) -> None:
    _turn_at(world, output_dir, staged.tmp, staged.step, action, everyone, part)


def _turn_at(
    world: World,
    output_dir: Path,
    tmp: Path | None,
    step: int,
    action: Callable[[], object],
    everyone: bool,
    part: str | None = None,
) -> None:
    """Run `action` (on rank 0, or on every rank), then meet; any failure fails all.

    `part` names the sharded entry every rank is writing, for the message.
    """
    error: PhalanxError | None = None
    if everyone or world.is_main:
        try:
            action()
        except PhalanxError as exc:
            error = exc
        except failures() as exc:  # DCP's is a BaseException
            error = CheckpointError(_write_failure(output_dir, tmp, step, exc, part))
    try:
        world.barrier_or_raise(error)
    except PhalanxError:
        if world.is_main and tmp is not None:
            discard(tmp)  # every rank is past its writes: nothing is still writing here
        raise


def _write_failure(
    output_dir: Path, tmp: Path | None, step: int, exc: BaseException, part: str | None
) -> str:
    existing = resume_order(output_dir)
    kept = f"{existing[0].name} is intact" if existing else "there is no earlier checkpoint"
    where = output_dir if tmp is None else tmp if part is None else tmp / part
    why, on_disk = reason(exc, where)
    fix = (
        f"free space or fix permissions in {output_dir}"
        if on_disk
        else "keep every state to tensors and plain values"
    )
    return f"could not write {PREFIX}{step}: {why} — {fix}; {kept}"
