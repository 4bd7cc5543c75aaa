"""Each cluster's contract, fed its exact variables: the right rank, world, node and master.

The variables are the operators' own (docs/clusters.md cites each source):
Kubeflow's PyTorchJob (training-operator 1.9, pkg/controller.v1/pytorch/envvar.go
and master.go: MASTER_*, WORLD_SIZE, RANK, PET_NODE_RANK, PET_NNODES, PET_MASTER_*
on one process per pod), Kubeflow Trainer v2 (pkg/runtime/framework/plugins/torch:
only PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK from the pod's completion index,
PET_MASTER_ADDR, PET_MASTER_PORT, for a launcher to read), JobSet (its PyTorch
example: MASTER_*, RANK from the completion index, and Kubernetes' own
JOB_COMPLETION_INDEX), torchrun's worker environment, and Ray Train's
(ray/train/torch/config.py: torchrun's names with NODE_RANK).
"""

from __future__ import annotations

import argparse

import pytest

from phalanx.cli.launch_flags import build_parser, environment_defaults
from phalanx.cli.rdzvflags import store_site
from phalanx.errors import ConfigurationError, UsageError
from phalanx.ground.jobenv import LaunchInfo, detect_launch


def pytorchjob_pod(job: str, rank: int, replicas: int, port: int = 23456) -> dict[str, str]:
    """What training-operator gives a pod of a PyTorchJob without nprocPerNode."""
    master = f"{job}-master-0"
    return {
        "PYTHONUNBUFFERED": "1",
        "MASTER_PORT": str(port),
        "PET_MASTER_PORT": str(port),
        "MASTER_ADDR": master,
        "PET_MASTER_ADDR": master,
        "WORLD_SIZE": str(replicas),
        "RANK": str(rank),
        "PET_NODE_RANK": str(rank),
        "PET_NNODES": str(replicas),
    }


def trainer_v2_pod(job: str, index: int, nodes: int, per_node: str) -> dict[str, str]:
    """What Kubeflow Trainer's torch plugin gives the `node` container of a TrainJob."""
    return {
        "PET_NNODES": str(nodes),
        "PET_NPROC_PER_NODE": per_node,
        "PET_NODE_RANK": str(index),  # fieldRef: the batch.kubernetes.io/job-completion-index
        "PET_MASTER_ADDR": f"{job}-node-0-0.{job}",
        "PET_MASTER_PORT": "29500",
        "JOB_COMPLETION_INDEX": str(index),
    }


def jobset_pod(index: int, pods: int) -> dict[str, str]:
    """JobSet's PyTorch example's pod, started as `python train.py` (one process per pod)."""
    return {
        "MASTER_ADDR": "pytorch-workers-0-0.pytorch",
        "MASTER_PORT": "3389",
        "RANK": str(index),  # fieldRef: the batch.kubernetes.io/job-completion-index
        "WORLD_SIZE": str(pods),
        "JOB_COMPLETION_INDEX": str(index),
    }


@pytest.mark.parametrize(("rank", "replicas"), [(0, 3), (2, 3)])
def test_pytorchjob_pod_is_one_node_of_one_process(rank: int, replicas: int) -> None:
    info = detect_launch(pytorchjob_pod("mnist", rank, replicas))
    assert info == LaunchInfo("env", rank, 0, replicas, 1, rank, "mnist-master-0", 23456)


@pytest.mark.parametrize("index", [0, 3])
def test_jobset_pod_is_its_completion_index(index: int) -> None:
    info = detect_launch(jobset_pod(index, 4))
    assert info == LaunchInfo("env", index, 0, 4, 1, index, "pytorch-workers-0-0.pytorch", 3389)


def test_torchrun_in_a_pod() -> None:
    """torchrun --nnodes 2 --nproc-per-node 2 --node-rank 1 inside a JobSet pod: torchrun's
    own variables win over the pod's completion index."""
    env = {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "ROLE_RANK": "3",
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "pytorch-workers-0-0.pytorch",
        "MASTER_PORT": "3389",
        "TORCHELASTIC_RUN_ID": "123",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "JOB_COMPLETION_INDEX": "1",
    }
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.local_rank, info.node_rank) == ("env", 3, 1, 1)
    assert (info.local_world_size, info.master_port, info.agent_store) == (2, 3389, True)


