"""What one `phalanx launch` run does, validated before anything is spawned.

A bad value fails here with a one-line `ConfigurationError` instead of as a
hang or a traceback inside N workers.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from phalanx.errors import ConfigurationError
from phalanx.jobenv import global_rank
from phalanx.launch.devices import cpu_count, gpu_count

# torchrun's default for multi-node runs, so firewall rules written for it keep working.
DEFAULT_MULTINODE_PORT = 29500
# Long enough for a cluster scheduler to start the master node a while after the others.
DEFAULT_RDZV_TIMEOUT_S = 900.0
# SIGTERM first so workers can flush logs; SIGKILL after this if they ignore it.
DEFAULT_GRACE_S = 5.0


@dataclass(kw_only=True, frozen=True, slots=True)
class LaunchConfig:
    """Everything the agent needs; built by `cli`, never changed after validation."""

    command: list[str]
    """The worker's command line without the interpreter: script + args, or -m module + args."""
    use_python: bool = True
    """False with --no-python: `command[0]` is an executable run as is."""
    nproc_per_node: int = 1
    """Workers on this node."""
    nnodes: int = 1
    """Nodes in the job; the world is nnodes * nproc_per_node ranks."""
    node_rank: int = 0
    """This node's index; its workers get ranks node_rank*nproc .. node_rank*nproc + nproc - 1."""
    master_addr: str = "127.0.0.1"
    """Where rank 0's TCP store listens."""
    master_port: int = 0
    """0 on a single node means: pick a free port, a fresh one per restart."""
    max_restarts: int = 0
    """Restart the whole worker group after a failure at most this many times."""
    log_dir: str | None = None
    """When set, each rank's output is also written to LOG_DIR/rank_<rank>.log."""
    rdzv_timeout_s: float = DEFAULT_RDZV_TIMEOUT_S
    """How long a non-master node waits for the master's port to open."""
    grace_s: float = DEFAULT_GRACE_S
    """Seconds between SIGTERM and SIGKILL when stopping workers."""
    monitor_interval_s: float = 0.1
    """How often the agent polls its workers."""
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    """TORCHELASTIC_RUN_ID, so scripts that log it keep working."""

    def __post_init__(self) -> None:
        _check_counts(self)
        if self.nnodes > 1 and self.master_port == 0:
            raise ConfigurationError(
                "a multi-node run needs a fixed master port — pass --master-port (all nodes alike)"
            )
        if not self.command:
            raise ConfigurationError("no script to run — pass a script path or -m module")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def global_rank(self, local_rank: int) -> int:
        """The rank of this node's worker `local_rank` in the whole job."""
        return global_rank(self.node_rank, self.nproc_per_node, local_rank)

    @property
    def picks_free_port(self) -> bool:
        """A single-node run without a port picks one itself, so restarts can pick anew."""
        return self.master_port == 0


def _check_counts(config: LaunchConfig) -> None:
    checks = [
        (
            config.nproc_per_node >= 1,
            f"--nproc-per-node must be at least 1, got {config.nproc_per_node}",
        ),
        (config.nnodes >= 1, f"--nnodes must be at least 1, got {config.nnodes}"),
        (
            0 <= config.node_rank < config.nnodes,
            f"--node-rank {config.node_rank} is outside "
            f"0..{config.nnodes - 1} for --nnodes {config.nnodes} — number the nodes from 0",
        ),
        (
            0 <= config.master_port <= 65535,
            f"--master-port {config.master_port} is not a TCP "
            "port — use 1..65535, or 0 to pick a free one",
        ),
        (config.max_restarts >= 0, f"--max-restarts must be 0 or more, got {config.max_restarts}"),
        (
            config.rdzv_timeout_s > 0,
            f"--rdzv-timeout must be positive, got {config.rdzv_timeout_s}",
        ),
        (
            config.monitor_interval_s > 0,
            f"--monitor-interval must be positive, got {config.monitor_interval_s}",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigurationError(message)


def parse_nproc(value: str) -> int:
    """torchrun's --nproc-per-node values: an int, `auto`, `gpu` or `cpu`.

    `auto` is the GPU count, or 1 on a machine without GPUs (one CPU worker,
    which then gets all the cores through OMP_NUM_THREADS).
    """
    text = value.strip().lower()
    if text == "auto":
        return gpu_count() or 1
    if text == "gpu":
        gpus = gpu_count()
        if gpus == 0:
            raise ConfigurationError(
                "--nproc-per-node gpu but no GPU is visible — use auto, cpu or a number"
            )
        return gpus
    if text == "cpu":
        return cpu_count()
    try:
        return int(text)
    except ValueError:
        raise ConfigurationError(
            f"--nproc-per-node {value!r} is not a number — use an integer, auto, gpu or cpu"
        ) from None


def parse_nnodes(value: str) -> int:
    """An int, or torchrun's elastic `MIN:MAX` form when MIN == MAX (a fixed size)."""
    low, _, high = value.partition(":")
    try:
        low_n = int(low)
        high_n = int(high) if high else low_n
    except ValueError:
        raise ConfigurationError(f"--nnodes {value!r} is not a number — use e.g. 2") from None
    if low_n != high_n:
        raise ConfigurationError(
            f"--nnodes {value} asks for an elastic node range — phalanx runs a fixed number of "
            "nodes, pass one number"
        )
    return low_n
