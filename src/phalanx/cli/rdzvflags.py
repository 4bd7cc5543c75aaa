"""torchrun's rendezvous flags (--rdzv-backend, --rdzv-endpoint, --rdzv-conf, --standalone,
--master-*, --node-rank) turned into where the store is and who hosts it.

- One node: whatever the backend, the store is this launcher's, on loopback
  (or the given master address), on the given port or a free one. So the
  tutorials' `--rdzv-backend=c10d --rdzv-endpoint=localhost:0` is --standalone.
- static across nodes: node 0 hosts the store at --master-addr:--master-port.
- c10d across nodes without --node-rank: the launcher on the endpoint's host
  hosts it and is node 0; the others get node ranks in the order they join.
- etcd: the store is an etcd cluster (--rdzv-endpoint lists its members), on one
  node or many; no launcher hosts it, so none is a single point of failure.
  Without --node-rank the nodes get ranks 0.. in the order they join.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace

from phalanx.errors import ConfigurationError
from phalanx.ground.etcd import parse_endpoints
from phalanx.ground.netif import is_local_address
from phalanx.launch.config import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_JOIN_TIMEOUT_S,
    DEFAULT_MULTINODE_PORT,
    DEFAULT_REPORT_S,
    REPORT_ENV,
    Rendezvous,
)

__all__ = ["DEFAULT_C10D_PORT", "StoreSite", "parse_rdzv_conf", "store_site"]

# torchrun's default port for a c10d endpoint given without one.
DEFAULT_C10D_PORT = 29400
_TIMEOUT_KEYS = ("timeout", "join_timeout", "read_timeout", "connect_timeout")
# Keys of torchrun's elastic (changing-membership) rendezvous; a fixed-size job has no use
# for them, so they are accepted and said to do nothing.
_ELASTIC_KEYS = (
    "last_call_timeout",
    "close_timeout",
    "heartbeat",
    "keep_alive_interval",
    "keep_alive_max_attempt",
)
_TRUE, _FALSE = ("1", "true", "yes", "y"), ("0", "false", "no", "n")
# Kubernetes sets it in every container of an Indexed Job's pod (JobSet's jobs are Indexed).
COMPLETION_INDEX = "JOB_COMPLETION_INDEX"


@dataclass(frozen=True)
class StoreSite:
    """Where the job's store is, who hosts it, and how nodes get their ranks."""

    master_addr: str
    master_port: int
    node_rank: int
    rdzv: Rendezvous
    rdzv_timeout_s: float
    notes: tuple[str, ...] = ()


def parse_rdzv_conf(text: str | None) -> dict[str, str]:
    """`key=value,key2=value2`, keys checked against torchrun's."""
    conf: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in (*_TIMEOUT_KEYS, "is_host", *_ELASTIC_KEYS):
            raise ConfigurationError(
                f"--rdzv-conf {item.strip()!r} is not a known KEY=VALUE — use timeout, "
                "join_timeout, read_timeout, connect_timeout or is_host, e.g. --rdzv-conf "
                "join_timeout=900"
            )
        conf[key] = value.strip()
    return conf


def _seconds(conf: dict[str, str], key: str, default: float) -> float:
    if key not in conf:
        return default
    try:
        value = float(conf[key])
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ConfigurationError(
            f"--rdzv-conf {key}={conf[key]!r} is not a positive number of seconds — e.g. 600"
        )
    return value


def _report_s() -> float:
    """REPORT_ENV: how often a wait for another node speaks (the tests shorten it)."""
    text = os.environ.get(REPORT_ENV, "").strip()
    if not text:
        return DEFAULT_REPORT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigurationError(
            f"{REPORT_ENV}={text!r} is not a positive number of seconds "
            f"— unset it (the default is {DEFAULT_REPORT_S:g})"
        )
    return value


def _is_host(conf: dict[str, str]) -> bool | None:
    if "is_host" not in conf:
        return None
    value = conf["is_host"].lower()
    if value not in _TRUE + _FALSE:
        raise ConfigurationError(f"--rdzv-conf is_host={conf['is_host']!r} — use true or false")
    return value in _TRUE


def split_endpoint(endpoint: str) -> tuple[str, int | None]:
    """HOST[:PORT]; IPv6 as [::1]:PORT."""
    host, colon, port = endpoint.rpartition(":")
    if not colon or (host.count(":") and not host.endswith("]")):
        return endpoint.strip("[]"), None
    if not port.isdigit():
        raise ConfigurationError(
            f"--rdzv-endpoint {endpoint!r} is not HOST[:PORT] — e.g. 10.0.0.1:29500"
        )
    return host.strip("[]"), int(port)


def _backend(ns: argparse.Namespace) -> str:
    backend = str(ns.rdzv_backend).strip().lower()
    if backend not in ("static", "c10d", "etcd"):
        raise ConfigurationError(
            f"--rdzv-backend {ns.rdzv_backend} is not one phalanx speaks — use c10d (the "
            "launcher on the endpoint's host serves the store), static, or etcd (the store in "
            "an etcd cluster: --rdzv-endpoint h1:2379,h2:2379,h3:2379)"
        )
    return backend


