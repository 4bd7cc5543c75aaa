"""--rdzv-backend etcd: the launchers meet in an etcd cluster instead of node 0's TCPStore.

With the c10d store, node 0's launcher hosts the job's store: lose that host and
every other node loses its store with it. Here the store is etcd, replicated by
Raft over its members (ground/etcd.py), and no launcher hosts anything, so the
nodes are alike: each claims its node rank (or takes the next one, in the order
they join, without --node-rank), each calls the roll at the start of an attempt,
and under --live-recovery each watches all the others (launch/livenodes.py).

The keys of run RUN live under `phalanx/RUN/`: the run's lease, then one prefix
per attempt (`a<n>/`), which is what a fresh TCPStore per attempt is elsewhere;
the workers' c10d store is a view of their attempt's prefix (runtime/etcdstore.py).
Every key is written under the run's lease, one for all the launchers (the first
grants it, the others find it), which each of them keeps alive: the keys outlive
any launcher, and go TTL seconds after the last one is gone, or at once when every
node has left at the end.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable

from phalanx.errors import ConfigurationError, RendezvousError, StoreLost
from phalanx.ground.etcd import (
    ENDPOINTS_ENV,
    LEASE_ENV,
    PREFIX_ENV,
    TIMEOUT_ENV,
    Etcd,
    EtcdKV,
)
from phalanx.ground.store_keys import ETCD_LEASE, etcd_base
from phalanx.launch.rollcall import Pacer, node_list

__all__ = ["EtcdMeeting"]

LEASE_TTL_S = 30
"""How long the run's keys outlive the last launcher that kept them."""
_POLL_S = 0.05


