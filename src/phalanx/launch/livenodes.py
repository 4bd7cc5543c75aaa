"""--live-recovery across hosts: the launchers' side. A host can vanish with its launcher
(torn down, powered off), and a new host can take its node rank while the run goes on.

No launcher is left to report such a host's workers lost, so the launchers report
themselves: every launcher but the store's host bumps a counter in the job's store
(`NodeBeat`), and the store's host (`NodeWatch`) declares a node lost when its
counter stops moving for --live-stall-timeout. The survivors' own rule is
unchanged (they leave out a member that neither checked in nor was reported lost
after the settle time, runtime/membership.py); the watch is what lets the host say
which node went, leave without waiting for it at the end, and let a new launcher
take the node's place: a launcher whose --node-rank is already claimed
(`claim_live_node`) waits for that node to be declared lost, takes it over
(counted, so that two cannot), and starts its workers as replacements.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from phalanx.errors import ConfigurationError
from phalanx.ground.live_store import LiveStore, StoreConn
from phalanx.ground.runauth import RunKey
from phalanx.ground.store_keys import node_key, node_rank_key
from phalanx.launch.live import Connect, report_lost, tcp_store
from phalanx.launch.rendezvous import claim_node_rank

__all__ = ["NodeBeat", "NodeWatch", "claim_live_node"]

BEAT_S = 0.5
"""How often a launcher bumps its node's counter."""
_STORE_TIMEOUT_S = 10.0
_POLL_S = 0.1


def claim_live_node(
    client: StoreConn,
    node_rank: int,
    key: RunKey,
    timeout_s: float,
    announce: Callable[[str], None],
    cancelled: Callable[[], bool],
) -> bool:
    """Claim `node_rank` as at the start (False), or take over a lost node (True, a late
    join); a node still running keeps its rank: a one-line error after `timeout_s`."""
    if client.add(node_rank_key(node_rank), 0) == 0:
        claim_node_rank(client, node_rank)
        return False
    announce(
        f"node {node_rank} is already in the run; waiting until its host is lost, to take "
        f"its place (up to {timeout_s:g}s)"
    )
    store = LiveStore(client, key)
    nonce = secrets.token_hex(8)
    deadline = time.monotonic() + timeout_s
    while not cancelled():
        losses = store.read_int(node_key(node_rank, "lost")) or 0
        # Each loss is taken over once: by the launcher whose claim holds its key.
        if losses and store.claimed(node_key(node_rank, f"taken/{losses}"), nonce):
            return True
        if time.monotonic() > deadline:
            raise ConfigurationError(
                f"--node-rank {node_rank} is taken by a node that is still running — give this "
                "launcher the rank of a node that is gone, or stop that node first"
            )
        time.sleep(_POLL_S)
    return False


def _connector(store: tuple[str, int] | Connect) -> Connect:
    """A TCPStore's address (a launcher hosts it), or how to connect to the store (etcd)."""
    return tcp_store(store) if isinstance(store, tuple) else store


class _Loop:
    """A daemon thread that calls `tick` with its own store client every `period_s` until
    stopped; a store that is away (between two attempts) is dialled again at the next tick,
    and one that answers nothing (etcd without a quorum) is asked again at the next."""

    def __init__(
        self,
        store: tuple[str, int] | Connect,
        period_s: float,
        name: str,
        tick: Callable[[StoreConn], object],
    ) -> None:
        self._connect, self._period_s, self._tick = _connector(store), period_s, tick
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=_STORE_TIMEOUT_S)

    def _run(self) -> None:
        client: StoreConn | None = None
        while not self._stopped.wait(self._period_s):
            try:
                client = client or self._connect()
                self._tick(client)
            except (OSError, RuntimeError):  # RuntimeError: etcd's StoreLost, or a refusal
                if client is not None:
                    client.close()
                client = None
        if client is not None:
            client.close()


class NodeBeat:
    """A non-host launcher's sign of life: its node's count, raised every BEAT_S (signed, so
    no one outside the run can keep a lost node looking alive)."""

    def __init__(self, addr: tuple[str, int] | Connect, node_rank: int, key: RunKey) -> None:
        self._key, self._name, self._count = key, node_key(node_rank, "beat"), 0
        self._launcher = secrets.token_hex(4)
        """This launcher among the node's (a new host that takes the node over has another)."""
        self._loop = _Loop(addr, BEAT_S, "phalanx-node-beat", self._beat)

    def _beat(self, client: StoreConn) -> None:
        self._count += 1
        LiveStore(client, self._key).put(self._name, f"{self._launcher}:{self._count}")

    def stop(self) -> None:
        self._loop.stop()


