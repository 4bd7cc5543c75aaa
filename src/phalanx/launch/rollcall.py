"""Every node is here before any worker starts: the roll call at the start of each attempt,
and the lines that keep a wait for another host from being silent.

A static job whose node 1 never came used to start node 0's workers at once; they
sat in their rendezvous for the whole init timeout (30 minutes) without a word and
then blamed the network interface. Now each launcher other than the store's host
says it is here in the attempt's store (`present/<node rank>`); the store's host
waits until every node is, says every `report_s` which nodes it still waits for, and
gives up after --rdzv-timeout with one line that names them. Once all are here it
says so in the store (ALL_HERE_KEY), and the other launchers, who wait for that,
start their workers too; the host starts its own once each has seen it, since a
worker of its that failed at once would end the attempt, and close its store,
before a slower node had looked. Each attempt's store is new, so a restart calls the roll
again: a node whose launcher ran out of restarts is named, not waited for in silence.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from phalanx.errors import RendezvousError
from phalanx.ground.store_keys import ALL_HERE_KEY, PRESENT, PRESENT_COUNT, PRESENT_SEEN, SEEN
from phalanx.ground.storeclient import StoreClient

__all__ = [
    "Pacer",
    "RollCall",
    "await_all_here",
    "await_nodes",
    "mark_present",
    "node_list",
]

_POLL_S = 0.05


class Pacer:
    """Says how a long wait goes every `period_s`, so a wait for another host is never
    silent for longer than that."""

    def __init__(self, period_s: float, say: Callable[[str], None]) -> None:
        self._period_s = period_s
        self.say = say
        self._start = time.monotonic()
        self._next = self._start + period_s
        self.spoke = False
        """Whether a line was said: the end of the wait is then worth a line too."""

    @property
    def waited_s(self) -> float:
        return time.monotonic() - self._start

    def due(self) -> float | None:
        """The seconds waited when a line is due now (the next one is then a period away),
        else None. The caller says the line, through `say`."""
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + self._period_s
        self.spoke = True
        return now - self._start


def node_list(ranks: list[int]) -> str:
    """'node 1' or 'nodes 1, 3'."""
    return f"node{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


@dataclass(frozen=True)
class RollCall:
    """One attempt's roll call, as one launcher sees it."""

    nnodes: int
    store: str
    """The store's address, HOST:PORT, for the messages."""
    attempt: int
    timeout_s: float
    """--rdzv-timeout: how long the nodes have to arrive."""
    report_s: float
    hint: str
    """How to start a missing node (the flags differ between static and c10d)."""
    say: Callable[[str], None]
    cancelled: Callable[[], bool]

    def missing(self, client: StoreClient, stage: str = "") -> list[int]:
        """The node ranks (1..nnodes-1; node 0 hosts the store) not here yet (`stage`
        SEEN: that have not yet seen that all are)."""
        keys = {r: f"{PRESENT}{r}{stage}" for r in range(1, self.nnodes)}
        return [r for r, key in keys.items() if not client.check([key])]

    def waiting_line(self, missing: list[int], waited_s: float) -> str:
        of = f"of {self.nnodes}" + (f" at restart {self.attempt}" if self.attempt else "")
        return (
            f"waiting for {node_list(missing)} {of} to reach the store at {self.store}: "
            f"{waited_s:.1f}s so far, no worker starts before every node is here (up to "
            f"--rdzv-timeout {self.timeout_s:g}s) — {self.hint}"
        )

    def never_came(self, missing: list[int]) -> str:
        at = f" for restart {self.attempt}" if self.attempt else ""
        return (
            f"{node_list(missing)} of {self.nnodes} never reached the store at {self.store}"
            f"{at} within --rdzv-timeout {self.timeout_s:g}s, so no worker was started — "
            f"{self.hint}" + (", and give every node the same --max-restarts" if at else "")
        )


def mark_present(client: StoreClient, node_rank: int) -> None:
    """A launcher other than the store's host: this node is here for the attempt."""
    client.set(f"{PRESENT}{node_rank}", socket.gethostname().encode())
    client.add(PRESENT_COUNT, 1)


def await_nodes(client: StoreClient, call: RollCall) -> bool:
    """The store's host: wait until every other node is here, tell them all, and wait until
    each has seen it (else a worker that fails at once could end the attempt, and its
    store, before a slower node looked); False when cancelled. Raises `RendezvousError`
    naming the missing nodes after `call.timeout_s`."""
    if not _wait(client, call, lambda: client.add(PRESENT_COUNT, 0) >= call.nnodes - 1):
        return False
    client.set(ALL_HERE_KEY, b"1")

    def everyone_saw() -> bool:
        return client.add(PRESENT_SEEN, 0) >= call.nnodes - 1

    return _wait(client, call, everyone_saw, SEEN)


def await_all_here(client: StoreClient, call: RollCall, node_rank: int) -> bool:
    """Any other launcher: wait until the store's host says every node is here; False when
    cancelled. Raises `RendezvousError` after `call.timeout_s`, or when the store goes
    away first (its host gave up waiting: it says for whom)."""
    try:
        if not _wait(client, call, lambda: client.check([ALL_HERE_KEY])):
            return False
        client.set(f"{PRESENT}{node_rank}{SEEN}", b"1")
        client.add(PRESENT_SEEN, 1)
        return True
    except OSError as exc:
        raise RendezvousError(
            f"the store at {call.store} went away while this node waited for the others "
            f"({exc}) — node 0's launcher gave up or was stopped: its output says why"
        ) from exc


def _wait(client: StoreClient, call: RollCall, done: Callable[[], bool], stage: str = "") -> bool:
    """Poll `done` with a line every `call.report_s` naming the nodes not yet at `stage`;
    False when cancelled."""
    pacer = Pacer(call.report_s, call.say)
    deadline = time.monotonic() + call.timeout_s
    while not done():
        if call.cancelled():
            return False
        if time.monotonic() >= deadline:
            raise RendezvousError(call.never_came(call.missing(client, stage)))
        if (waited := pacer.due()) is not None:
            call.say(call.waiting_line(call.missing(client, stage), waited))
        time.sleep(_POLL_S)
    if pacer.spoke and not stage:
        call.say(f"all {call.nnodes} nodes are here after {pacer.waited_s:.1f}s")
    return True
