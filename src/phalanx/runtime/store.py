"""The rendezvous store: where the ranks first meet, and what to say when they do not.

Rank 0 serves a TCP store at MASTER_ADDR:MASTER_PORT and every other rank
connects to it; a world of one keeps its store in memory. Each way this can
fail (a misspelt address, a taken port, a missing rank, an unreachable
master) gets a message that names the address and what to check, instead of
torch's bare "DistNetworkError" after the whole timeout.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

from phalanx.errors import ConfigurationError, RendezvousError
from phalanx.jobenv import LaunchInfo

__all__ = ["make_store"]


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


def _store_failure(info: LaunchInfo, hosts_store: bool, wait: timedelta, exc: Exception) -> str:
    """A message for a failed TCPStore that names the address and what to check."""
    where = f"{info.master_addr}:{info.master_port}"
    seconds = f"{wait.total_seconds():g}s"
    if hosts_store and "in use" in str(exc).lower():
        return (
            f"rank 0 could not listen on {where}: the port is taken — another job is using it; "
            "export MASTER_PORT=<a free port> on every rank"
        )
    if hosts_store:
        return (
            f"rank 0 waited {seconds} at {where} for the other {info.world_size - 1} ranks "
            f"and not all of them came ({exc}) — check that every rank was started "
            f"({info.launcher} launcher) with the same MASTER_ADDR, MASTER_PORT and "
            f"world size {info.world_size}"
        )
    return (
        f"rank {info.rank} could not reach the master (rank 0) at {where} within {seconds} "
        f"({exc}) — check that rank 0 is running, that MASTER_ADDR/MASTER_PORT are the same "
        "on every rank and name rank 0's host, and that no firewall blocks that port"
    )


def make_store(info: LaunchInfo, wait: timedelta) -> dist.Store:
    """The rendezvous store: in memory for a world of one, else TCP on the master."""
    if info.master_addr is None or info.master_port is None:
        return dist.HashStore()
    _check_resolves(info)
    # Under torchrun the agent already serves the store on MASTER_PORT; rank 0 joins it.
    hosts_store = info.rank == 0 and not info.agent_store
    try:
        return dist.TCPStore(
            info.master_addr,
            info.master_port,
            info.world_size,
            hosts_store,
            timeout=wait,
            wait_for_workers=True,
        )
    except (RuntimeError, OSError) as exc:  # DistNetworkError / DistStoreError
        raise RendezvousError(_store_failure(info, hosts_store, wait, exc)) from exc
