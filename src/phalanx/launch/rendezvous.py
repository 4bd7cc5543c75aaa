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
from phalanx.ground.storeclient import ATTEMPT_KEY, NotAStoreError, StoreClient

_FIRST_BACKOFF_S = 0.2
_MAX_BACKOFF_S = 5.0
_CANCEL_POLL_S = 0.1
_ATTEMPT_KEY_WAIT_S = 2.0


@dataclass
class _Attempt:
    """What the last try to reach the store saw, for the message when time runs out."""

    seen: str = "connection refused"


def _try_store(host: str, port: int, timeout_s: float, note: _Attempt) -> StoreClient | None:
    """A validated client, or None (and `note` says why); raises on a foreign answer."""
    try:
        return StoreClient(host, port, timeout_s)
    except NotAStoreError as exc:
        raise MasterUnreachableError(
            f"something other than a torch store answers at {host}:{port} ({exc}) — check "
            "--master-addr and --master-port (or --rdzv-endpoint): they must name the store "
            "of node 0's launcher"
        ) from exc
    except TimeoutError:
        note.seen = "it accepted the connection but did not answer the store handshake"
    except OSError as exc:
        note.seen = exc.strerror or str(exc)
    return None


def _sleep_unless(cancelled: Callable[[], bool], seconds: float) -> None:
    """Sleep in short slices so a Ctrl-C during a long backoff is honoured at once."""
    end = time.monotonic() + seconds
    while not cancelled() and (left := end - time.monotonic()) > 0:
        time.sleep(min(left, _CANCEL_POLL_S))


def _serves_attempt(client: StoreClient, attempt: int) -> bool:
    # The helper sets the key just after its store starts answering: give it a moment.
    ready = client.wait_for([ATTEMPT_KEY], _ATTEMPT_KEY_WAIT_S)
    return ready and client.get(ATTEMPT_KEY) == str(attempt).encode()


def wait_for_store(
    host: str,
    port: int,
    attempt: int,
    timeout_s: float,
    announce: Callable[[str], None],
    cancelled: Callable[[], bool] = lambda: False,
    read_timeout_s: float = 60.0,
) -> StoreClient | None:
    """A client of the master's store once it serves `attempt`; None when `cancelled()`.

    Raises `MasterUnreachableError` after `timeout_s`, or at once when the
    port is answered by something that is not a torch store. The backoff
    keeps a node that starts long before the master from hammering it.
    """
    deadline = time.monotonic() + timeout_s
    backoff, announced, note = _FIRST_BACKOFF_S, False, _Attempt()
    while not cancelled():
        left = deadline - time.monotonic()
        client = _try_store(host, port, max(0.1, min(left, read_timeout_s)), note)
        if client is not None:
            if _serves_attempt(client, attempt):
                return client
            note.seen = f"its store does not serve attempt {attempt} yet"
            client.close()
        left = deadline - time.monotonic()
        if left <= 0:
            raise MasterUnreachableError(
                f"cannot reach the master at {host}:{port} after {timeout_s:g}s ({note.seen}) "
                "— check --master-addr, the port and the firewall, that node 0 is running, "
                "and that every node has the same --max-restarts"
            )
        if not announced:
            announce(f"waiting for the master's store at {host}:{port} (up to {timeout_s:g}s)")
            announced = True
        _sleep_unless(cancelled, min(backoff, left))
        backoff = min(backoff * 2, _MAX_BACKOFF_S)
    return None


def claim_node_rank(client: StoreClient, node_rank: int) -> None:
    """Static rendezvous: make sure no other launcher was given the same --node-rank."""
    host = socket.gethostname()
    if client.add(f"phalanx/node_rank/{node_rank}", 1) > 1:
        raise ConfigurationError(
            f"--node-rank {node_rank} is already taken by another node's launcher — give "
            "each node its own --node-rank"
        )
    client.set(f"phalanx/node_rank/{node_rank}/host", host.encode())


def join_nodes(
    client: StoreClient,
    run_id: str,
    nnodes: int,
    timeout_s: float,
    cancelled: Callable[[], bool] = lambda: False,
) -> int:
    """c10d rendezvous for a node that does not host the store: its node rank, 1..nnodes-1.

    The host is node 0; the others are numbered in the order they join, as
    torchrun numbers them. Returns once all `nnodes` have joined.
    """
    prefix = f"phalanx/rdzv/{run_id}"
    order = client.add(f"{prefix}/joined", 1)
    if order >= nnodes:
        raise ConfigurationError(
            f"more than --nnodes {nnodes} launchers joined rendezvous {run_id!r} — start "
            f"{nnodes} nodes, or give this job its own --rdzv-id"
        )
    client.set(f"{prefix}/node/{order}", socket.gethostname().encode())
    wait_for_joiners(client, run_id, nnodes, timeout_s, cancelled)
    return order


def wait_for_joiners(
    client: StoreClient,
    run_id: str,
    nnodes: int,
    timeout_s: float,
    cancelled: Callable[[], bool] = lambda: False,
) -> None:
    """c10d rendezvous: wait until nodes 1..nnodes-1 have joined (node 0 hosts), or until
    `cancelled()` (the caller then sees its own stop request)."""
    prefix = f"phalanx/rdzv/{run_id}"
    keys = [f"{prefix}/node/{r}" for r in range(1, nnodes)]
    if not client.wait_for(keys, timeout_s, cancelled) and not cancelled():
        raise MasterUnreachableError(
            f"only {client.add(f'{prefix}/joined', 0) + 1} of {nnodes} nodes joined "
            f"rendezvous {run_id!r} within {timeout_s:g}s — start the missing nodes with "
            "the same --rdzv-endpoint and --rdzv-id, or raise --rdzv-conf join_timeout"
        )
