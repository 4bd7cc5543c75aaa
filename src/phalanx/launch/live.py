"""`phalanx launch --live-recovery`: the launcher's side. A worker that dies is reported lost
in the job's store and replaced, and the others are left running; a worker whose heartbeat
stops (SIGSTOP, a wedged process) is killed first, so it cannot come back with stale state.

The workers do the rest (runtime/live.py, runtime/membership.py): the survivors agree
on the next members and go on; the replacement is let in at a step boundary and given
its state by a live peer. The job ends when every worker has exited: 0 when the last
ones to finish succeeded.
"""

from __future__ import annotations

import json
import secrets
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from phalanx.errors import StoreLost
from phalanx.ground.live_store import LiveStore, StoreConn
from phalanx.ground.progress_record import read_record, record_path
from phalanx.ground.runauth import RunKey
from phalanx.ground.store_keys import (
    FINISHED_KEY,
    GENERATION_KEY,
    RESTART_KEY,
    RESTART_MARK,
    claim_key,
    heartbeat_name,
    lost_key,
    members_key,
    node_key,
)
from phalanx.ground.storeclient import StoreClient
from phalanx.launch.config import DEFAULT_EXIT_TIMEOUT_S
from phalanx.launch.exitwatch import fence_hung_exit
from phalanx.launch.procgroup import describe_returncode, signal_group
from phalanx.launch.summary import failure_summary
from phalanx.launch.workers import Failure, StopRequest, Worker, WorkerGroup, wait_for_an_exit

__all__ = ["Connect", "LiveSupervisor", "Respawn", "report_lost", "take_members", "tcp_store"]

Respawn = Callable[[int, str], Worker]
"""Start a replacement for local slot `local_rank` as member `member`."""
Connect = Callable[[], StoreConn]
"""A new connection to the job's store (the attempt's): a TCPStore's, or etcd's."""

_STORE_TIMEOUT_S = 10.0
_RESTART_POLL_S = 0.5
"""How often a launcher of a run over several nodes looks for another's restart."""


def tcp_store(addr: tuple[str, int]) -> Connect:
    """Connections to the TCPStore a launcher hosts at `addr`."""
    return lambda: StoreClient(*addr, _STORE_TIMEOUT_S)


def report_lost(store: LiveStore, member: str, why: str) -> None:
    """Tell the survivors `member` is gone, so they neither wait for it nor step without it."""
    store.put(lost_key(member), why)
    # End the members' generation now: under local SGD no collective may come for a
    # while to tell them, and they must not take steps the lost rank will not share.
    _end_generation_of(store, member, why)


def take_members(connect: Connect, count: int, key: RunKey) -> list[str]:
    """`count` new replacement names (`j<n>`), each claimed once in the store, so no two
    launchers ever start the same member."""
    with connect() as client:
        store = LiveStore(client, key)
        return [_next_member(store) for _ in range(count)]


def _next_member(store: LiveStore) -> str:
    """The lowest name j1, j2, ... not yet claimed, claimed now (a stranger's garbage in a
    claim is swapped out, never taken as a claim: ground/live_store.py)."""
    nonce = secrets.token_hex(8)
    n = 1
    while not store.claimed(claim_key(f"j{n}"), nonce):
        n += 1
    return f"j{n}"


@dataclass
class _Slot:
    worker: Worker
    member: str
    done: bool = False
    fenced_after_s: float | None = None
    hung_at_exit: bool = False
    """Fenced because its interpreter began to exit and never ended (not a stall)."""


