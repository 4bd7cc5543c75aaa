"""`phalanx.init()`: find out who started us, then join the default process group.

One script runs unchanged under `phalanx launch`, torchrun, SLURM's `srun`,
Open MPI's `mpirun`, or plain `python`: each launcher describes the job in
its own environment variables, and `detect_launch` reads them into one
`LaunchInfo`. `init` turns that into a real process group (a world of one
gets a real single-rank group, so DDP code needs no special case) and a
`World` that says where this process stands. Nothing is cached here: the
`World` is derived from `torch.distributed`'s state and the environment on
every call, which is what makes `init` idempotent.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from phalanx import netif
from phalanx.errors import ConfigurationError, RendezvousError
from phalanx.jobenv import LaunchInfo, detect_launch, launched_by_launcher

__all__ = [
    "LaunchInfo",
    "RendezvousError",
    "World",
    "detect_launch",
    "init",
    "launched_by_launcher",
    "parse_timeout",
    "resolve_backend",
    "shutdown",
]

logger = logging.getLogger("phalanx")

DEFAULT_TIMEOUT_S = 1800.0
# How long the exit hook lets gloo's worker threads finish dropping their last
# collective (see `_release_at_exit`): ample for a thread that is already runnable.
_EXIT_GRACE_S = 0.05


@dataclass(frozen=True)
class World:
    """Where this process stands in the job, and the group that connects it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    device: torch.device
    """cuda:local_rank when the backend drives GPUs, else cpu."""
    backend: str
    process_group: dist.ProcessGroup
    """The default (WORLD) group; pass it on explicitly rather than relying on globals."""
    launcher: str
    """One of "env" (phalanx launch / torchrun), "slurm", "mpi", "none" (plain python)."""
    master_addr: str | None
    master_port: int | None

    @property
    def is_main(self) -> bool:
        """Rank 0: the one rank that writes checkpoints, logs and progress bars."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def parse_timeout(timeout: float | timedelta) -> timedelta:
    """Seconds (int/float) or a timedelta, as a positive timedelta."""
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise ConfigurationError(
            f"timeout={timeout!r} is not a number of seconds — pass e.g. timeout=1800 "
            "or timeout=datetime.timedelta(minutes=30)"
        )
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigurationError(
            f"timeout={timeout!r} must be a finite number of seconds > 0 — it bounds how "
            "long a collective may block before the job fails instead of hanging; "
            f"the default is {DEFAULT_TIMEOUT_S:.0f}"
        )
    return timedelta(seconds=seconds)


def _backend_available(name: str) -> bool:
    checker = getattr(dist, "is_backend_available", None)
    if checker is not None:  # torch >= 2.3 also knows backends registered by plugins
        return bool(checker(name))
    probe = getattr(dist, f"is_{name}_available", None)
    return bool(probe()) if probe is not None else False


def _available_backends() -> list[str]:
    """What to suggest: the usable backends, less torch's placeholders for tests."""
    hidden = ("undefined", "fake")
    return [b for b in dist.Backend.backend_list if b not in hidden and _backend_available(b)]


def _backend_names(backend: str) -> list[str]:
    """The backend names in "gloo" or in torch's per-device form "cpu:gloo,cuda:nccl"."""
    return [part.split(":")[-1].strip() for part in backend.split(",") if part.strip()]


def resolve_backend(backend: str | None, cuda_available: bool | None = None) -> str:
    """The backend to use: nccl on a machine with GPUs, gloo otherwise, or `backend` checked."""
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if backend is None:
        return "nccl" if cuda and _backend_available("nccl") else "gloo"
    chosen = backend.strip().lower()
    names = _backend_names(chosen)
    if not names:
        raise ConfigurationError(
            f"backend={backend!r} is empty — pass one of {_available_backends()} or None"
        )
    for name in names:
        if name == "nccl" and not cuda:
            raise ConfigurationError(
                "backend 'nccl' needs NVIDIA GPUs, but torch sees none on this machine — "
                "use backend='gloo' for CPU training (or leave backend unset to pick it)"
            )
        if name not in dist.Backend.backend_list:
            raise ConfigurationError(
                f"backend {name!r} is not one torch.distributed knows — "
                f"use one of {_available_backends()}"
            )
        if not _backend_available(name):
            raise ConfigurationError(
                f"backend {name!r} is not available in this torch build — "
                f"use one of {_available_backends()}"
            )
    return chosen


def _select_device(backend: str, local_rank: int) -> torch.device:
    """cuda:local_rank (or xpu) for backends that drive accelerators, else cpu."""
    names = _backend_names(backend)
    if "nccl" in names:
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            raise ConfigurationError(
                f"local rank {local_rank} has no GPU: only {visible} visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}) — "
                f"start at most {visible} processes per node (--nproc-per-node {visible})"
            )
        return torch.device("cuda", local_rank)
    if "xccl" in names and hasattr(torch, "xpu"):
        return torch.device("xpu", local_rank)
    return torch.device("cpu")


