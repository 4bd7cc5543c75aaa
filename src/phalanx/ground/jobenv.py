"""What the job's launcher says about this process, read from its environment.

Each launcher describes the job in its own variables: torchrun and
`phalanx launch` export RANK/WORLD_SIZE/LOCAL_RANK/..., SLURM's `srun` exports
SLURM_PROCID/SLURM_NTASKS/... and a compressed node list, `mpirun` exports
OMPI_COMM_WORLD_* (or PMI_* under MPICH and Intel MPI). Ray Train's TorchTrainer
exports torchrun's names with NODE_RANK for the node; Kubernetes operators give
one process per pod RANK/WORLD_SIZE/MASTER_* and say the pod's node in their own
words (Kubeflow's PET_NNODES/PET_NODE_RANK, an Indexed Job's JOB_COMPLETION_INDEX;
docs/clusters.md). `detect_launch` reads whichever is there into one `LaunchInfo`.
It is pure (a mapping in, a value out) so every launcher can be tested without
one, and imports no torch so the launcher, which must start fast, can use it too.
"""

from __future__ import annotations

import math
import os
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from phalanx.errors import ConfigurationError

__all__ = [
    "LaunchInfo",
    "detect_launch",
    "expand_nodelist",
    "expand_tasks_per_node",
    "global_rank",
    "launched_by_launcher",
]