@dataclass
class _Seen:
    launcher: str = ""
    count: int = -1
    changed_at: float = 0.0
    lost: bool = False

    def moved(self, beat: str | None) -> bool:
        """Whether `beat` ("<launcher>:<count>") is newer: a higher count from the same
        launcher, or another launcher's (a value replayed from before is neither)."""
        launcher, _, count = (beat or "").partition(":")
        if not launcher or not count.isdigit():
            return False
        if launcher == self.launcher and int(count) <= self.count:
            return False
        self.launcher, self.count = launcher, int(count)
        return True


class NodeWatch:
    """The store host's watch over the other nodes' launchers (module docstring). Under
    --rdzv-backend etcd no launcher hosts the store: each watches all the others (`ranks`),
    and what they write of a loss is the same whoever writes it."""

    def __init__(
        self,
        addr: tuple[str, int] | Connect,
        nnodes: int,
        stall_s: float,
        say: Callable[[str], None],
        key: RunKey,
        ranks: Sequence[int] | None = None,
    ) -> None:
        self._key = key
        self._stall_s = stall_s
        self._say = say
        watched = range(1, nnodes) if ranks is None else ranks
        self._seen = {rank: _Seen() for rank in watched}
        self._last_tick = time.monotonic()
        self.losses: list[int] = []
        """The node ranks declared lost, in order (a node lost twice appears twice)."""
        self._loop = _Loop(addr, _POLL_S, "phalanx-node-watch", self.tick)

    def stop(self) -> None:
        self._loop.stop()

    def alive(self) -> int:
        """How many other nodes' launchers are running (seen and not lost)."""
        return sum(1 for seen in self._seen.values() if seen.count > 0 and not seen.lost)

    def tick(self, client: StoreConn) -> None:
        now = time.monotonic()
        store = LiveStore(client, self._key)
        if now - self._last_tick > self._stall_s / 2:
            # This watch was blind for a while (the store failed over: an etcd member lost,
            # a leader elected), and the beats were held up as long: no node is blamed for it.
            for seen in self._seen.values():
                seen.changed_at = max(seen.changed_at, now)
        self._last_tick = now
        for rank, seen in self._seen.items():
            if seen.moved(store.read(node_key(rank, "beat"))):
                if seen.lost:
                    self._say(
                        f"node {rank} is back: a new launcher took its place; its workers "
                        "join the run as replacements"
                    )
                seen.changed_at, seen.lost = now, False
            elif seen.count > 0 and not seen.lost and now - seen.changed_at > self._stall_s:
                members = self._report_workers(store, rank)
                self.losses.append(rank)
                store.put(node_key(rank, "lost"), str(self.losses.count(rank)))
                self._say(
                    f"node {rank} lost: its launcher has not been heard from for "
                    f"{now - seen.changed_at:.1f} s (--live-stall-timeout {self._stall_s:g}); "
                    f"the others go on without its workers ({', '.join(members) or 'none'}) — "
                    f"start `phalanx launch` with --node-rank {rank} on a new host to bring the "
                    "run back to full size"
                )
                seen.lost = True  # last: alive() drops once all of the above is done

    @staticmethod
    def _report_workers(store: LiveStore, rank: int) -> list[str]:
        """Report the lost node's members lost, as its own launcher would have."""
        listed = store.read_json(node_key(rank, "members"))
        members = [m for m in listed if isinstance(m, str)] if isinstance(listed, list) else []
        for member in members:
            report_lost(store, member, f"its host, node {rank}, was lost")
        return members

    def report(self) -> str | None:
        """The summary line for the run's end, when a node was lost."""
        if not self.losses:
            return None
        nodes = ", ".join(str(rank) for rank in self.losses)
        back = [rank for rank in self._seen if self._seen[rank].lost]
        ending = (
            f"node {', '.join(map(str, back))} still missing at the end"
            if back
            else "every lost node was taken over by a new host"
        )
        return f"nodes lost during the run: {nodes} ({ending})"
