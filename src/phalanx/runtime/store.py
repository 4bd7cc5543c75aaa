"""The rendezvous store: where the ranks first meet, and what to say when they do not.

Under `phalanx launch` and torchrun the launcher hosts the store and every rank,
rank 0 included, joins it as a client. Under srun, mpirun or a hand-set
environment rank 0 hosts it at MASTER_ADDR:MASTER_PORT; a world of one keeps
its store in memory. Each way this can fail (a misspelt address, a taken port,
two processes given RANK=0, a missing rank, an unreachable master) gets a
message that names the address and what to check, instead of torch's bare
"DistNetworkError" after the whole timeout.

A rank 0 that hosts the store for ranks that all run on its own host, with a
loopback master, listens on loopback only (torch alone would listen on every
interface, IPv4 and IPv6, where anyone on the network can use the store).
"""

from __future__ import annotations

import errno
import os
import socket
import time
from datetime import timedelta

import torch.distributed as dist

from phalanx.errors import ConfigurationError, RendezvousError
from phalanx.ground.jobenv import LaunchInfo
from phalanx.ground.netif import is_loopback
from phalanx.ground.ports import NotThisHost, PortInUse, bind_own_address, leads_back_here
from phalanx.ground.store_keys import OWNER_KEY, joined_key
from phalanx.ground.storeclient import StoreClient
from phalanx.runtime.etcdstore import etcd_store_from_env

__all__ = ["make_store"]

# Who hosts this job's store ("pid P on HOST"), set by rank 0 as soon as it listens, so that
# a second process given RANK=0 can say who has it; and one key per rank that joined.
_OWNER_WAIT_S = 3.0
# How long rank 0 tries a MASTER_ADDR that is not its own, to see whether it is forwarded here.
_FORWARD_PROBE_S = 3.0
_POLL_S = 0.05


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _check_resolves(info: LaunchInfo) -> None:
    """A misspelt MASTER_ADDR fails at once instead of after the whole timeout."""
    assert info.master_addr is not None
    try:
        socket.getaddrinfo(info.master_addr, info.master_port)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigurationError(
            f"MASTER_ADDR={info.master_addr!r} does not resolve ({exc}) — set it to the "
            "hostname or IP address of the node that runs rank 0"
        ) from exc


def _check_own_address(info: LaunchInfo) -> None:
    """Rank 0 hosts the store at MASTER_ADDR, so it must be an address of this host (the
    launcher's own check, phalanx.ground.ports), or one forwarded to it: said at once, where
    torch's store would listen on every interface, dial the foreign address as its own
    first client, and fail only when that times out (61 s, blamed on the client)."""
    assert info.master_addr is not None and info.master_port is not None
    try:
        bind_own_address(info.master_addr, 0).close()  # port 0: the address alone is asked
    except PortInUse:  # not with port 0; the real port's owner is found by _host
        pass
    except NotThisHost as exc:
        if leads_back_here(info.master_addr, info.master_port, _FORWARD_PROBE_S):
            return  # a NAT rule or a Kubernetes Service forwards it here
        resolved = ", ".join(exc.resolved)
        shown = info.master_addr + ("" if resolved == info.master_addr else f" ({resolved})")
        raise ConfigurationError(
            f"MASTER_ADDR={shown} is not an address of this host ({exc.reason}), but this "
            "process is rank 0, which hosts the store there — set MASTER_ADDR on every rank "
            "to the address of the host that runs rank 0"
        ) from exc


def _where(info: LaunchInfo) -> str:
    return f"{info.master_addr}:{info.master_port}"


def _port_taken(info: LaunchInfo) -> str:
    """Rank 0 cannot listen: another process given RANK=0, or another job on the port."""
    owner = _store_owner(info)
    if owner is not None:
        return (
            f"rank 0 could not listen on {_where(info)}: this job's store is already hosted "
            f"there by another process given RANK=0 ({owner}) — give each process its own "
            f"RANK, 0..{info.world_size - 1}"
        )
    return (
        f"rank 0 could not listen on {_where(info)}: the port is taken — another job is "
        "using it; export MASTER_PORT=<a free port> on every rank"
    )


def _store_owner(info: LaunchInfo) -> str | None:
    """Who hosts the store on our port, if it is a phalanx rank 0 of a job this size."""
    assert info.master_addr is not None and info.master_port is not None
    try:
        with StoreClient(info.master_addr, info.master_port, _OWNER_WAIT_S) as client:
            if client.wait_for([OWNER_KEY], _OWNER_WAIT_S):
                owner = client.get(OWNER_KEY).decode(errors="replace")
                size, _, who = owner.partition(" ")
                return who if size == str(info.world_size) else None
    except OSError:  # not a store, or not answering: another program has the port
        pass
    return None


