"""How a launcher finds the job's store, and how node ranks are handed out through it.

The store is hosted by one launcher (`storehost`): node 0 under static
rendezvous, the launcher on the endpoint's host under c10d. Every other
launcher waits until the store answers the store handshake for the attempt
it is about to start (`wait_for_store`): an open port is not enough, since a
port answered by another program would only fail later, in every worker, as a
C++ stack trace per retry. With `--rdzv-backend c10d` and no `--node-rank`,
node ranks are then assigned in the order the launchers join, as torchrun does.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from phalanx.errors import ConfigurationError, MasterUnreachableError
from phalanx.ground.live_store import StoreConn
from phalanx.ground.store_keys import ATTEMPT_KEY, node_rank_key, rendezvous_prefix
from phalanx.ground.storeclient import NotAStoreError, StoreClient, Unreachable
from phalanx.launch.config import Rendezvous
from phalanx.launch.rollcall import Pacer

_FIRST_BACKOFF_S = 0.2
_MAX_BACKOFF_S = 5.0
_CANCEL_POLL_S = 0.1
_ATTEMPT_KEY_WAIT_S = 2.0
_JOIN_POLL_S = 0.05


@dataclass
class _Attempt:
    """What the tries to reach the store saw, for the message when time runs out."""

    seen: str = "connection refused"
    answered: bool = False
    """The host answered once (a refusal counts): it is there, its launcher maybe not yet."""


def _try_store(
    host: str, port: int, timeout_s: float, connect_s: float, note: _Attempt
) -> StoreClient | None:
    """A validated client, or None (and `note` says why); raises on a foreign answer."""
    try:
        return StoreClient(host, port, timeout_s, connect_s)
    except NotAStoreError as exc:
        raise MasterUnreachableError(
            f"something other than a torch store answers at {host}:{port} ({exc}) — check "
            "--master-addr and --master-port (or --rdzv-endpoint): they must name the store "
            "of node 0's launcher"
        ) from exc
    except Unreachable as exc:
        note.seen = exc.kind
        return None
    except TimeoutError:
        note.seen = "it accepted the connection but did not answer the store handshake"
    except OSError as exc:
        # Refused or reset; or a name that does not resolve yet (a Kubernetes pod's DNS name
        # comes with the pod): waited for up to --rdzv-timeout, as a host that is there.
        note.seen = exc.strerror or str(exc)
    note.answered = True
    return None


def _sleep_unless(cancelled: Callable[[], bool], seconds: float) -> None:
    """Sleep in short slices so a Ctrl-C during a long backoff is honoured at once."""
    end = time.monotonic() + seconds
    while not cancelled() and (left := end - time.monotonic()) > 0:
        time.sleep(min(left, _CANCEL_POLL_S))


def _serves_attempt(client: StoreClient, attempt: int) -> bool:
    # The host's store holds the key from its first answer; a store that lacks it is
    # not (yet) an attempt's.
    ready = client.wait_for([ATTEMPT_KEY], _ATTEMPT_KEY_WAIT_S)
    return ready and client.get(ATTEMPT_KEY) == str(attempt).encode()


def _gave_up(
    host: str, port: int, note: _Attempt, waited_s: float, timeout_s: float, rdzv: Rendezvous
) -> MasterUnreachableError | None:
    """The error that ends the wait now, if any: a host that never answered at all after
    the connect timeout, or anything at all after the rendezvous timeout."""
    if not note.answered and waited_s >= rdzv.connect_timeout_s:
        return MasterUnreachableError(
            f"the master address {host}:{port} is unreachable from this host ({note.seen}, "
            f"for {waited_s:.0f}s: --rdzv-conf connect_timeout) — check --master-addr (node "
            f"0's address as this host sees it), this host's routes (ip route get {host}) and "
            "the firewall between the hosts"
        )
    if waited_s >= timeout_s:
        return MasterUnreachableError(
            f"cannot reach the master at {host}:{port} after {timeout_s:g}s ({note.seen}) "
            "— check --master-addr, the port and the firewall, that node 0 is running, "
            "and that every node has the same --max-restarts"
        )
    return None


def wait_for_store(
    host: str,
    port: int,
    attempt: int,
    timeout_s: float,
    announce: Callable[[str], None],
    cancelled: Callable[[], bool] = lambda: False,
    rdzv: Rendezvous | None = None,
) -> StoreClient | None:
    """A client of the master's store once it serves `attempt`; None when `cancelled()`.

    A host that refuses the connection is there, its launcher maybe not yet: that
    is waited for up to `timeout_s`, with backoff, so a node that starts long before
    the master does not hammer it, and a line every `rdzv.report_s`. A host that
    never answered at all (no route, unreachable, the connection timed out) is
    `MasterUnreachableError` after `rdzv.connect_timeout_s`; so is a port answered
    by something that is not a torch store, at once.
    """
    rdzv = rdzv or Rendezvous()
    started = time.monotonic()
    backoff, note, pacer = _FIRST_BACKOFF_S, _Attempt(), Pacer(rdzv.report_s, announce)
    while not cancelled():
        left = started + timeout_s - time.monotonic()
        connect_s = max(0.1, min(left, rdzv.connect_timeout_s))
        client = _try_store(host, port, max(0.1, min(left, rdzv.read_timeout_s)), connect_s, note)
        if client is not None:
            if _serves_attempt(client, attempt):
                return client
            note.seen, note.answered = f"its store does not serve attempt {attempt} yet", True
            client.close()
        waited = time.monotonic() - started
        if (error := _gave_up(host, port, note, waited, timeout_s, rdzv)) is not None:
            raise error
        if backoff == _FIRST_BACKOFF_S:
            announce(f"waiting for the master's store at {host}:{port} (up to {timeout_s:g}s)")
        if (so_far := pacer.due()) is not None:
            announce(
                f"still waiting for the master's store at {host}:{port}: {so_far:.1f}s so far "
                f"({note.seen}), up to --rdzv-timeout {timeout_s:g}s — start node 0's "
                "launcher, or check --master-addr and --master-port"
            )
        _sleep_unless(cancelled, min(backoff, timeout_s - waited))
        backoff = min(backoff * 2, _MAX_BACKOFF_S)
    return None


def claim_node_rank(client: StoreConn, node_rank: int) -> None:
    """Static rendezvous: make sure no other launcher was given the same --node-rank."""
    host = socket.gethostname()
    if client.add(node_rank_key(node_rank), 1) > 1:
        raise ConfigurationError(
            f"--node-rank {node_rank} is already taken by another node's launcher — give "
            "each node its own --node-rank"
        )
    client.set(f"{node_rank_key(node_rank)}/host", host.encode())


def join_nodes(
    client: StoreClient,
    run_id: str,
    nnodes: int,
    timeout_s: float,
    cancelled: Callable[[], bool] = lambda: False,
    pacer: Pacer | None = None,
) -> int:
    """c10d rendezvous for a node that does not host the store: its node rank, 1..nnodes-1.

    The host is node 0; the others are numbered in the order they join, as
    torchrun numbers them. Returns once all `nnodes` have joined.
    """
    prefix = rendezvous_prefix(run_id)
    order = client.add(f"{prefix}/joined", 1)
    if order >= nnodes:
        raise ConfigurationError(
            f"more than --nnodes {nnodes} launchers joined rendezvous {run_id!r} — start "
            f"{nnodes} nodes, or give this job its own --rdzv-id"
        )
    client.set(f"{prefix}/node/{order}", socket.gethostname().encode())
    wait_for_joiners(client, run_id, nnodes, timeout_s, cancelled, pacer)
    return order


def wait_for_joiners(
    client: StoreClient,
    run_id: str,
    nnodes: int,
    timeout_s: float,
    cancelled: Callable[[], bool] = lambda: False,
    pacer: Pacer | None = None,
) -> None:
    """c10d rendezvous: wait until nodes 1..nnodes-1 have joined (node 0 hosts), or until
    `cancelled()` (the caller then sees its own stop request); `pacer` says every so often
    how many are still missing."""
    prefix = rendezvous_prefix(run_id)
    keys = [f"{prefix}/node/{r}" for r in range(1, nnodes)]
    deadline = time.monotonic() + timeout_s
    while not client.check(keys) and not cancelled():
        joined = client.add(f"{prefix}/joined", 0) + 1
        if time.monotonic() >= deadline:
            raise MasterUnreachableError(
                f"only {joined} of {nnodes} nodes joined rendezvous {run_id!r} within "
                f"{timeout_s:g}s — start the missing nodes with the same --rdzv-endpoint and "
                "--rdzv-id, or raise --rdzv-conf join_timeout"
            )
        if pacer is not None and (waited := pacer.due()) is not None:
            pacer.say(
                f"rendezvous {run_id!r}: {joined} of {nnodes} nodes joined after {waited:.1f}s; "
                f"waiting for {nnodes - joined} more (up to --rdzv-conf join_timeout "
                f"{timeout_s:g}s) — start them with the same --rdzv-endpoint, --rdzv-id and "
                "--nnodes"
            )
        time.sleep(_JOIN_POLL_S)
