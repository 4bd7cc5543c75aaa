"""This node's side of the rendezvous: host the job's store or find it, get a node rank,
and start each attempt only once the store serves it.

The launcher that hosts the store (node 0 under static rendezvous; the one on
the endpoint's host under c10d, which then is node 0) binds it at once, so a
master address that is not this host's fails before anything starts. Every
other launcher proves it reached that store before it spawns a worker. Under
--live-recovery the launchers also watch each other (launch/livenodes.py): a
host that vanishes is declared lost instead of holding up the others' exit, and a
launcher arriving for its node rank while the run goes on joins it late.
Under --rdzv-backend etcd no launcher hosts the store (launch/etcdmeet.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace

from phalanx.errors import PortTakenError, RendezvousError
from phalanx.ground.live_store import StoreConn
from phalanx.ground.store_keys import LEFT_KEY
from phalanx.ground.storeclient import StoreClient
from phalanx.launch.config import LaunchConfig
from phalanx.launch.etcdmeet import EtcdMeeting
from phalanx.launch.live import Connect, tcp_store
from phalanx.launch.livenodes import NodeBeat, NodeWatch, claim_live_node
from phalanx.launch.rendezvous import (
    claim_node_rank,
    join_nodes,
    wait_for_joiners,
    wait_for_store,
)
from phalanx.launch.rollcall import Pacer, RollCall, await_all_here, await_nodes, mark_present
from phalanx.launch.storehost import StoreHost, bind_store_socket

__all__ = ["Meeting"]

# torchrun's exit barrier timeout: how long the host keeps the store for the other nodes.
_EXIT_BARRIER_S = 300.0


class Meeting:
    """The store and the rendezvous of one launcher, for the whole run."""

    def __init__(
        self,
        config: LaunchConfig,
        announce: Callable[[str], None],
        cancelled: Callable[[], bool],
    ) -> None:
        self.config = config
        self.port = config.master_port
        self._announce = announce
        self._cancelled = cancelled
        self._store: StoreHost | None = None
        self._ready_attempt = -1  # the attempt whose store is already known to be up
        self.late = False
        """--live-recovery: this launcher took over a lost node while the run went on, so
        its workers join as replacements (launch/livenodes.py)."""
        self._beat: NodeBeat | None = None
        self._watch: NodeWatch | None = None
        self._etcd: EtcdMeeting | None = None
        self._attempt = 0
        self._hint = (
            "start its launcher with the same --rdzv-endpoint, --rdzv-id and --nnodes"
            if config.rdzv.assign_node_rank
            else "start its launcher with its --node-rank and the same --nnodes, --master-addr "
            "and --master-port, and check that it can reach this address"
        )

    def open(self) -> LaunchConfig:
        """Host or reach the store and learn this node's rank: the config the workers get."""
        cfg = self.config
        if cfg.rdzv.etcd:
            return self._open_etcd()
        if cfg.rdzv.hosts_store:
            try:
                hosted = self._host()
                self._watch_nodes()
                return hosted
            except PortTakenError:
                if not cfg.rdzv.assign_node_rank or cfg.rdzv.host_forced:
                    raise
                # Another launcher on this host hosts the c10d store: join it, as torchrun does.
                cfg = self.config = replace(cfg, rdzv=replace(cfg.rdzv, hosts_store=False))
        client = self._reach_store(0)
        if client is None:
            return cfg
        with client:
            self._ready_attempt = 0
            if not cfg.rdzv.assign_node_rank:
                self._claim(client)
                self._beat_for(cfg.node_rank)
                return cfg
            node_rank = join_nodes(
                client,
                cfg.run_id,
                cfg.nnodes,
                cfg.rdzv.join_timeout_s,
                self._cancelled,
                self._pacer(),
            )
        self._announce(f"rendezvous {cfg.run_id!r}: this is node {node_rank} of {cfg.nnodes}")
        self._beat_for(node_rank)
        return _with_node_rank(cfg, node_rank)

    def _open_etcd(self) -> LaunchConfig:
        """--rdzv-backend etcd: every node alike; none hosts the store."""
        cfg = self.config
        etcd = self._etcd = EtcdMeeting(
            cfg.rdzv.etcd, cfg.run_id, cfg.rdzv.read_timeout_s, self._announce
        )
        if cfg.rdzv.assign_node_rank:
            node_rank = etcd.join(
                cfg.run_id, cfg.nnodes, cfg.rdzv.join_timeout_s, self._cancelled, self._pacer()
            )
            self._announce(
                f"rendezvous {cfg.run_id!r} in {etcd.where()}: this is node {node_rank} of "
                f"{cfg.nnodes}"
            )
            cfg = self.config = _with_node_rank(cfg, node_rank)
        else:
            with etcd.view(0) as kv:
                self._claim(kv)
        if cfg.live is not None and cfg.nnodes > 1:
            self._beat = NodeBeat(self._live_connect, cfg.node_rank, cfg.live_key())
            others = [r for r in range(cfg.nnodes) if r != cfg.node_rank]
            watch = NodeWatch(
                self._live_connect,
                cfg.nnodes,
                cfg.live.stall_s,
                self._announce,
                cfg.live_key(),
                ranks=others,
            )
            self._watch = watch
        return cfg

    def _live_connect(self) -> StoreConn:
        """The current attempt's store, for the loops that outlive an attempt."""
        return self.connector(self._attempt)()

    def connector(self, attempt: int) -> Connect:
        """New connections to `attempt`'s store: etcd's view, or the hosted TCPStore."""
        if self._etcd is not None:
            return self._etcd.connector(attempt)
        return tcp_store((self.config.master_addr, self.port))

    def worker_env(self, attempt: int) -> dict[str, str]:
        """What the workers of `attempt` need to reach their store, beyond MASTER_*."""
        return {} if self._etcd is None else self._etcd.worker_env(attempt)

    def _pacer(self) -> Pacer:
        return Pacer(self.config.rdzv.report_s, self._announce)

    def _claim(self, client: StoreConn) -> None:
        cfg = self.config
        if cfg.live is None:
            claim_node_rank(client, cfg.node_rank)
            return
        self.late = claim_live_node(
            client,
            cfg.node_rank,
            cfg.live_key(),
            cfg.rdzv_timeout_s,
            self._announce,
            self._cancelled,
        )
        if self.late:
            self._announce(
                f"taking the place of lost node {cfg.node_rank}: the run is under "
                "way, its workers join it as replacements"
            )

    def _beat_for(self, node_rank: int) -> None:
        """--live-recovery across nodes: tell the store's host this launcher still runs."""
        if self.config.live is not None and self.config.nnodes > 1:
            addr = (self.config.master_addr, self.port)
            self._beat = NodeBeat(addr, node_rank, self.config.live_key())

    def _watch_nodes(self) -> None:
        """--live-recovery across nodes, on the store's host: notice a node that vanishes."""
        cfg = self.config
        if cfg.live is not None and cfg.nnodes > 1 and self._store is not None:
            addr = (self._store.address, self.port)
            self._watch = NodeWatch(
                addr, cfg.nnodes, cfg.live.stall_s, self._announce, cfg.live_key()
            )

    def _host(self) -> LaunchConfig:
        cfg = self.config
        sock = bind_store_socket(
            cfg.local_addr or cfg.master_addr,
            cfg.master_port,
            cfg.rdzv.port_flag,
            free_hint=cfg.nnodes == 1,
        )
        self._store = StoreHost(sock)
        self.port = self._store.port
        if cfg.nnodes > 1 and cfg.rdzv.assign_node_rank:
            self._gather_nodes()
        return _with_node_rank(cfg, 0) if cfg.rdzv.assign_node_rank else cfg

    def _gather_nodes(self) -> None:
        """c10d host: serve attempt 0 now and wait until every node has joined."""
        assert self._store is not None
        self._store.open_attempt(0)
        self._ready_attempt = 0
        cfg = self.config
        self._announce(
            f"rendezvous {cfg.run_id!r}: hosting at {self._store.address}:{self.port}, "
            f"waiting for {cfg.nnodes - 1} more node{'s' if cfg.nnodes > 2 else ''}"
        )
        with StoreClient(self._store.address, self.port, cfg.rdzv.read_timeout_s) as client:
            wait_for_joiners(
                client,
                cfg.run_id,
                cfg.nnodes,
                cfg.rdzv.join_timeout_s,
                self._cancelled,
                self._pacer(),
            )

    def begin_attempt(self, attempt: int) -> bool:
        """Serve (host) or wait for (others) the store of `attempt`, then wait until every
        node is here (launch/rollcall.py); False when cancelled."""
        self._attempt = attempt
        if self._etcd is None and not self._serve_or_reach(attempt):
            return False
        if self.config.nnodes == 1 or (self.late and attempt == 0):
            return True  # a late node joins a run under way: the others are long past this
        if self._etcd is not None:
            cfg = self.config
            call = (cfg.node_rank, cfg.nnodes, cfg.rdzv_timeout_s)
            return self._etcd.roll_call(attempt, *call, self._cancelled, self._pacer())
        return self._roll_call(attempt)

    def _serve_or_reach(self, attempt: int) -> bool:
        if self._store is not None:
            if attempt != self._ready_attempt:
                self._store.open_attempt(attempt)
            return True
        if attempt == self._ready_attempt:
            return True
        client = self._reach_store(attempt)
        if client is None:
            return False
        client.close()
        return True

    def _roll_call(self, attempt: int) -> bool:
        cfg = self.config
        hosting = self._store is not None
        host = self._store.address if self._store is not None else cfg.master_addr
        call = RollCall(
            nnodes=cfg.nnodes,
            store=f"{host}:{self.port}",
            attempt=attempt,
            timeout_s=cfg.rdzv_timeout_s,
            report_s=cfg.rdzv.report_s,
            hint=self._hint,
            say=self._announce,
            cancelled=self._cancelled,
        )
        try:
            client = StoreClient(host, self.port, cfg.rdzv.read_timeout_s)
        except OSError as exc:
            why = (
                "this launcher's own store stopped serving (a bug: please report it)"
                if hosting
                else "node 0's launcher gave up or was stopped: its output says why"
            )
            raise RendezvousError(
                f"the store at {call.store} does not answer ({exc}) — {why}"
            ) from exc
        with client:
            if hosting:
                return await_nodes(client, call)
            mark_present(client, cfg.node_rank)
            return await_all_here(client, call, cfg.node_rank)

    def _reach_store(self, attempt: int) -> StoreClient | None:
        """A client of the host's store once it serves `attempt`; None when cancelled."""
        cfg = self.config
        return wait_for_store(
            cfg.master_addr,
            self.port,
            attempt,
            cfg.rdzv_timeout_s,
            self._announce,
            self._cancelled,
            cfg.rdzv,
        )

    def end_attempt(self, last: bool, succeeded: bool) -> None:
        """The attempt's workers are gone: its store goes too (each attempt starts clean).

        After the `last` attempt the nodes leave together: every other node says
        it is done, and a host whose own workers succeeded keeps its store up
        until they all have (torchrun's exit barrier), for workers that still use
        the store as they shut down. A host whose workers failed does not wait:
        a node that died with them would hold it up for the whole barrier.
        """
        self._ready_attempt = -1
        if last and self._etcd is not None:
            self._stop_loops()  # before the last to leave lets the run's keys go
            if self._watch is not None and (report := self._watch.report()) is not None:
                self._announce(report)
            self._etcd.leave(self.config.nnodes)
            return
        if last and self.config.nnodes > 1 and (self._store is None or succeeded):
            self._leave_together()
        if last and self._watch is not None and (report := self._watch.report()) is not None:
            self._announce(report)
        if self._store is not None:
            self._store.close_attempt()

    def _leave_together(self) -> None:
        cfg = self.config
        with contextlib.suppress(OSError):
            if self._store is None:
                with StoreClient(cfg.master_addr, self.port, cfg.rdzv.read_timeout_s) as client:
                    client.add(LEFT_KEY, 1)
                return
            # Under --live-recovery only the nodes still running: a lost one never leaves.
            others = cfg.nnodes - 1 if self._watch is None else self._watch.alive
            with StoreClient(self._store.address, self.port, cfg.rdzv.read_timeout_s) as client:
                if not client.wait_for_count(LEFT_KEY, others, _EXIT_BARRIER_S, self._cancelled):
                    self._announce(
                        f"closing the store although only {client.add(LEFT_KEY, 0)} of "
                        f"{cfg.nnodes - 1} other nodes finished within {_EXIT_BARRIER_S:g}s"
                    )

    def _stop_loops(self) -> None:
        for loop in (self._beat, self._watch):
            if loop is not None:
                loop.stop()

    def close(self) -> None:
        self._stop_loops()
        self._beat = self._watch = None
        if self._etcd is not None:
            self._etcd.close()
            self._etcd = None
        if self._store is not None:
            with contextlib.suppress(OSError):
                self._store.close()
            self._store = None


def _with_node_rank(config: LaunchConfig, node_rank: int) -> LaunchConfig:
    """`config` once the rendezvous assigned this node its rank."""
    return replace(config, node_rank=node_rank, rdzv=replace(config.rdzv, assign_node_rank=False))