def _client_failure(info: LaunchInfo, wait: timedelta, exc: Exception) -> str:
    return (
        f"rank {info.rank} could not reach the master (rank 0) at {_where(info)} within "
        f"{wait.total_seconds():g}s ({exc}) — check that rank 0 is running, that "
        "MASTER_ADDR/MASTER_PORT are the same on every rank and name rank 0's host, and "
        "that no firewall blocks that port"
    )


def _loopback_listener(info: LaunchInfo) -> socket.socket | None:
    """A socket on the loopback master address when every rank runs on this host; None
    (torch then listens on every interface) when other hosts must reach the store."""
    assert info.master_addr is not None and info.master_port is not None
    if info.local_world_size < info.world_size or not is_loopback(info.master_addr):
        return None
    family, kind, proto, _name, sockaddr = socket.getaddrinfo(
        info.master_addr, info.master_port, type=socket.SOCK_STREAM
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise RendezvousError(_port_taken(info)) from exc
        raise
    return sock


def _host(info: LaunchInfo, wait: timedelta) -> dist.Store:
    """Rank 0 hosts the store, says so, and waits for every other rank to join it."""
    assert info.master_addr is not None and info.master_port is not None
    listener = _loopback_listener(info)
    try:
        store = dist.TCPStore(
            info.master_addr,
            info.master_port,
            info.world_size,
            True,
            timeout=wait,
            wait_for_workers=False,
            master_listen_fd=None if listener is None else listener.detach(),
        )
    except (RuntimeError, OSError) as exc:  # DistNetworkError / DistStoreError
        if "in use" in str(exc).lower():
            raise RendezvousError(_port_taken(info)) from exc
        raise RendezvousError(f"rank 0 could not host the store at {_where(info)} ({exc})") from exc
    store.set(OWNER_KEY, f"{info.world_size} pid {os.getpid()} on {socket.gethostname()}")
    _wait_for_ranks(store, info, wait)
    return store


def _wait_for_ranks(store: dist.Store, info: LaunchInfo, wait: timedelta) -> None:
    """Like TCPStore's own wait for workers, but the error names the ranks that never came,
    and a rank that joined with another world size at once."""
    deadline = time.monotonic() + wait.total_seconds()
    missing = list(range(1, info.world_size))
    while missing:
        joined = [r for r in missing if store.check([joined_key(r)])]
        for r in joined:
            _raise_if_other_world(info, r, store.get(joined_key(r)).decode())
        missing = [r for r in missing if r not in joined]
        if missing and time.monotonic() >= deadline:
            shown = ", ".join(str(r) for r in missing[:20]) + (" ..." if len(missing) > 20 else "")
            who = f"rank {shown}" if len(missing) == 1 else f"ranks {shown}"
            raise RendezvousError(
                f"rank 0 waited {wait.total_seconds():g}s at {_where(info)} for the other "
                f"{_plural(info.world_size - 1, 'rank')}; {who} never came — check that every "
                "rank was started "
                f"({info.launcher} launcher) with the same MASTER_ADDR, MASTER_PORT and world "
                f"size {info.world_size}"
            )
        if missing:
            time.sleep(_POLL_S)


def make_store(info: LaunchInfo, wait: timedelta) -> dist.Store:
    """The rendezvous store: etcd when the launcher names it (--rdzv-backend etcd), in memory
    for a world of one, else TCP on the master."""
    etcd = etcd_store_from_env(os.environ, wait)
    if etcd is not None:
        return etcd
    if info.master_addr is None or info.master_port is None:
        return dist.HashStore()
    _check_resolves(info)
    # Under phalanx launch and torchrun the launcher hosts the store; rank 0 joins it.
    if info.rank == 0 and not info.agent_store:
        _check_own_address(info)
        return _host(info, wait)
    try:
        store = dist.TCPStore(
            info.master_addr, info.master_port, info.world_size, False, timeout=wait
        )
    except (RuntimeError, OSError) as exc:  # DistNetworkError / DistStoreError
        raise RendezvousError(_client_failure(info, wait, exc)) from exc
    store.set(joined_key(info.rank), str(info.world_size))
    if not info.agent_store:  # rank 0 hosts the store and wrote its world size there
        owner = store.get(OWNER_KEY).decode(errors="replace")
        _raise_if_other_world(info, 0, owner.partition(" ")[0])
    return store


def _raise_if_other_world(info: LaunchInfo, rank: int, their_size: str) -> None:
    """A hand-set environment where the ranks disagree on WORLD_SIZE: said at once, by
    both sides, instead of a failed connection blamed on the network interface."""
    if their_size != str(info.world_size):
        raise ConfigurationError(
            f"the ranks disagree on WORLD_SIZE: rank {info.rank} was started with "
            f"WORLD_SIZE={info.world_size}, rank {rank} with WORLD_SIZE={their_size} — "
            "export the same WORLD_SIZE on every rank"
        )
