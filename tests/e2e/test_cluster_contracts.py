"""Two "pods" on loopback per cluster contract, each given that operator's exact variables:
the run they make is bit-identical to `phalanx launch --nproc-per-node 2`.

A pod here is a process group started with the environment its operator writes
(docs/clusters.md cites each source; tests/unit/test_cluster_env.py checks every
variable's reading): Kubeflow's PyTorchJob runs `python train.py` in each pod;
Kubeflow Trainer v2 runs `phalanx launch train.py`, which reads its PET_*
variables as torchrun does; JobSet runs `phalanx launch --nnodes 2 ...` with the
pod's completion index as its node rank; and plain torchrun runs in a pod. Each
worker records its rank, node, local rank and master (train_mlp.py).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from phalanx.ground.ports import free_port
from tests.launchkit import LAUNCH, SCRIPTS, TORCHRUN, clean_env, finish, launch, start

TRAIN = SCRIPTS / "train_mlp.py"
TIMEOUT_S = 90

Pod = tuple[list[object], dict[str, str]]
"""A pod's command and its operator's variables."""


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"params_{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("reference")
    done = launch("--nproc-per-node 2", TRAIN, out, timeout_s=TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    return _records(out)


def pytorchjob(index: int, port: int, out: Path) -> Pod:
    """training-operator's Master (index 0) and Worker pods, nprocPerNode unset."""
    master = "127.0.0.1"  # the pod name <job>-master-0, here on loopback
    env = {
        "MASTER_ADDR": master,
        "PET_MASTER_ADDR": master,
        "MASTER_PORT": str(port),
        "PET_MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "RANK": str(index),
        "PET_NODE_RANK": str(index),
        "PET_NNODES": "2",
        "PYTHONUNBUFFERED": "1",
    }
    return [sys.executable, TRAIN, out], env


def trainer_v2(index: int, port: int, out: Path) -> Pod:
    """Trainer's torch plugin: PET_* only; the TrainJob's command is phalanx launch."""
    env = {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "1",
        "PET_NODE_RANK": str(index),
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(port),
        "JOB_COMPLETION_INDEX": str(index),
    }
    return [*LAUNCH, TRAIN, out], env


def jobset(index: int, port: int, out: Path) -> Pod:
    """A JobSet's replicatedJob of 2 pods, each `phalanx launch` without --node-rank."""
    flags = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
    ]
    return [*LAUNCH, *flags, TRAIN, out], {"JOB_COMPLETION_INDEX": str(index)}


def torchrun(index: int, port: int, out: Path) -> Pod:
    """Plain torchrun in each pod (JobSet's own PyTorch example)."""
    flags = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--node-rank",
        index,
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
        "--rdzv-id",
        "123",
    ]
    return [*TORCHRUN, *flags, TRAIN, out], {"JOB_COMPLETION_INDEX": str(index)}


@pytest.mark.timeout(2 * TIMEOUT_S + 30)
@pytest.mark.parametrize(
    "contract",  # the other two read PET_*: unit-tested (tests/unit/test_cluster_env.py)
    [
        pytorchjob,
        jobset,
        *(pytest.param(c, marks=pytest.mark.slow) for c in (trainer_v2, torchrun)),
    ],
)
def test_two_pods_train_as_phalanx_launch_does(
    contract: Callable[[int, int, Path], Pod], reference: list[dict[str, Any]], tmp_path: Path
) -> None:
    port = free_port()
    pods = [contract(index, port, tmp_path) for index in (0, 1)]
    procs = [start(argv, env=clean_env(**env)) for argv, env in pods]
    outputs = [finish(proc, TIMEOUT_S) for proc in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
    records = _records(tmp_path)
    for rank, record in enumerate(records):
        assert (record["rank"], record["world_size"], record["node_rank"]) == (rank, 2, rank)
        assert (record["local_rank"], record["local_world_size"]) == (0, 1)
        assert record["master"] == ["127.0.0.1", port]
        assert record["params"] == reference[rank]["params"]  # bit-identical
