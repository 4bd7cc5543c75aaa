"""`phalanx.init()`: find out who started us, then join the default process group.

One script runs unchanged under `phalanx launch`, torchrun, SLURM's `srun`,
Open MPI's `mpirun`, or plain `python`: each launcher describes the job in
its own environment variables, and `detect_launch` reads them into one
`LaunchInfo`. `init` turns that into a real process group (a world of one
gets a real single-rank group, so DDP code needs no special case) and a
`World` that says where this process stands.

The steps have one owner each: `backend` (which backend, which device),
`store` (where the ranks meet), `world` (the `World` and its collectives),
`exit` (letting go of the group); this file puts them in order.
"""

from __future__ import annotations

import logging
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from phalanx.errors import ConfigurationError, PhalanxError, RendezvousError
from phalanx.ground import netif, progress_record
from phalanx.ground.jobenv import LaunchInfo, detect_launch, launched_by_launcher
from phalanx.ground.parent_launch import describe_single_accelerate_process
from phalanx.ground.store_keys import LIVE_ENV, MEMBER_ENV
from phalanx.runtime.backend import backend_names, claim_device, resolve_backend, select_device
from phalanx.runtime.errorhook import install_error_hook
from phalanx.runtime.exit import register_exit_hook, shutdown
from phalanx.runtime.ignored import SettingIgnoredWarning, warn_ignored
from phalanx.runtime.live import LIVE_BACKEND, register_live_backend
from phalanx.runtime.store import make_store
from phalanx.runtime.world import World, describe_default_group

__all__ = [
    "LaunchInfo",
    "RendezvousError",
    "SettingIgnoredWarning",
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


def _pin_gloo_interface(backend: str, info: LaunchInfo) -> None:
    """Export GLOO_SOCKET_IFNAME when `netif`'s policy (the launcher's too) picks one.

    Done here as well as in `phalanx launch` for the launchers that do not
    (torchrun, srun, mpirun); under `phalanx launch` the launcher's choice is
    already in the environment and is kept.
    """
    if "gloo" not in backend_names(backend) or info.master_addr is None:
        return
    choice = netif.choose_gloo_ifname(
        info.master_addr, info.world_size, info.local_world_size, os.environ
    )
    if choice.name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = choice.name
    if choice.note is not None:
        level = logging.WARNING if choice.warning else logging.INFO
        logger.log(level, "rank %d: %s", info.rank, choice.note)


def _group_timeout() -> timedelta | None:
    """The existing default group's collective timeout, where torch says it."""
    try:
        group = dist.group.WORLD
        assert group is not None
        return group._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # no CPU backend (nccl alone), or a torch without these internals
        return None


def _warn_fixed_group(backend: str | None, timeout: timedelta | None, info: LaunchInfo) -> None:
    """Once, on rank 0: what an existing group cannot take from this call."""
    by = "Ray Train's TorchConfig" if info.launcher == "ray" else "whoever made it"
    if backend is not None and backend.strip().lower() != str(dist.get_backend()):
        warn_ignored(
            f"backend {backend!r} cannot apply: the process group exists already with "
            f"backend {dist.get_backend()!r} (made by {by}) — set the backend there "
            "(Ray: TorchConfig(backend=...)), or drop it here",
            dist.get_rank(),
        )
    fixed = _group_timeout()
    if timeout is not None and fixed is not None and fixed != timeout:
        warn_ignored(
            f"timeout {timeout.total_seconds():g} s cannot apply: the process group exists "
            f"already with {fixed.total_seconds():g} s (made by {by}) — set it there "
            "(Ray: TorchConfig(timeout_s=...)), or drop it here",
            dist.get_rank(),
        )


def _join_group(backend: str, info: LaunchInfo, device: torch.device, wait: timedelta) -> None:
    store = make_store(info, wait)
    rank, world_size = info.rank, info.world_size
    if os.environ.get(LIVE_ENV) == "1":  # phalanx launch --live-recovery: runtime/live.py
        if "gloo" not in backend_names(backend):
            raise ConfigurationError(
                f"live recovery runs over gloo, not {backend!r} — drop --live-recovery, or "
                "use the gloo backend"
            )
        register_live_backend()
        backend = LIVE_BACKEND
        if os.environ.get(MEMBER_ENV):  # a replacement: its group comes with LiveRecovery.join
            rank, world_size = 0, 1
    try:
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=wait,
            # Binds NCCL to this rank's GPU up front instead of guessing it at the first collective.
            device_id=device if device.type == "cuda" else None,
        )
    except PhalanxError:  # live recovery's own (a rank that could not prove it is ours)
        raise
    except (RuntimeError, OSError) as exc:
        raise RendezvousError(
            f"rank {info.rank} reached the master but could not connect to its peers ({exc}) "
            "— when hosts talk over a specific network, export GLOO_SOCKET_IFNAME (gloo) or "
            "NCCL_SOCKET_IFNAME (nccl) naming that interface on every rank"
        ) from exc


def init(backend: str | None = None, timeout: float | timedelta | None = None) -> World:
    """Join (or describe) the default process group of the job that started us.

    `backend`: None picks nccl with GPUs, gloo without; any name torch accepts
    is checked against this build. `timeout` (seconds or timedelta; None: 1800)
    bounds the rendezvous and every collective, so a missing rank fails instead
    of hanging. Calling `init` again, or after your own `dist.init_process_group`
    (Ray Train makes the group before your function runs), returns a `World` for
    the existing group; a backend or timeout it cannot have then is warned about
    once (SettingIgnoredWarning).
    """
    install_error_hook()  # first: a wrong argument below is one line, not a traceback
    wait = parse_timeout(DEFAULT_TIMEOUT_S if timeout is None else timeout)
    info = detect_launch(os.environ)
    if dist.is_initialized():
        _warn_fixed_group(backend, None if timeout is None else wait, info)
        return describe_default_group(info)
    if info.launcher == "none" and (asked := describe_single_accelerate_process()):
        raise ConfigurationError(asked)
    chosen = resolve_backend(backend)
    device = select_device(chosen, info.local_rank)
    claim_device(device)
    _pin_gloo_interface(chosen, info)
    _join_group(chosen, info, device, wait)
    install_error_hook()  # again: the exit status outside torch's hook, which wraps ours
    progress_record.start(info.rank, info.world_size, wait.total_seconds())
    register_exit_hook()
    world = describe_default_group(info)
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