def test_ray_train_worker() -> None:
    """Ray Train's TorchTrainer on 2 nodes of 2 workers, rank 3: its node is NODE_RANK."""
    env = {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "NODE_RANK": "1",
        "MASTER_ADDR": "10.0.0.2",
        "MASTER_PORT": "35065",
        "ACCELERATE_TORCH_DEVICE": "cpu",
        "RAY_RAYLET_PID": "4242",
        "RAY_JOB_ID": "01000000",
    }
    assert detect_launch(env) == LaunchInfo("ray", 3, 1, 4, 2, 1, "10.0.0.2", 35065)


def test_a_launcher_in_a_ray_worker_is_that_launcher() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "1", "RAY_RAYLET_PID": "1", "TORCHELASTIC_RUN_ID": "x"}
    assert detect_launch(env).launcher == "env"


def test_trainer_v2_pod_started_alone_is_refused() -> None:
    """A TrainJob whose command is `python train.py` would train N lone copies: one line."""
    with pytest.raises(ConfigurationError, match=r"PET_NNODES=3 .* `phalanx launch train.py`"):
        detect_launch(trainer_v2_pod("tj", 1, 3, "auto"))


def test_pytorchjob_with_nproc_per_node_needs_a_launcher() -> None:
    env = {**pytorchjob_pod("mnist", 1, 2), "PET_NPROC_PER_NODE": "4", "WORLD_SIZE": "8"}
    with pytest.raises(ConfigurationError, match="PET_NPROC_PER_NODE=4 asks for 4 processes"):
        detect_launch(env)


def _launch_flags(environ: dict[str, str], *argv: str) -> tuple[argparse.Namespace, list[str]]:
    parser = build_parser()
    taken = environment_defaults(parser, environ)
    return parser.parse_args([*argv, "train.py"]), taken


def test_phalanx_launch_reads_trainer_v2s_variables_as_torchrun_does() -> None:
    ns, taken = _launch_flags(trainer_v2_pod("tj", 2, 3, "4"))
    assert (ns.nnodes, ns.nproc_per_node, ns.node_rank) == ("3", "4", 2)
    assert (ns.master_addr, ns.master_port) == ("tj-node-0-0.tj", 29500)
    assert taken[0] == "PET_NNODES=3"
    site = store_site(ns, 3)
    assert (site.master_addr, site.master_port, site.node_rank) == ("tj-node-0-0.tj", 29500, 2)


def test_a_flag_on_the_command_line_wins_over_its_variable() -> None:
    ns, _ = _launch_flags({"PET_NODE_RANK": "2", "PET_STANDALONE": "1"}, "--node-rank", "1")
    assert (ns.node_rank, ns.standalone) == (1, True)


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("PET_MASTER_PORT", "http", "PET_MASTER_PORT='http' is not a valid --master-port"),
        ("PET_STANDALONE", "yes", "PET_STANDALONE='yes' is not 0 or 1"),
        ("PET_START_METHOD", "thread", "PET_START_METHOD='thread' is not one of"),
    ],
)
def test_a_bad_variable_is_named(variable: str, value: str, says: str) -> None:
    with pytest.raises(UsageError, match=says):
        _launch_flags({variable: value})


def test_phalanx_launch_takes_the_completion_index_as_node_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """JobSet: `phalanx launch --nnodes 4 --master-addr ...` in each pod, no --node-rank."""
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "3")
    ns, _ = _launch_flags({}, "--nnodes", "4", "--master-addr", "js-workers-0-0.js")
    site = store_site(ns, 4)
    assert site.node_rank == 3 and not site.rdzv.hosts_store
    assert "node rank 3 from JOB_COMPLETION_INDEX" in site.notes[-1]
    ns, _ = _launch_flags({}, "--nnodes", "4", "--master-addr", "x", "--node-rank", "1")
    assert store_site(ns, 4).node_rank == 1  # the flag wins