# Ports derived from a SLURM job id land in [10000, 30000): below Linux's ephemeral
# range (32768+), so no outgoing connection can be holding the port a job needs.
_DERIVED_PORT_BASE = 10000
_DERIVED_PORT_SPAN = 20000
_DEFAULT_PORT = 29500  # torchrun's, for MPI jobs that give us nothing to derive one from
# (rank, size, local rank, local size): Open MPI, then MPICH / Intel MPI (Hydra).
_MPI_VARS = (
    (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)
# Set by Kubernetes in every container of an Indexed Job's pod (a JobSet's jobs are Indexed).
_COMPLETION_INDEX = "JOB_COMPLETION_INDEX"
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


@dataclass(frozen=True)
class LaunchInfo:
    """What the launcher's environment says about this process, before any group exists."""

    launcher: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str | None
    """None for a world of one with no master: its store then lives in memory."""
    master_port: int | None
    agent_store: bool = False
    """torchrun's agent already serves the store on MASTER_PORT: rank 0 joins, not hosts."""


def global_rank(node_rank: int, local_world_size: int, local_rank: int) -> int:
    """Block placement: node n runs ranks n * local_world_size up to the next node's first.

    `phalanx launch` places ranks this way, as torchrun and srun's default do;
    `_placed` inverts it for launchers that do not name a rank's node or local rank.
    """
    return node_rank * local_world_size + local_rank


def _placed(
    launcher: str,
    rank: int,
    world: int,
    local_world: int,
    local_rank: int | None,
    node: int | None,
    addr: str | None,
    port: int | None,
    agent_store: bool = False,
) -> LaunchInfo:
    """A LaunchInfo whose missing local rank and node come from block placement of ranks."""
    return LaunchInfo(
        launcher,
        rank,
        rank % local_world if local_rank is None else local_rank,
        world,
        local_world,
        rank // local_world if node is None else node,
        addr,
        port,
        agent_store,
    )


def _opt_int(environ: Mapping[str, str], *names: str) -> int | None:
    """The first of `names` that is set, as an int; None when none is set."""
    for name in names:
        raw = environ.get(name, "").strip()
        if not raw:
            continue
        try:
            return int(raw)
        except ValueError:
            raise ConfigurationError(
                f"{name}={raw!r} is not an integer — fix or unset it"
            ) from None
    return None


def _req_int(environ: Mapping[str, str], name: str) -> int:
    value = _opt_int(environ, name)
    if value is None:
        raise ConfigurationError(f"{name} is not set — the launcher must export it")
    return value


def expand_tasks_per_node(spec: str) -> list[int]:
    """SLURM's `2(x3),1` -> [2, 2, 2, 1]: the task count of each node in order."""
    counts: list[int] = []
    for piece in spec.split(","):
        match = _TASKS.fullmatch(piece.strip())
        if match is None:
            raise ConfigurationError(
                f"tasks per node {spec!r} is malformed — expected SLURM's form, e.g. '2(x3),1'"
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _split_outside_brackets(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError("unbalanced or nested brackets")
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("unclosed bracket")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_numbers(body: str) -> list[str]:
    """`01-03,07` -> 01 02 03 07, keeping the zero padding of each range's start."""
    numbers: list[str] = []
    for piece in body.split(","):
        match = _RANGE.fullmatch(piece.strip())
        if match is None or int(match.group(2) or match.group(1)) < int(match.group(1)):
            raise ValueError(f"bad range {piece!r}")
        low, high = match.group(1), match.group(2) or match.group(1)
        numbers.extend(f"{n:0{len(low)}d}" for n in range(int(low), int(high) + 1))
    return numbers


def _expand_host(item: str) -> list[str]:
    """`rack[1-2]-n[01-02]` -> every host it names (each bracket multiplies)."""
    opening = item.find("[")
    if opening < 0:
        return [item]
    closing = item.find("]", opening)
    if closing < 0:
        raise ValueError(f"unclosed bracket in {item!r}")
    tails = _expand_host(item[closing + 1 :])
    heads = [item[:opening] + n for n in _expand_numbers(item[opening + 1 : closing])]
    return [head + tail for head in heads for tail in tails]


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed `gpu-a[01-04,07],cpu7` -> gpu-a01 … gpu-a04, gpu-a07, cpu7."""
    try:
        hosts = [h for item in _split_outside_brackets(nodelist) for h in _expand_host(item)]
    except ValueError as exc:
        raise ConfigurationError(
            f"SLURM node list {nodelist!r} is malformed ({exc}) — "
            "export MASTER_ADDR=<rank 0's host> to bypass it"
        ) from exc
    if not hosts:
        raise ConfigurationError("SLURM node list is empty — export MASTER_ADDR=<rank 0's host>")
    return hosts


def _single_process() -> LaunchInfo:
    return LaunchInfo("none", 0, 0, 1, 1, 0, None, None)


def _from_env_launcher(environ: Mapping[str, str]) -> LaunchInfo:
    """torchrun / `phalanx launch`: RANK, WORLD_SIZE, LOCAL_*, GROUP_RANK, MASTER_*."""
    for have, lack in (("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")):
        if lack not in environ:
            raise ConfigurationError(
                f"{have} is set but {lack} is not — export both (torchrun and phalanx "
                "launch do) or neither"
            )
    rank, world = _req_int(environ, "RANK"), _req_int(environ, "WORLD_SIZE")
    if world < 1:
        # Checked first: LOCAL_WORLD_SIZE defaults to it and would take the blame.
        raise ConfigurationError(
            f"WORLD_SIZE={world} must be at least 1 — export the number of processes in the job"
        )
    local_world = _opt_int(environ, "LOCAL_WORLD_SIZE")
    local_world = _pods_local_world(environ, world) if local_world is None else local_world
    if local_world < 1:
        raise ConfigurationError(f"LOCAL_WORLD_SIZE={local_world} must be >= 1 — fix or unset it")
    local_rank = _opt_int(environ, "LOCAL_RANK")
    # torchrun's and phalanx launch's GROUP_RANK; Ray Train's NODE_RANK; Kubeflow's
    # PET_NODE_RANK (the pod's index); an Indexed Job's (JobSet's) completion index.
    node = _opt_int(environ, "GROUP_RANK", "NODE_RANK", "PET_NODE_RANK", _COMPLETION_INDEX)
    addr, port = environ.get("MASTER_ADDR") or None, _opt_int(environ, "MASTER_PORT")
    if world > 1 and (addr is None or port is None):
        raise ConfigurationError(
            f"WORLD_SIZE={world} but MASTER_ADDR or MASTER_PORT is not set — export "
            "MASTER_ADDR=<rank 0's host> and MASTER_PORT=<free port> on every rank"
        )
    if addr is None or port is None:
        addr, port = None, None
    return _placed(
        _env_launcher_name(environ),
        rank,
        world,
        local_world,
        local_rank,
        node,
        addr,
        port,
        agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
    )


def _env_launcher_name(environ: Mapping[str, str]) -> str:
    """ "ray" in a Ray worker (its raylet's pid is in every worker's environment) that no
    launcher of ours or torchrun's started; "env" for every other RANK/WORLD_SIZE job."""
    launched = "TORCHELASTIC_RUN_ID" in environ or "PHALANX_RESTART_COUNT" in environ
    return "ray" if "RAY_RAYLET_PID" in environ and not launched else "env"


def _pods_local_world(environ: Mapping[str, str], world: int) -> int:
    """Processes on this node when nothing says (no LOCAL_WORLD_SIZE): a Kubernetes
    operator's pod runs one (PyTorchJob gives PET_NNODES pods WORLD_SIZE ranks; an Indexed
    Job's pod has its completion index), a hand-started job runs them all on one host."""
    nodes = _opt_int(environ, "PET_NNODES")
    per_pod = environ.get("PET_NPROC_PER_NODE", "").strip()  # a number, or "auto": a launcher's
    if per_pod.isdigit() and int(per_pod) > 1:
        raise ConfigurationError(
            f"PET_NPROC_PER_NODE={per_pod} asks for {per_pod} processes in this pod, but this "
            "one was started alone — make the container's command `phalanx launch train.py` "
            "(it reads PET_* as torchrun does)"
        )
    if nodes is not None and nodes > 0 and world % nodes == 0:
        return world // nodes
    return 1 if _COMPLETION_INDEX in environ else world


def _slurm_local_world(environ: Mapping[str, str], node: int, world: int) -> int:
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        counts = expand_tasks_per_node(environ[name]) if environ.get(name) else []
        if node < len(counts):
            return counts[node]
    per_node = _opt_int(environ, "SLURM_NTASKS_PER_NODE")
    nodes = _opt_int(environ, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    return per_node or math.ceil(world / (nodes or 1))


def _slurm_master(environ: Mapping[str, str]) -> str:
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if environ.get(name):
            return expand_nodelist(environ[name])[0]
    raise ConfigurationError(
        "SLURM names no node list (SLURM_JOB_NODELIST) — export MASTER_ADDR=<rank 0's host>"
    )


def _slurm_port(environ: Mapping[str, str]) -> int:
    """A port from the job id, so concurrent jobs (and steps) on a node do not collide."""
    job = _opt_int(environ, "SLURM_JOB_ID", "SLURM_JOBID")
    if job is None:
        return _DEFAULT_PORT
    step = _opt_int(environ, "SLURM_STEP_ID", "SLURM_STEPID") or 0
    return _DERIVED_PORT_BASE + (job * 8 + step % 8) % _DERIVED_PORT_SPAN


def _from_slurm(environ: Mapping[str, str]) -> LaunchInfo | None:
    """An srun task of a step with more than one task; else None (a world of one)."""
    world = _opt_int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    if "SLURM_PROCID" not in environ or world is None or world <= 1:
        return None
    rank, node = _req_int(environ, "SLURM_PROCID"), _opt_int(environ, "SLURM_NODEID")
    local_world = _slurm_local_world(environ, node or 0, world)
    local_rank = _opt_int(environ, "SLURM_LOCALID")
    return _placed(
        "slurm",
        rank,
        world,
        local_world,
        local_rank,
        node,
        environ.get("MASTER_ADDR") or _slurm_master(environ),
        _opt_int(environ, "MASTER_PORT") or _slurm_port(environ),
    )


def _mpi_port(environ: Mapping[str, str]) -> int:
    job = environ.get("PMIX_NAMESPACE") or environ.get("OMPI_MCA_ess_base_jobid")
    if not job:
        return _DEFAULT_PORT
    return _DERIVED_PORT_BASE + zlib.crc32(job.encode()) % _DERIVED_PORT_SPAN


def _from_mpi(environ: Mapping[str, str]) -> LaunchInfo | None:
    """An `mpirun` rank of more than one; the master is 127.0.0.1 only on a single node."""
    for rank_var, size_var, local_rank_var, local_size_var in _MPI_VARS:
        world = _opt_int(environ, size_var)
        if world is None or world <= 1:
            continue
        rank = _req_int(environ, rank_var)
        local_world = _opt_int(environ, local_size_var) or world
        local_rank = _opt_int(environ, local_rank_var)
        addr = environ.get("MASTER_ADDR") or ("127.0.0.1" if local_world == world else None)
        if addr is None:
            raise ConfigurationError(
                f"mpirun started {world} ranks over several nodes and MASTER_ADDR is not set "
                "— export MASTER_ADDR=<rank 0's host> to every rank (mpirun -x MASTER_ADDR)"
            )
        port = _opt_int(environ, "MASTER_PORT") or _mpi_port(environ)
        return _placed("mpi", rank, world, local_world, local_rank, None, addr, port)
    return None


def _validated(info: LaunchInfo) -> LaunchInfo:
    """Catch an inconsistent environment now, not as a hang in the rendezvous."""
    problems = [
        (info.world_size < 1, f"world size {info.world_size} < 1"),
        (not 0 <= info.rank < info.world_size, f"rank {info.rank} outside [0, world size)"),
        (not 1 <= info.local_world_size <= info.world_size, "local world size out of range"),
        (not 0 <= info.local_rank < info.local_world_size, f"local rank {info.local_rank}"),
        (info.node_rank < 0, f"node rank {info.node_rank} < 0"),
        (info.master_port is not None and not 0 < info.master_port < 65536, "master port"),
    ]
    bad = [text for failed, text in problems if failed]
    if bad:
        raise ConfigurationError(
            f"the {info.launcher} launcher's environment is inconsistent ({'; '.join(bad)}: "
            f"{info}) — check the rank, size and MASTER_PORT variables it exports"
        )
    return info


def _refuse_unlaunched_pod(environ: Mapping[str, str]) -> None:
    """Kubeflow's PET_* variables say this pod is one of several nodes, yet nothing started
    this process as a rank: it would train alone, unnoticed, beside the other pods."""
    nodes = _opt_int(environ, "PET_NNODES") if environ.get("PET_NNODES", "").isdigit() else None
    if nodes is not None and nodes > 1:
        raise ConfigurationError(
            f"PET_NNODES={nodes} says this pod is one of {nodes} nodes, but nothing started "
            "this process as a rank (no RANK/WORLD_SIZE) — make the container's command "
            "`phalanx launch train.py`, which reads PET_* as torchrun does (docs/clusters.md)"
        )


def detect_launch(environ: Mapping[str, str]) -> LaunchInfo:
    """Read the launcher's variables: RANK/WORLD_SIZE first, then SLURM, then MPI."""
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return _validated(_from_env_launcher(environ))
    found = _from_slurm(environ) or _from_mpi(environ)
    if found is None:
        _refuse_unlaunched_pod(environ)
    return _validated(found) if found is not None else _single_process()


def launched_by_launcher(environ: Mapping[str, str] | None = None) -> bool:
    """True when a launcher started this process, so the Trainer turns DDP on by itself."""
    return detect_launch(os.environ if environ is None else environ).launcher != "none"