def _conf(
    ns: argparse.Namespace, conf: dict[str, str]
) -> tuple[Rendezvous, float, tuple[str, ...]]:
    """--rdzv-conf's timeouts and --rdzv-timeout; the notes for the keys that do nothing."""
    rdzv = Rendezvous(
        join_timeout_s=_seconds(conf, "join_timeout", DEFAULT_JOIN_TIMEOUT_S),
        read_timeout_s=_seconds(conf, "read_timeout", Rendezvous().read_timeout_s),
        connect_timeout_s=_seconds(conf, "connect_timeout", DEFAULT_CONNECT_TIMEOUT_S),
        report_s=_report_s(),
    )
    notes = tuple(
        f"--rdzv-conf {key} has no effect: phalanx runs a fixed number of nodes"
        for key in _ELASTIC_KEYS
        if key in conf
    )
    return rdzv, _seconds(conf, "timeout", ns.rdzv_timeout), notes


def store_site(ns: argparse.Namespace, nnodes: int) -> StoreSite:
    """Every rendezvous flag, checked together; one clear line for each mistake."""
    backend = _backend(ns)
    conf = parse_rdzv_conf(ns.rdzv_conf)
    rdzv, rdzv_timeout, notes = _conf(ns, conf)
    if backend == "etcd":
        return _etcd_site(ns, rdzv, rdzv_timeout, notes)
    addr, port, port_flag = _address(ns, backend)
    if ns.standalone or nnodes == 1:
        if ns.standalone and nnodes != 1:
            raise ConfigurationError("--standalone is for one node — drop it or --nnodes")
        if ns.standalone or backend == "c10d":
            addr = "127.0.0.1"
        site_rdzv = replace(rdzv, port_flag=port_flag)
        return StoreSite(addr or "127.0.0.1", port or 0, 0, site_rdzv, rdzv_timeout, notes)
    if not addr:
        flag = "--rdzv-endpoint" if backend == "c10d" else "--master-addr"
        raise ConfigurationError(
            f"--nnodes {nnodes} needs {flag} — pass the store's host (node 0's address) on "
            "every node"
        )
    if backend == "c10d" and ns.node_rank is None:
        forced = _is_host(conf)
        hosts = _same_host(addr, ns.local_addr) if forced is None else forced
        return StoreSite(
            addr,
            DEFAULT_C10D_PORT if port is None else port,
            0,
            replace(
                rdzv,
                assign_node_rank=True,
                hosts_store=hosts,
                host_forced=forced is not None,
                port_flag=port_flag,
            ),
            rdzv_timeout,
            notes,
        )
    node_rank, note = _static_node_rank(ns.node_rank)
    return StoreSite(
        addr,
        DEFAULT_MULTINODE_PORT if port is None else port,
        node_rank,
        replace(rdzv, hosts_store=node_rank == 0, port_flag=port_flag),
        rdzv_timeout,
        notes + note,
    )


def _etcd_site(
    ns: argparse.Namespace, rdzv: Rendezvous, rdzv_timeout: float, notes: tuple[str, ...]
) -> StoreSite:
    """--rdzv-backend etcd: the members from --rdzv-endpoint; MASTER_ADDR/PORT name the first
    (what the workers' interface choice routes towards; no worker dials it as a store)."""
    if not ns.rdzv_endpoint:
        raise ConfigurationError(
            "--rdzv-backend etcd needs --rdzv-endpoint, the etcd members: e.g. "
            "--rdzv-endpoint h1:2379,h2:2379,h3:2379"
        )
    if ns.standalone:
        raise ConfigurationError("--standalone hosts its own store — drop it or --rdzv-backend")
    members = parse_endpoints(ns.rdzv_endpoint)
    host, port = split_endpoint(members[0])
    node_rank, note = (0, ()) if ns.node_rank is None else _static_node_rank(ns.node_rank)
    site_rdzv = replace(
        rdzv, etcd=members, hosts_store=False, assign_node_rank=ns.node_rank is None
    )
    return StoreSite(host, port or 2379, node_rank, site_rdzv, rdzv_timeout, notes + note)


def _static_node_rank(given: int | None) -> tuple[int, tuple[str, ...]]:
    """--node-rank (or PET_NODE_RANK); else, in a pod of a Kubernetes Indexed Job (a
    JobSet's, one pod per node), its completion index; else 0, as before."""
    if given is not None:
        return given, ()
    index = os.environ.get(COMPLETION_INDEX, "").strip()
    if not index:
        return 0, ()
    if not index.isdigit():
        raise ConfigurationError(
            f"{COMPLETION_INDEX}={index!r} is not a node rank — pass --node-rank"
        )
    return int(index), (
        f"node rank {index} from {COMPLETION_INDEX} (this pod's index in its Indexed Job, "
        "as JobSet gives it; --node-rank wins)",
    )


def _address(ns: argparse.Namespace, backend: str) -> tuple[str | None, int | None, str]:
    """The store's host and port from --master-* (static) and --rdzv-endpoint."""
    addr, port = ns.master_addr, ns.master_port
    port_flag = "--master-port"
    if ns.rdzv_endpoint:
        host, endpoint_port = split_endpoint(ns.rdzv_endpoint)
        if backend == "c10d" or addr is None:
            addr = host
        if endpoint_port is not None and (backend == "c10d" or port is None):
            port, port_flag = endpoint_port, "--rdzv-endpoint port"
    return addr, port, port_flag


def _same_host(endpoint_host: str, local_addr: str | None) -> bool:
    """c10d: does this launcher host the store? Yes when the endpoint is one of its own
    addresses (or --local-addr, when given, is the endpoint)."""
    return local_addr == endpoint_host or is_local_address(endpoint_host)