@dataclass
class LiveSupervisor:
    """Watches this node's workers for a live-recovery run (module docstring)."""

    group: WorkerGroup
    connect: Connect
    key: RunKey
    """The run's secret: every value this launcher writes in the store is signed with it."""
    progress_dir: Path
    respawn: Respawn
    replacements: int
    stall_s: float
    say: Callable[[str], None]
    stop_request: StopRequest
    interval_s: float = 0.1
    exit_timeout_s: float = DEFAULT_EXIT_TIMEOUT_S
    """How long a worker may take to exit once its script ended (launch/exitwatch.py)."""
    fell_back: Failure | None = None
    """The loss that ended a run which cannot go on without the lost rank (ZeRO: its
    workers left RESTART_MARK): the agent restarts the group as without live recovery."""
    members: list[str] = field(default_factory=list)
    """The member names of `group.workers`, when they are replacements (a node that joined
    the run late); empty: the first workers, `r<rank>`."""
    node_rank: int | None = None
    """This node's rank in a run over several nodes: its members are kept in the store."""
    nnodes: int = 1
    restart_asked: str | None = None
    """Why another node's launcher restarts its worker group (RESTART_KEY): this one
    restarts its own with it, since its workers cannot go on alone."""
    _next_poll: float = 0.0
    _slots: list[_Slot] = field(default_factory=list)
    _losses: list[tuple[_Slot, int, str]] = field(default_factory=list)
    """Each loss in order: the slot, its exit status, why (for the summary)."""

    def run(self) -> int:
        """Exit status once every worker (replacements included) has exited, or the signum
        that stopped the launcher."""
        names = self.members or [f"r{w.rank}" for w in self.group.workers]
        self._slots = [_Slot(w, name) for w, name in zip(self.group.workers, names, strict=True)]
        self._publish_members()
        status = 0
        while True:
            if self.stop_request.signum is not None:
                return self.stop_request.signum
            for slot in list(self._slots):
                if slot.done:
                    continue
                code = slot.worker.exit_status()
                if code is None:
                    self._fence_if_stalled(slot)
                    continue
                slot.done = True
                if slot.hung_at_exit and self._run_finished():
                    continue  # its run's work is done: the teardown that hung loses nothing
                lost = f"rank {slot.worker.rank} ({slot.member}) lost ({describe_returncode(code)})"
                if code != 0 and (self.progress_dir / RESTART_MARK).exists():
                    self._ask_every_node(f"{lost}, which the run cannot go on without")
                    self.fell_back = Failure(slot.worker, code)
                    return code
                if code != 0 and self._before_the_first_group(slot):
                    self.say(
                        f"{lost} before the run's group formed, where the others would wait "
                        "for it: nothing has trained yet, so the worker group restarts "
                        "(--max-restarts)"
                    )
                    self._ask_every_node(f"{lost} before the run's group formed")
                    self.fell_back = Failure(slot.worker, code)
                    return code
                if code != 0 and self._nothing_trained(slot):
                    self.say(
                        f"{lost} before the first step: nothing has trained yet, so the worker "
                        "group restarts (--max-restarts)"
                    )
                    self._ask_every_node(f"{lost} before the first step")
                    self.fell_back = Failure(slot.worker, code)
                    return code
                status = code if code == 0 else self._lost(slot, code)
            if all(slot.done for slot in self._slots):
                return self._final_status(status)
            asked = self._restart_elsewhere()
            if asked is not None:
                self.say(f"{asked}: this node's worker group restarts with it")
                self.restart_asked = asked
                return 1
            running = [slot.worker for slot in self._slots if not slot.done]
            wait_for_an_exit(running, self.interval_s)

    def _ask_every_node(self, reason: str) -> None:
        """In a run over several nodes, restart every node's worker group with this one's:
        the others' workers would wait for this node's in the first group's formation, or
        hold state the restart leaves behind. Waits, up to the stall timeout (a lost node
        never answers), until each other launcher has seen it: the store's host serves
        the next attempt's store, without this key, right after."""
        if self.node_rank is None:
            return
        deadline = time.monotonic() + self.stall_s
        others = [n for n in range(self.nnodes) if n != self.node_rank]
        try:
            with self.connect() as client:
                store = LiveStore(client, self.key)
                store.put(RESTART_KEY, f"node {self.node_rank}: {reason}")
                while time.monotonic() < deadline and not all(
                    store.read(f"{RESTART_KEY}/ack/{n}") is not None for n in others
                ):
                    time.sleep(self.interval_s)
        except (OSError, RuntimeError) as exc:  # RuntimeError: etcd's StoreLost
            self.say(f"could not ask the other nodes to restart with this one ({exc})")

    def _restart_elsewhere(self) -> str | None:
        """In a run over several nodes, every _RESTART_POLL_S: why another node's launcher
        restarts its worker group, if one does (acknowledged in the store)."""
        now = time.monotonic()
        if self.node_rank is None or now < self._next_poll:
            return None
        self._next_poll = now + _RESTART_POLL_S
        try:
            with self.connect() as client:
                store = LiveStore(client, self.key)
                reason = store.read(RESTART_KEY)
                if reason is not None:
                    store.put(f"{RESTART_KEY}/ack/{self.node_rank}", "seen")
                return reason
        except (OSError, RuntimeError):  # the store away or without a quorum: asked again
            return None

    def _before_the_first_group(self, slot: _Slot) -> bool:
        """A first worker lost before any worker here beat: its generation 0 never formed
        (a worker beats once its group has), so the survivors would wait for the lost one
        inside its formation until the run's timeout. A replacement's loss is not this:
        the run it was to join goes on."""
        if not slot.member.startswith("r") or self.members:
            return False
        beats = (self.progress_dir / heartbeat_name(s.member) for s in self._slots)
        return not any(beat.exists() for beat in beats)

    def _nothing_trained(self, slot: _Slot) -> bool:
        """A first worker lost before any worker here began a step or entered a collective
        of the model (their progress records): nothing has trained, so the group restarts,
        as its survivors ask (train/live.py: restart_if_lost). Decided here, not left to
        their mark: under load they said so after this launcher had started a replacement."""
        if not slot.member.startswith("r") or self.members:
            return False
        records = [read_record(record_path(self.progress_dir, s.worker.rank)) for s in self._slots]
        return all(r is not None and r.step == 0 and r.collectives == 0 for r in records)

    def _final_status(self, last: int) -> int:
        """0 when any worker finished the run; else the last failure's exit code."""
        codes = [s.worker.exit_status() for s in self._slots]
        if any(code == 0 for code in codes) or last == 0:
            return 0
        return last if last > 0 else 128 - last

    def _fence_if_stalled(self, slot: _Slot) -> None:
        # Exiting first: its heartbeat may go on (a thread) while an exit handler hangs.
        self._fence_if_hung_at_exit(slot)
        beat = self.progress_dir / heartbeat_name(slot.member)
        try:
            age = time.time() - beat.stat().st_mtime
        except FileNotFoundError:  # not started yet: its first beat comes with its group
            return
        if age > self.stall_s and slot.fenced_after_s is None:
            slot.fenced_after_s = age
            self.say(
                f"rank {slot.worker.rank} ({slot.member}) has not beaten for {age:.1f} s "
                f"(--live-stall-timeout {self.stall_s:g}); fencing it off (SIGKILL)"
            )
            signal_group(slot.worker.pid, signal.SIGKILL)

    def _fence_if_hung_at_exit(self, slot: _Slot) -> None:
        """A worker hung in its exit (launch/exitwatch.py): fenced, and no loss when the run
        had finished."""
        if slot.fenced_after_s is not None:
            return
        who = f"rank {slot.worker.rank} ({slot.member})"
        age = fence_hung_exit(slot.worker, who, self.progress_dir, self.exit_timeout_s, self.say)
        if age is not None:
            slot.fenced_after_s, slot.hung_at_exit = age, True

    def _run_finished(self) -> bool:
        """The members said training ended (FINISHED_KEY): nothing is lost with a worker."""
        try:
            with self.connect() as client:
                return LiveStore(client, self.key).read(FINISHED_KEY) is not None
        except (OSError, RuntimeError):  # the store gone: go on as for any loss
            return False

    def _lost(self, slot: _Slot, code: int) -> int:
        """Report `slot`'s member lost, start its replacement if one is left; its exit code."""
        why = describe_returncode(code)
        if slot.fenced_after_s is not None:
            why = "hung at exit, fenced" if slot.hung_at_exit else "fenced"
        self._losses.append((slot, code, why))
        lost = f"rank {slot.worker.rank} ({slot.member}) lost ({why})"
        try:
            with self.connect() as client:
                store = LiveStore(client, self.key)
                report_lost(store, slot.member, why)
                if self.replacements <= 0:
                    self.say(f"{lost}; no replacement left (--max-restarts), {self._who_goes_on()}")
                    return code
                self.replacements -= 1
                member = _next_member(store)
        except StoreLost:  # said once already, by the launcher's lease keeper
            self.say(f"{lost}; the job's store (etcd) has lost its quorum, no replacement")
            return code
        except OSError as exc:
            unreachable = f"the job's store cannot be reached ({exc})"
            self.say(f"{lost}, and {unreachable}; no replacement")
            return code
        self.say(f"{lost}; {self._who_goes_on()}, replacement {member} starting")
        worker = self.respawn(slot.worker.local_rank, member)
        self.group.workers.append(worker)
        self._slots.append(_Slot(worker, member))
        self._publish_members()
        return code

    def _who_goes_on(self) -> str:
        """'the others go on' only while there are others on this node to go on."""
        # Not `done` alone: a worker that exited in the same sweep is not marked yet.
        if any(not slot.done and slot.worker.exit_status() is None for slot in self._slots):
            return "the others go on"
        if self.node_rank is not None:
            return "no worker of this node is left running"
        return "no other worker is left running"

    def summary(self) -> str | None:
        """Once every worker of this node has exited and none finished the run: each loss,
        then who failed first and the end of its stderr, as the launcher reports a failure
        without live recovery. None otherwise (the run went on, or a signal stopped it)."""
        if not self._losses or not all(slot.done for slot in self._slots):
            return None
        if any(slot.worker.exit_status() == 0 for slot in self._slots):
            return None
        each = "; ".join(
            f"{slot.member} (rank {slot.worker.rank}): {why}" for slot, _code, why in self._losses
        )
        first, code, _why = self._losses[0]
        where = " of this node" if self.node_rank is not None else ""
        return f"no worker{where} is left running: every one failed ({each})\n" + failure_summary(
            first.worker, code, self.node_rank or 0
        )

    def _publish_members(self) -> None:
        if self.node_rank is None:
            return
        running = [slot.member for slot in self._slots if not slot.done]
        with self.connect() as client:
            LiveStore(client, self.key).put(
                node_key(self.node_rank, "members"), json.dumps(running)
            )


def _end_generation_of(store: LiveStore, member: str, why: str) -> None:
    """Abort the current generation if `member` is in it (the survivors may have formed
    the next one without it already: then nothing is left to end). Values that are not
    the run's read as absent (logged once): the survivors then learn of the loss from
    their next collective, or leave `member` out after the settle time."""
    generation = store.read_int(GENERATION_KEY) or 0
    if generation == 0:
        members_now = member.startswith("r")
    else:
        members = store.read_json(members_key(generation))
        members_now = isinstance(members, list) and member in members
    if members_now:
        store.end_generation(generation, "launcher", f"{member} lost ({why})")