class EtcdMeeting:
    """One launcher's connection to the run's keys in etcd (module docstring)."""

    def __init__(
        self,
        endpoints: tuple[str, ...],
        run_id: str,
        read_timeout_s: float,
        say: Callable[[str], None],
    ) -> None:
        self.endpoints = endpoints
        self.base = etcd_base(run_id)
        self.read_timeout_s = read_timeout_s
        self._say = say
        self.etcd = Etcd(endpoints, read_timeout_s)
        self.lease = self._shared_lease()
        self.lost: StoreLost | None = None
        """Set when the keep-alive found etcd without a quorum for --rdzv-conf read_timeout."""
        self._stopped = threading.Event()
        self._keeper = threading.Thread(target=self._keep, name="phalanx-etcd-lease", daemon=True)
        self._keeper.start()

    def _shared_lease(self) -> int:
        """The run's lease: granted by the first launcher, found by the others."""
        while True:
            lease, _ttl = self.etcd.grant(LEASE_TTL_S)
            kv = EtcdKV(self.etcd, self.base, lease)
            held = int(kv.compare_set(ETCD_LEASE, b"", b"%d" % lease))
            if held == lease:
                return lease
            self.etcd.revoke(lease)
            if self.etcd.keepalive(held) > 0:
                return held
            # That lease expired just now (its launchers are gone): its key goes with it.

    def _keep(self) -> None:
        while not self._stopped.wait(LEASE_TTL_S / 6):
            try:
                if self.etcd.keepalive(self.lease) <= 0:
                    self._say(
                        f"the run's lease in etcd expired (no launcher renewed it for "
                        f"{LEASE_TTL_S}s): its keys are gone"
                    )
                    return
            except StoreLost as exc:
                self.lost = exc
                self._say(str(exc))
                return
            except (OSError, RuntimeError) as exc:
                self._say(f"could not renew the run's lease in etcd ({exc}); trying again")

    def view(self, attempt: int) -> EtcdKV:
        """Attempt `attempt`'s keys (what its own TCPStore holds under the c10d backend)."""
        return EtcdKV(self.etcd, f"{self.base}a{attempt}/", self.lease)

    def connector(self, attempt: int) -> Callable[[], EtcdKV]:
        return lambda: self.view(attempt)

    def worker_env(self, attempt: int) -> dict[str, str]:
        """What a worker's `phalanx.init()` builds its store from (runtime/etcdstore.py)."""
        return {
            ENDPOINTS_ENV: ",".join(self.endpoints),
            PREFIX_ENV: f"{self.base}a{attempt}/",
            LEASE_ENV: str(self.lease),
            TIMEOUT_ENV: f"{self.read_timeout_s:g}",
        }

    def where(self) -> str:
        return f"etcd {','.join(self.endpoints)}"

    def join(
        self, run_id: str, nnodes: int, timeout_s: float, cancelled: Callable[[], bool], pace: Pacer
    ) -> int:
        """No --node-rank: this node's rank, 0..nnodes-1, in the order the launchers join;
        returns once all have."""
        with self.view(0) as kv:
            order = kv.add("rdzv/joined", 1) - 1
            if order >= nnodes:
                raise ConfigurationError(
                    f"more than --nnodes {nnodes} launchers joined rendezvous {run_id!r} in "
                    f"{self.where()} — start {nnodes} nodes, or give this job its own --rdzv-id"
                )
            kv.set(f"rdzv/node/{order}", socket.gethostname().encode())
            keys = [f"rdzv/node/{r}" for r in range(nnodes)]
            deadline = time.monotonic() + timeout_s
            while not kv.check(keys) and not cancelled():
                if time.monotonic() >= deadline:
                    raise RendezvousError(
                        f"only {kv.add('rdzv/joined', 0)} of {nnodes} nodes joined rendezvous "
                        f"{run_id!r} in {self.where()} within {timeout_s:g}s — start the missing "
                        "ones with the same --rdzv-endpoint and --rdzv-id, or raise --rdzv-conf "
                        "join_timeout"
                    )
                if (waited := pace.due()) is not None:
                    pace.say(
                        f"rendezvous {run_id!r}: {kv.add('rdzv/joined', 0)} of {nnodes} nodes "
                        f"joined after {waited:.1f}s — start the others with the same "
                        "--rdzv-endpoint, --rdzv-id and --nnodes"
                    )
                time.sleep(_POLL_S)
        return order

    def roll_call(
        self,
        attempt: int,
        node_rank: int,
        nnodes: int,
        timeout_s: float,
        cancelled: Callable[[], bool],
        pace: Pacer,
    ) -> bool:
        """Every node is here for `attempt` before any starts a worker (launch/rollcall.py,
        with no host: each says it is here and waits for all); False when cancelled."""
        present = "present/"
        with self.view(attempt) as kv:
            kv.set(f"{present}{node_rank}", socket.gethostname().encode())
            kv.add(f"{present}count", 1)
            deadline = time.monotonic() + timeout_s
            while kv.add(f"{present}count", 0) < nnodes:
                missing = [r for r in range(nnodes) if not kv.check([f"{present}{r}"])]
                if cancelled():
                    return False
                if time.monotonic() >= deadline:
                    raise RendezvousError(
                        f"{node_list(missing)} of {nnodes} never reached {self.where()} within "
                        f"--rdzv-timeout {timeout_s:g}s, so no worker was started — start them "
                        "with the same --rdzv-endpoint, --rdzv-id and --nnodes"
                    )
                if (waited := pace.due()) is not None:
                    pace.say(
                        f"waiting for {node_list(missing)} of {nnodes} to reach "
                        f"{self.where()}: {waited:.1f}s so far (up to --rdzv-timeout "
                        f"{timeout_s:g}s)"
                    )
                time.sleep(_POLL_S)
        return True

    def leave(self, nnodes: int) -> None:
        """The last attempt is over here: the last node to leave lets the run's keys go."""
        with contextlib.suppress(RuntimeError, OSError), self.view(0) as kv:
            if kv.add("left", 1) >= nnodes:
                self.etcd.revoke(self.lease)

    def close(self) -> None:
        self._stopped.set()
        self._keeper.join(timeout=5)
        self.etcd.close()
