"""Launcher detection, node-list parsing, backend and timeout checks: no process group."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from phalanx.errors import ConfigurationError, PhalanxError
from phalanx.ground.jobenv import (
    LaunchInfo,
    detect_launch,
    expand_nodelist,
    expand_tasks_per_node,
    global_rank,
)
from phalanx.runtime import launched_by_launcher, parse_timeout, resolve_backend

TORCHRUN = {
    "RANK": "5",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "8",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29400",
}


def slurm_env(**overrides: str) -> dict[str, str]:
    """An srun task: rank 5 of 8, second node of a two-node job step."""
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_NODELIST": "gpu-a[01-04,07],cpu7",
        "SLURM_JOB_ID": "123456",
        "SLURM_STEP_ID": "0",
    }
    env.update(overrides)
    return env


def ompi_env(rank: int, size: int, local_rank: int, local_size: int) -> dict[str, str]:
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
    }


# --- torchrun / phalanx launch ---------------------------------------------------------


def test_torchrun_env_is_read_field_by_field() -> None:
    info = detect_launch(TORCHRUN)
    assert info == LaunchInfo("env", 5, 1, 8, 4, 1, "10.0.0.1", 29400)
    assert launched_by_launcher(TORCHRUN)


def test_torchrun_env_without_group_rank_derives_the_node() -> None:
    env = {k: v for k, v in TORCHRUN.items() if k != "GROUP_RANK"}
    assert detect_launch(env).node_rank == 5 // 4


def test_block_placement_derives_what_the_launcher_numbers() -> None:
    """Node and local rank derived from RANK alone give back RANK: one convention both ways."""
    for rank in range(8):
        env = {k: v for k, v in TORCHRUN.items() if k not in ("GROUP_RANK", "LOCAL_RANK")}
        info = detect_launch({**env, "RANK": str(rank)})
        assert global_rank(info.node_rank, info.local_world_size, info.local_rank) == rank


def test_torchrun_agent_store_is_joined_not_hosted() -> None:
    info = detect_launch({**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert info.agent_store
    assert not detect_launch(TORCHRUN).agent_store


def test_env_launcher_wins_over_slurm_and_mpi() -> None:
    env = {**slurm_env(), **ompi_env(0, 2, 0, 2), **TORCHRUN}
    assert detect_launch(env).launcher == "env"


def test_single_process_torchrun_needs_no_master() -> None:
    info = detect_launch({"RANK": "0", "WORLD_SIZE": "1"})
    assert (info.launcher, info.world_size, info.master_addr) == ("env", 1, None)


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"RANK": "0"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR"),
        ({**TORCHRUN, "RANK": "x"}, "RANK='x'"),
        ({**TORCHRUN, "RANK": "8"}, "rank 8"),
        ({**TORCHRUN, "LOCAL_RANK": "4"}, "local rank 4"),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, "master port"),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE=0"),
    ],
)
def test_inconsistent_env_is_a_configuration_error(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigurationError, match="—") as caught:
        detect_launch(env)
    assert fragment in str(caught.value)


# --- SLURM ------------------------------------------------------------------------------


def test_slurm_task_is_read_with_master_from_the_node_list() -> None:
    info = detect_launch(slurm_env())
    assert (info.launcher, info.rank, info.world_size) == ("slurm", 5, 8)
    assert (info.local_rank, info.local_world_size, info.node_rank) == (1, 4, 1)
    assert info.master_addr == "gpu-a01"
    assert launched_by_launcher(slurm_env())


def test_slurm_master_addr_and_port_from_env_win() -> None:
    info = detect_launch(slurm_env(MASTER_ADDR="head", MASTER_PORT="31000"))
    assert (info.master_addr, info.master_port) == ("head", 31000)


def test_slurm_port_is_derived_from_the_job_id() -> None:
    ports = {detect_launch(slurm_env(SLURM_JOB_ID=str(j))).master_port for j in range(1000, 1100)}
    assert len(ports) == 100, "consecutive jobs must not share a port"
    assert all(p is not None and 1024 < p < 32768 for p in ports)
    assert detect_launch(slurm_env()).master_port == detect_launch(slurm_env()).master_port
    step1 = detect_launch(slurm_env(SLURM_STEP_ID="1")).master_port
    assert step1 != detect_launch(slurm_env()).master_port


def test_slurm_step_variables_describe_the_step_not_the_job() -> None:
    env = slurm_env(
        SLURM_STEP_NUM_TASKS="3",
        SLURM_STEP_TASKS_PER_NODE="2,1",
        SLURM_STEP_NODELIST="gpu-a[03-04]",
        SLURM_PROCID="2",
        SLURM_LOCALID="0",
    )
    info = detect_launch(env)
    assert (info.world_size, info.local_world_size, info.master_addr) == (3, 1, "gpu-a03")


@pytest.mark.parametrize(
    ("per_node", "node", "local_world"),
    [
        ({"SLURM_TASKS_PER_NODE": "2(x3),1"}, "3", 1),
        ({"SLURM_TASKS_PER_NODE": "2(x3),1"}, "2", 2),
        ({"SLURM_TASKS_PER_NODE": "", "SLURM_NTASKS_PER_NODE": "4"}, "1", 4),
        ({"SLURM_TASKS_PER_NODE": "", "SLURM_JOB_NUM_NODES": "2"}, "1", 4),
    ],
)
def test_slurm_tasks_per_node_forms(per_node: dict[str, str], node: str, local_world: int) -> None:
    env = slurm_env(SLURM_NTASKS="7" if "2(x3)" in str(per_node) else "8", SLURM_NODEID=node)
    env.update(per_node)
    env.update(SLURM_LOCALID="0", SLURM_PROCID="6")
    assert detect_launch(env).local_world_size == local_world


@pytest.mark.parametrize(
    "env",
    [
        {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"},  # one-task step
        {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"},  # salloc shell: no task of a step
        {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0"},
    ],
)
def test_slurm_without_a_distributed_step_is_a_world_of_one(env: dict[str, str]) -> None:
    assert detect_launch(env) == LaunchInfo("none", 0, 0, 1, 1, 0, None, None)
    assert not launched_by_launcher(env)


def test_slurm_without_node_list_or_master_says_what_to_export() -> None:
    env = {k: v for k, v in slurm_env().items() if k != "SLURM_JOB_NODELIST"}
    with pytest.raises(ConfigurationError, match="MASTER_ADDR"):
        detect_launch(env)


# --- node lists -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node7", ["node7"]),
        ("a,b", ["a", "b"]),
        ("gpu-a[01-04,07],cpu7", ["gpu-a01", "gpu-a02", "gpu-a03", "gpu-a04", "gpu-a07", "cpu7"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("x[3],y[1,5]z", ["x3", "y1z", "y5z"]),
        ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["n[1-", "n]1[", "n[a-b]", "n[5-2]", "n[[1]]", "", ","])
def test_malformed_nodelist_names_the_bypass(nodelist: str) -> None:
    with pytest.raises(ConfigurationError, match="MASTER_ADDR"):
        expand_nodelist(nodelist)


@pytest.mark.parametrize(
    ("spec", "counts"),
    [("4", [4]), ("2(x3)", [2, 2, 2]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3])],
)
def test_expand_tasks_per_node(spec: str, counts: list[int]) -> None:
    assert expand_tasks_per_node(spec) == counts


def test_malformed_tasks_per_node_is_reported() -> None:
    with pytest.raises(ConfigurationError, match="2\\(x3\\)"):
        expand_tasks_per_node("2(3)")


# --- MPI --------------------------------------------------------------------------------


def test_ompi_single_node_uses_loopback() -> None:
    info = detect_launch(ompi_env(2, 4, 2, 4))
    assert (info.launcher, info.rank, info.local_rank, info.node_rank) == ("mpi", 2, 2, 0)
    assert info.master_addr == "127.0.0.1" and info.master_port is not None


def test_ompi_multi_node_with_master_addr() -> None:
    env = {**ompi_env(5, 8, 1, 4), "MASTER_ADDR": "head", "MASTER_PORT": "29555"}
    info = detect_launch(env)
    assert info == LaunchInfo("mpi", 5, 1, 8, 4, 1, "head", 29555)


def test_ompi_multi_node_without_master_addr_says_to_export_it() -> None:
    with pytest.raises(ConfigurationError, match="export MASTER_ADDR"):
        detect_launch(ompi_env(5, 8, 1, 4))


def test_ompi_port_follows_the_job_namespace() -> None:
    a = detect_launch({**ompi_env(0, 2, 0, 2), "PMIX_NAMESPACE": "prterun-vm-101@1"})
    b = detect_launch({**ompi_env(0, 2, 0, 2), "PMIX_NAMESPACE": "prterun-vm-202@1"})
    assert a.master_port != b.master_port


def test_hydra_pmi_variables_are_read() -> None:
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    assert detect_launch(env) == LaunchInfo("mpi", 1, 1, 2, 2, 0, "127.0.0.1", 29500)


def test_slurm_wins_over_mpi() -> None:
    assert detect_launch({**ompi_env(0, 2, 0, 2), **slurm_env()}).launcher == "slurm"


def test_mpirun_with_one_rank_is_a_world_of_one() -> None:
    assert detect_launch(ompi_env(0, 1, 0, 1)).launcher == "none"


# --- no launcher ------------------------------------------------------------------------


def test_no_launcher_is_a_world_of_one() -> None:
    info = detect_launch({"PATH": "/usr/bin", "HOME": "/root"})
    assert info == LaunchInfo("none", 0, 0, 1, 1, 0, None, None)
    assert not launched_by_launcher({})


# --- backend ----------------------------------------------------------------------------


def test_default_backend_follows_the_hardware() -> None:
    assert resolve_backend(None, cuda_available=False) == "gloo"
    expected = "nccl" if torch.cuda.is_available() else "gloo"
    assert resolve_backend(None) == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_nccl_without_gpu_names_gloo() -> None:
    with pytest.raises(ConfigurationError) as caught:
        resolve_backend("nccl")
    message = str(caught.value)
    assert "nccl" in message and "gloo" in message and "—" in message


def test_nccl_in_a_per_device_backend_is_checked_too() -> None:
    with pytest.raises(ConfigurationError, match="gloo"):
        resolve_backend("cpu:gloo,cuda:nccl", cuda_available=False)


@pytest.mark.parametrize("name", ["gloo", "GLOO", " gloo ", "cpu:gloo"])
def test_gloo_spellings_are_accepted(name: str) -> None:
    assert resolve_backend(name, cuda_available=False) == name.strip().lower()


@pytest.mark.parametrize("name", ["glooo", "tcp", ""])
def test_unknown_backend_lists_what_is_available(name: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        resolve_backend(name, cuda_available=False)
    assert "'gloo'" in str(caught.value)


def test_backend_missing_from_this_build_lists_what_is_available() -> None:
    import torch.distributed as dist

    if dist.is_mpi_available():
        pytest.skip("this torch build has MPI")
    with pytest.raises(ConfigurationError, match=r"not available.*'gloo'"):
        resolve_backend("mpi", cuda_available=False)


# --- timeout ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(1800.0, 1800.0), (3, 3.0), (0.5, 0.5), (timedelta(minutes=2), 120.0)],
)
def test_timeout_accepts_seconds_and_timedelta(value: float | timedelta, seconds: float) -> None:
    assert parse_timeout(value) == timedelta(seconds=seconds)


@pytest.mark.parametrize(
    "value", [0, -1, 0.0, float("inf"), float("nan"), timedelta(0), True, "30", None]
)
def test_bad_timeout_is_a_configuration_error(value: object) -> None:
    with pytest.raises(ConfigurationError, match="timeout"):
        parse_timeout(value)  # type: ignore[arg-type]


def test_errors_belong_to_the_phalanx_family() -> None:
    with pytest.raises(PhalanxError):
        parse_timeout(-5)


# --- init() failing before any group exists ---------------------------------------------


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No launcher variables, even when the test suite itself runs under srun or mpirun."""
    import os

    ours = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_")
    for name in list(os.environ):
        if name.startswith((*ours, "SLURM_", "OMPI_", "PMI_")):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_init_with_nccl_on_cpu_fails_before_building_a_group(clean_env: object) -> None:
    import torch.distributed as dist

    from phalanx.runtime import init

    with pytest.raises(ConfigurationError, match="gloo"):
        init(backend="nccl")
    assert not dist.is_initialized()


def test_init_with_misspelt_master_fails_at_once(clean_env: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from phalanx.runtime import init

    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    clean_env.setenv("MASTER_ADDR", "no-such-host.invalid")
    clean_env.setenv("MASTER_PORT", "29999")
    with pytest.raises(ConfigurationError, match="does not resolve"):
        init(backend="gloo", timeout=600)
    assert not dist.is_initialized()
