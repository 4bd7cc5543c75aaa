"""What one `phalanx launch` run does, validated before anything is spawned.

A bad value fails here with a one-line `ConfigurationError` instead of as a
hang or a traceback inside N workers.
"""

from __future__ import annotations

import signal
import uuid
from dataclasses import dataclass, field

from phalanx.errors import ConfigurationError
from phalanx.ground.jobenv import global_rank
from phalanx.ground.runauth import RunKey, new_secret
from phalanx.launch.devices import cpu_count, gpu_count
from phalanx.launch.routing import OutputRouting

# torchrun's default for multi-node runs, so firewall rules written for it keep working.
DEFAULT_MULTINODE_PORT = 29500
# Long enough for a cluster scheduler to start the master node a while after the others.
DEFAULT_RDZV_TIMEOUT_S = 900.0
# SIGTERM first so workers can flush logs; SIGKILL after this if they ignore it.
DEFAULT_GRACE_S = 5.0
# torchrun's default for --rdzv-conf join_timeout: how long the nodes have to gather.
DEFAULT_JOIN_TIMEOUT_S = 600.0
# How long the master's address may go without any answer (no route, no reply to a
# connection) before that is the error: a host that is up answers at once, if only with a
# refusal while its launcher has not started yet (which waits --rdzv-timeout).
DEFAULT_CONNECT_TIMEOUT_S = 60.0
# How often a wait for another node says who it still waits for.
DEFAULT_REPORT_S = 30.0
REPORT_ENV = "PHALANX_RDZV_REPORT_S"
"""Overrides DEFAULT_REPORT_S (seconds): the tests shorten it instead of waiting 30 s."""
# torchrun's --signals-to-handle default. A dropped ssh session (SIGHUP) or SIGQUIT stops the
# job like SIGTERM does, so no worker trains on unsupervised.
DEFAULT_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
DEFAULT_EXIT_TIMEOUT_S = 300.0
"""--exit-timeout: generous, since an exit handler may upload (a metrics logger's last sync)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Rendezvous:
    """How the nodes meet, from --rdzv-backend, --rdzv-conf and --node-rank."""

    assign_node_rank: bool = False
    """c10d across nodes without --node-rank: node ranks are handed out at rendezvous."""
    hosts_store: bool = True
    """This launcher hosts the job's store: node 0 (static), or the endpoint's host (c10d)."""
    host_forced: bool = False
    """--rdzv-conf is_host said so; otherwise a c10d host whose port is taken (another
    launcher on the same host got there first) joins as a client, as torchrun's does."""
    port_flag: str = "--master-port"
    """The flag that set the store's port, named when that port is taken."""
    read_timeout_s: float = 60.0
    """--rdzv-conf read_timeout: how long one answer from the store may take."""
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S
    """--rdzv-conf join_timeout: how long the store's host waits for every node to join."""
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    """--rdzv-conf connect_timeout: how long the master's address may stay unreachable (no
    route, no answer) before that is a one-line error; a refused connection (the host is up,
    its launcher not yet) is waited for up to --rdzv-timeout."""
    report_s: float = DEFAULT_REPORT_S
    """How often a wait for the master or for missing nodes says what it waits for
    (REPORT_ENV)."""
    etcd: tuple[str, ...] = ()
    """--rdzv-backend etcd: the etcd members (HOST:PORT) that keep the job's store; no
    launcher hosts one (launch/etcdmeet.py)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class LiveOptions:
    """--live-recovery's settings (launch/live.py; the workers get them in their env)."""

    stall_s: float = 5.0
    min_members: int = 1
    quorum_timeout_s: float = 60.0
    secret: str = field(default_factory=new_secret, repr=False)
    """The run's secret (--run-secret-file, PHALANX_RUN_SECRET, or made for the run): the
    workers get it in their environment, never through the store (ground/runauth.py)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class LaunchConfig:
    """Everything the agent needs; built by `cli`, never changed after validation."""

    command: list[str]
    """The worker's command line without the interpreter: script + args, or -m module + args."""
    use_python: bool = True
    """False with --no-python: `command[0]` is an executable run as is."""
    run_path: bool = False
    """--run-path: the script runs through runpy.run_path inside the worker's interpreter."""
    start_method: str = "spawn"
    """--start-method: `forkserver` forks the workers from a warm server that has imported
    torch (launch/forkstart.py); `spawn` and `fork` start each as a fresh interpreter."""
    nproc_per_node: int = 1
    """Workers on this node."""
    nnodes: int = 1
    """Nodes in the job; the world is nnodes * nproc_per_node ranks."""
    node_rank: int = 0
    """This node's index; its workers get ranks node_rank*nproc .. node_rank*nproc + nproc - 1."""
    master_addr: str = "127.0.0.1"
    """Where the job's store listens: on node 0, hosted by its launcher."""
    master_port: int = 0
    """0 on a single node means: a free port, held by the launcher for the whole run."""
    max_restarts: int = 0
    """Restart the whole worker group after a failure at most this many times (under
    live_recovery: start at most this many replacements)."""
    live: LiveOptions | None = None
    """--live-recovery and its settings: None restarts the whole group instead."""
    log_dir: str | None = None
    """When set, each rank's output is also written to LOG_DIR/rank_<rank>.log."""
    routing: OutputRouting = field(default_factory=lambda: OutputRouting())
    """torchrun's -r/-t/--local-ranks-filter/--duplicate-*-filters: where output goes."""
    rdzv_timeout_s: float = DEFAULT_RDZV_TIMEOUT_S
    """How long a non-master node waits for the master's store."""
    rdzv: Rendezvous = field(default_factory=lambda: Rendezvous())
    """How this node meets the others: static, or c10d with node ranks assigned at run time."""
    local_addr: str | None = None
    """--local-addr: this node's own address, for its store, its interface and its peers."""
    grace_s: float = DEFAULT_GRACE_S
    """Seconds between SIGTERM and SIGKILL when stopping workers."""
    monitor_interval_s: float = 0.1
    """How often the agent polls its workers."""
    exit_timeout_s: float = DEFAULT_EXIT_TIMEOUT_S
    """--exit-timeout: how long a worker may take to exit once its script has ended before
    it is shown and killed as hung (launch/exitwatch.py)."""
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    """TORCHELASTIC_RUN_ID, so scripts that log it keep working."""
    role: str = "default"
    """--role: ROLE_NAME in every worker's environment."""
    handled_signals: tuple[int, ...] = DEFAULT_HANDLED_SIGNALS
    """Signals that stop the job: the launcher stops every worker, then exits 128 + signum."""
    virtual_local_rank: bool = False
    """Every worker sees LOCAL_RANK=0 and only its own GPU in CUDA_VISIBLE_DEVICES."""
    notes: tuple[str, ...] = ()
    """Lines the launcher says before it starts (flags accepted that change nothing)."""

    def __post_init__(self) -> None:
        _check_counts(self)
        if self.nnodes > 1 and self.master_port == 0:
            raise ConfigurationError(
                "a multi-node run needs a fixed master port — pass --master-port (all nodes alike)"
            )
        if not self.command:
            raise ConfigurationError("no script to run — pass a script path or -m module")

    def live_key(self) -> RunKey:
        """What signs and checks the live protocol's store values (needs --live-recovery)."""
        assert self.live is not None
        return RunKey(self.live.secret, self.run_id)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def global_rank(self, local_rank: int) -> int:
        """The rank of this node's worker `local_rank` in the whole job."""
        return global_rank(self.node_rank, self.nproc_per_node, local_rank)


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
        (
            config.live is None or config.live.stall_s > 0,
            "--live-stall-timeout must be positive",
        ),
        (
            config.live is None or config.live.min_members >= 1,
            "--live-min-members must be 1 or more",
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
        (config.grace_s >= 0, f"--shutdown-timeout must be 0 or more, got {config.grace_s}"),
        (
            config.exit_timeout_s > 0,
            f"--exit-timeout must be positive, got {config.exit_timeout_s}",
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


def parse_signals(value: str | None) -> tuple[int, ...]:
    """--signals-to-handle SIGTERM,SIGINT,...: names with or without SIG, or numbers."""
    if value is None:
        return DEFAULT_HANDLED_SIGNALS
    found = []
    for item in (v.strip() for v in value.split(",") if v.strip()):
        name = item.upper() if item.upper().startswith("SIG") else "SIG" + item.upper()
        signum = int(item) if item.isdigit() else getattr(signal, name, None)
        if signum is None or int(signum) in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigurationError(
                f"--signals-to-handle: {item!r} is not a signal the launcher can catch — "
                "use names like SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
            )
        found.append(int(signum))
    return tuple(found)
