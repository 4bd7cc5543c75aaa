"""The environment each worker starts with: torchrun's variables, so torchrun scripts run as is."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping

from phalanx.errors import ConfigurationError
from phalanx.ground.netif import choose_gloo_ifname, local_addr_ifname
from phalanx.ground.runauth import SECRET_ENV
from phalanx.ground.store_keys import LIVE_ENV, MIN_MEMBERS_ENV, QUORUM_TIMEOUT_ENV, STALL_ENV
from phalanx.launch.config import LaunchConfig, LiveOptions
from phalanx.launch.devices import cpu_count


def omp_threads(nproc_per_node: int) -> int:
    """Cores per local worker, at least 1: N workers each using every core thrash the caches."""
    return max(1, cpu_count() // nproc_per_node)


HUGE_PAGES = "glibc.malloc.hugetlb=1"
"""glibc's malloc asks for transparent huge pages (madvise) for its large blocks."""


def huge_page_tunables(base: Mapping[str, str]) -> str | None:
    """GLIBC_TUNABLES with `HUGE_PAGES` added, or None where it stays as it is (not Linux, or
    the user set glibc.malloc.hugetlb already: `=0` turns it off).

    Why: a ZeRO-3 step (and anything that allocates large buffers per use) faults its
    fresh memory in a 4 KB page at a time; a 2 MB page at a time, the 34M MLP's stage-3
    step at 8 samples a rank took 0.62-0.64x the time, at the same peak RSS
    (docs/launch.md, "Huge pages"). Read once by the dynamic loader: it has to be in the
    environment the worker's interpreter starts with."""
    if not sys.platform.startswith("linux"):
        return None
    current = base.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb=" in current:
        return None
    return f"{current}:{HUGE_PAGES}" if current else HUGE_PAGES


def _defaults(env: dict[str, str], config: LaunchConfig) -> dict[str, str]:
    """What every worker gets unless the user set it: its share of the cores, huge pages."""
    env.setdefault("OMP_NUM_THREADS", str(omp_threads(config.nproc_per_node)))
    tunables = huge_page_tunables(env)
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    return env


def gloo_ifname_env(
    config: LaunchConfig, environ: Mapping[str, str], announce: Callable[[str], None]
) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME for every worker, when `netif`'s policy picks one.

    Decided here too, not only in the workers' `phalanx.init()`, so that scripts
    using torch.distributed directly get it, and the launcher's output says it.
    """
    if config.local_addr is not None:
        choice = local_addr_ifname(config.local_addr, environ)
    else:
        choice = choose_gloo_ifname(
            config.master_addr, config.world_size, config.nproc_per_node, environ
        )
    if choice.note is not None:
        announce(choice.note)
    return {} if choice.name is None else {"GLOO_SOCKET_IFNAME": choice.name}


def worker_env(
    config: LaunchConfig,
    *,
    local_rank: int,
    restart_count: int,
    master_port: int,
    base: Mapping[str, str],
    extra: Mapping[str, str],
) -> dict[str, str]:
    """`base` (the launcher's environment) plus what this worker needs to join the world.

    `extra` holds launcher-wide additions such as GLOO_SOCKET_IFNAME; the
    caller already left out anything the user set.
    """
    rank = config.global_rank(local_rank)
    env = dict(base)
    env.update(extra)
    if config.virtual_local_rank:
        env["CUDA_VISIBLE_DEVICES"] = visible_device(base, local_rank)
    env.update(
        RANK=str(rank),
        LOCAL_RANK="0" if config.virtual_local_rank else str(local_rank),
        WORLD_SIZE=str(config.world_size),
        LOCAL_WORLD_SIZE=str(config.nproc_per_node),
        GROUP_RANK=str(config.node_rank),
        GROUP_WORLD_SIZE=str(config.nnodes),
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(config.world_size),
        ROLE_NAME=config.role,
        MASTER_ADDR=config.master_addr,
        MASTER_PORT=str(master_port),
        PHALANX_RESTART_COUNT=str(restart_count),
        PHALANX_MAX_RESTARTS=str(config.max_restarts),
        TORCHELASTIC_RESTART_COUNT=str(restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(config.max_restarts),
        TORCHELASTIC_RUN_ID=config.run_id,
        # The launcher hosts the store (launch/storehost.py): rank 0 joins it as a client,
        # as under torchrun, instead of listening on every interface itself.
        TORCHELASTIC_USE_AGENT_STORE="True",
        # Output goes through pipes; unbuffered, a print shows up when it happens.
        PYTHONUNBUFFERED="1",
    )
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    return _defaults(env, config)


def live_env(live: LiveOptions | None) -> dict[str, str]:
    """What every worker of a --live-recovery run is told of it (none without one)."""
    if live is None:
        return {}
    return {
        LIVE_ENV: "1",
        SECRET_ENV: live.secret,
        STALL_ENV: f"{live.stall_s:g}",
        MIN_MEMBERS_ENV: str(live.min_members),
        QUORUM_TIMEOUT_ENV: f"{live.quorum_timeout_s:g}",
    }


def server_env(
    config: LaunchConfig, base: Mapping[str, str], extra: Mapping[str, str]
) -> dict[str, str]:
    """The warm server's environment (launch/warmserver.py): what every worker's holds that
    an import may read. Each forked worker then takes its own whole environment."""
    return _defaults({**base, **extra, "PYTHONUNBUFFERED": "1"}, config)


# --run-path: what torchrun's run_script_path does, in the worker's own fresh interpreter.
# As there, the script's directory is not put on sys.path (the working directory is).
_RUN_PATH = (
    "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def worker_argv(config: LaunchConfig, python: str) -> list[str]:
    """The command line of one worker: `python -u script args`, `python -u -m mod args`,
    the script through runpy with --run-path, or the bare command with --no-python."""
    if config.run_path:
        return [python, "-u", "-c", _RUN_PATH, *config.command]
    if not config.use_python:
        return list(config.command)
    return [python, "-u", *config.command]


def visible_device(base: Mapping[str, str], local_rank: int) -> str:
    """--virtual-local-rank: the one device this worker sees, from the launcher's list."""
    visible = base.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(local_rank)
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    if local_rank >= len(devices):
        raise ConfigurationError(
            f"--virtual-local-rank: local rank {local_rank} has no device in "
            f"CUDA_VISIBLE_DEVICES={visible!r} — list one device per worker"
        )
    return devices[local_rank]