def _claim_device(device: torch.device) -> None:
    """Make `device` current, so collectives and `.cuda()` land on this rank's own GPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "xpu":
        torch.xpu.set_device(device)


def _pin_gloo_interface(backend: str, info: LaunchInfo) -> None:
    """Point gloo at the interface that routes to the master when the job spans hosts.

    Gloo otherwise advertises the address the hostname resolves to, which on
    many hosts is 127.0.0.1: peers on other hosts then dial their own loopback
    and fail with "Connection refused". A user-set value always wins.
    """
    if "gloo" not in _backend_names(backend) or info.master_addr is None:
        return
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    spans_hosts = info.world_size > info.local_world_size
    if not spans_hosts and netif.is_loopback(info.master_addr):
        return
    name = netif.route_interface(info.master_addr)
    if name is None:
        if spans_hosts:
            logger.warning(
                "rank %d: no network interface routes to MASTER_ADDR=%s although the job spans "
                "hosts; if peers fail to connect, export GLOO_SOCKET_IFNAME=<interface>",
                info.rank,
                info.master_addr,
            )
        return
    os.environ["GLOO_SOCKET_IFNAME"] = name
    logger.info(
        "rank %d: GLOO_SOCKET_IFNAME=%s (the interface that routes to MASTER_ADDR=%s); "
        "export GLOO_SOCKET_IFNAME to choose another",
        info.rank,
        name,
        info.master_addr,
    )


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


def _make_store(info: LaunchInfo, wait: timedelta) -> dist.Store:
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


def _join_group(backend: str, info: LaunchInfo, device: torch.device, wait: timedelta) -> None:
    store = _make_store(info, wait)
    try:
        dist.init_process_group(
            backend,
            store=store,
            rank=info.rank,
            world_size=info.world_size,
            timeout=wait,
            # Binds NCCL to this rank's GPU up front instead of guessing it at the first collective.
            device_id=device if device.type == "cuda" else None,
        )
    except (RuntimeError, OSError) as exc:
        raise RendezvousError(
            f"rank {info.rank} reached the master but could not connect to its peers ({exc}) "
            "— when hosts talk over a specific network, export GLOO_SOCKET_IFNAME (gloo) or "
            "NCCL_SOCKET_IFNAME (nccl) naming that interface on every rank"
        ) from exc


def _current_device(backend: str) -> torch.device:
    """The device this rank's collectives run on: the current GPU for nccl, else cpu.

    Read from torch's state rather than recomputed, so describing a group the
    user built by hand never fails and matches what `init` set up itself.
    """
    names = _backend_names(backend)
    if "nccl" in names and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if "xccl" in names and hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu", torch.xpu.current_device())
    return torch.device("cpu")


def _world_from_group(info: LaunchInfo) -> World:
    """Describe the existing default group, with node details from the launcher's env."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    backend = str(dist.get_backend())
    if (info.rank, info.world_size) != (rank, world_size):
        # The user built the group by hand with values the environment does not
        # describe: all we know is that the ranks are somewhere.
        info = LaunchInfo("none", rank, rank, world_size, world_size, 0, None, None)
    group = dist.group.WORLD
    assert group is not None  # dist.is_initialized() holds here
    return World(
        rank=rank,
        local_rank=info.local_rank,
        world_size=world_size,
        local_world_size=info.local_world_size,
        node_rank=info.node_rank,
        device=_current_device(backend),
        backend=backend,
        process_group=group,
        launcher=info.launcher,
        master_addr=info.master_addr,
        master_port=info.master_port,
    )


def init(backend: str | None = None, timeout: float | timedelta = DEFAULT_TIMEOUT_S) -> World:
    """Join (or describe) the default process group of the job that started us.

    `backend`: None picks nccl with GPUs, gloo without; any name torch accepts
    is checked against this build. `timeout` (seconds or timedelta) bounds the
    rendezvous and every collective, so a missing rank fails instead of hanging.
    Calling `init` again, or after your own `dist.init_process_group`, returns
    a `World` for the existing group.
    """
    wait = parse_timeout(timeout)
    info = detect_launch(os.environ)
    if dist.is_initialized():
        if backend is not None and backend.strip().lower() != str(dist.get_backend()):
            logger.warning(
                "init(backend=%r) ignored: the process group already exists with backend %r",
                backend,
                dist.get_backend(),
            )
        return _world_from_group(info)
    chosen = resolve_backend(backend)
    device = _select_device(chosen, info.local_rank)
    _claim_device(device)
    if info.world_size > 1:
        _pin_gloo_interface(chosen, info)
    _join_group(chosen, info, device, wait)
    atexit.unregister(_release_at_exit)  # once per process, however often we init
    atexit.register(_release_at_exit)
    world = _world_from_group(info)
    logger.info(
        "rank %d/%d: joined %s group (launcher=%s, node %d, device %s)",
        world.rank,
        world.world_size,
        world.backend,
        world.launcher,
        world.node_rank,
        world.device,
    )
    return world


def _release_at_exit() -> None:
    """Tear the group down while the interpreter is still whole.

    A gloo worker thread frees each finished collective, and with it a
    reference to a Python tensor, just after the caller's wait returns. If
    that happens once the interpreter is finalizing, taking the GIL kills the
    thread and the process aborts ("terminate called without an active
    exception", pytorch#190489) after a run that succeeded. Anything that still
    holds the group (a `World`, a DDP module) keeps those threads alive until
    then, so destroying the group is not enough: we also release the GIL for a
    moment so a pending free runs now rather than during finalization.
    """
    shutdown()
    time.sleep(_EXIT_GRACE_S)


def shutdown() -> None:
    """Destroy the default process group if there is one; calling it twice is fine."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
