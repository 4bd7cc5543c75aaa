"""`phalanx.init()` on real gloo ranks, under each launcher's environment.

The harness starts the ranks with torchrun-style variables and no process
group (`init_pg=False`), so the group under test is the one `init` builds.
Workers rewrite their own environment first to play SLURM, mpirun, or a
plain `python` run.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest

from phalanx.ground.ports import free_port
from tests.harness import run_workers

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def _exercise_init(rank: int, world_size: int) -> dict[str, Any]:
    """init, all-reduce on the returned group, init again, shut down twice."""
    import torch
    import torch.distributed as dist

    from phalanx import runtime

    world = runtime.init(timeout=30)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total, group=world.process_group)
    again = runtime.init(timeout=30)
    fields = {
        "gathered": world.all_gather_json(rank),
        "broadcast": world.broadcast_json(f"from rank {rank}"),
        "state": [int(t.sum()) for t in world.all_gather_state(torch.full((rank + 1,), 2))],
        "summed": world.all_reduce_sum([1.0, float(rank)]),
        "rank": world.rank,
        "local_rank": world.local_rank,
        "world_size": world.world_size,
        "local_world_size": world.local_world_size,
        "node_rank": world.node_rank,
        "device": str(world.device),
        "backend": world.backend,
        "launcher": world.launcher,
        "master_addr": world.master_addr,
        "master_port": world.master_port,
        "is_main": world.is_main,
        "is_distributed": world.is_distributed,
        "sum": float(total.item()),
        "same_world_again": again == world,
        "group_is_world": world.process_group is dist.group.WORLD,
        "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
    }
    runtime.shutdown()
    fields["initialized_after_shutdown"] = dist.is_initialized()
    runtime.shutdown()
    return fields


def _forget_torchrun_vars() -> str:
    """Drop what the harness exported as torchrun would; return the port it chose."""
    for name in TORCHRUN_VARS:
        os.environ.pop(name, None)
    os.environ.pop("MASTER_ADDR", None)
    return os.environ["MASTER_PORT"]


def _as_slurm_task(rank: int, world_size: int, nodes: int) -> dict[str, Any]:
    _forget_torchrun_vars()
    per_node = world_size // nodes
    os.environ.update(
        SLURM_JOB_ID="4242",
        SLURM_STEP_ID="0",
        SLURM_PROCID=str(rank),
        SLURM_NTASKS=str(world_size),
        SLURM_LOCALID=str(rank % per_node),
        SLURM_NODEID=str(rank // per_node),
        SLURM_TASKS_PER_NODE=f"{per_node}(x{nodes})",
        # The first host is rank 0's: localhost, so the ranks meet on this machine.
        SLURM_JOB_NODELIST="localhost,phx-absent[01-03]",
    )
    return _exercise_init(rank, world_size)


def _as_mpi_rank(rank: int, world_size: int) -> dict[str, Any]:
    _forget_torchrun_vars()
    os.environ.update(
        OMPI_COMM_WORLD_RANK=str(rank),
        OMPI_COMM_WORLD_SIZE=str(world_size),
        OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
        OMPI_COMM_WORLD_LOCAL_SIZE=str(world_size),
    )
    return _exercise_init(rank, world_size)


def _as_plain_python(rank: int, world_size: int) -> dict[str, Any]:
    _forget_torchrun_vars()
    os.environ.pop("MASTER_PORT")
    return _exercise_init(rank, world_size)


def _as_two_hosts(rank: int, world_size: int, master_addr: str, ifname: str | None) -> Any:
    """Each rank claims its own node, with the master at a non-loopback address."""
    os.environ.update(MASTER_ADDR=master_addr, LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    os.environ["GROUP_RANK"] = str(rank)
    if ifname is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    return _exercise_init(rank, world_size)


def _init_expecting_failure(rank: int, world_size: int, as_rank: int, port: int) -> str:
    """Claim to be `as_rank` of 2 with nobody else there; return the error init raised."""
    from phalanx import runtime

    os.environ.update(RANK=str(as_rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    os.environ.update(LOCAL_RANK=str(as_rank), MASTER_PORT=str(port))
    try:
        runtime.init(backend="gloo", timeout=3)
    except runtime.RendezvousError as exc:
        return str(exc)
    raise AssertionError("init returned although no other rank exists")


def _describe_users_own_group(rank: int, world_size: int) -> dict[str, Any]:
    """The harness built the group (init_pg=True): init must describe it, not rebuild it."""
    import torch.distributed as dist

    from phalanx import runtime

    group = dist.group.WORLD
    world = runtime.init()
    return {
        "rank": world.rank,
        "world_size": world.world_size,
        "launcher": world.launcher,
        "same_group": world.process_group is group,
    }


def _check_common(out: list[Any], world_size: int, launcher: str) -> None:
    values = [o.value for o in out]
    for rank, v in enumerate(values):
        assert (v["rank"], v["world_size"], v["launcher"]) == (rank, world_size, launcher)
        assert v["sum"] == world_size * (world_size + 1) / 2
        assert v["same_world_again"] and v["group_is_world"]
        assert not v["initialized_after_shutdown"]
        assert (v["device"], v["backend"]) == ("cpu", "gloo")
        assert v["is_main"] == (rank == 0)
        assert v["is_distributed"] == (world_size > 1)
        # World's own collectives, on a one-rank group as on many.
        assert v["gathered"] == list(range(world_size))
        assert v["broadcast"] == "from rank 0"
        assert v["state"] == [2 * (r + 1) for r in range(world_size)]
        assert v["summed"] == [float(world_size), world_size * (world_size - 1) / 2]


@pytest.mark.timeout(120)
def test_torchrun_env() -> None:
    out = run_workers(_exercise_init, 2, init_pg=False, timeout=90)
    _check_common(out, 2, "env")
    for rank, o in enumerate(out):
        v = o.value
        assert (v["local_rank"], v["local_world_size"], v["node_rank"]) == (rank, 2, 0)
        assert v["master_addr"] == "127.0.0.1"
        # One node with a loopback master: gloo's interface is left alone.
        assert v["gloo_ifname"] is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nodes", [1, 2])
def test_slurm_env(nodes: int) -> None:
    out = run_workers(_as_slurm_task, 2, nodes, init_pg=False, timeout=90)
    _check_common(out, 2, "slurm")
    for rank, o in enumerate(out):
        v = o.value
        per_node = 2 // nodes
        assert v["master_addr"] == "localhost"
        assert (v["local_rank"], v["local_world_size"]) == (rank % per_node, per_node)
        assert v["node_rank"] == rank // per_node


@pytest.mark.timeout(120)
def test_mpi_env() -> None:
    out = run_workers(_as_mpi_rank, 2, init_pg=False, timeout=90)
    _check_common(out, 2, "mpi")
    assert {o.value["master_addr"] for o in out} == {"127.0.0.1"}


@pytest.mark.timeout(120)
def test_plain_python_is_a_real_world_of_one() -> None:
    (out,) = run_workers(_as_plain_python, 1, init_pg=False, timeout=90)
    _check_common([out], 1, "none")
    assert (out.value["master_addr"], out.value["master_port"]) == (None, None)


def _non_loopback_ipv4() -> tuple[str, str]:
    from phalanx.ground import netif

    for _index, name in socket.if_nameindex():
        address = netif.ipv4_address(name)
        if address is not None and not address.startswith("127."):
            return name, address
    pytest.skip("no interface with a non-loopback IPv4 address")


@pytest.mark.timeout(120)
def test_two_node_world_pins_gloo_to_the_route_to_the_master() -> None:
    ifname, address = _non_loopback_ipv4()
    out = run_workers(_as_two_hosts, 2, address, None, init_pg=False, timeout=90)
    _check_common(out, 2, "env")
    assert [o.value["node_rank"] for o in out] == [0, 1]
    assert [o.value["gloo_ifname"] for o in out] == [ifname, ifname]


@pytest.mark.timeout(120)
def test_users_gloo_socket_ifname_is_left_untouched() -> None:
    _ifname, address = _non_loopback_ipv4()
    out = run_workers(_as_two_hosts, 2, address, "lo", init_pg=False, timeout=90)
    _check_common(out, 2, "env")
    assert [o.value["gloo_ifname"] for o in out] == ["lo", "lo"]


@pytest.mark.timeout(60)
def test_unreachable_master_fails_with_the_address() -> None:
    port = free_port()  # closed again at once: nobody listens there
    (out,) = run_workers(_init_expecting_failure, 1, 1, port, init_pg=False, timeout=30)
    message = out.value
    assert f"127.0.0.1:{port}" in message
    assert "rank 1" in message and "MASTER_ADDR" in message and "—" in message


@pytest.mark.timeout(60)
def test_master_alone_fails_naming_the_missing_ranks() -> None:
    port = free_port()
    (out,) = run_workers(_init_expecting_failure, 1, 0, port, init_pg=False, timeout=30)
    message = out.value
    assert f"127.0.0.1:{port}" in message
    assert "rank 0 waited" in message and "for the other 1 rank; rank 1 never came" in message


def _barrier_with_rank_1_failing(rank: int, world_size: int) -> list[tuple[str, str]]:
    """Rank 1 brings each kind of error in turn; what does every rank raise?"""
    from phalanx import runtime
    from phalanx.errors import CheckpointError, PhalanxError, RendezvousError

    world = runtime.init(timeout=30)
    world.barrier_or_raise(None)  # nobody failed: a plain barrier
    raised = []
    for kind in (CheckpointError, RendezvousError, PhalanxError):
        try:
            world.barrier_or_raise(kind("disk full — free some") if rank == 1 else None)
        except PhalanxError as exc:
            raised.append((type(exc).__name__, str(exc)))
    return raised


@pytest.mark.timeout(120)
def test_barrier_or_raise_raises_one_ranks_error_on_every_rank() -> None:
    out = run_workers(_barrier_with_rank_1_failing, 2, init_pg=False, timeout=90)
    kinds = ["CheckpointError", "RendezvousError", "PhalanxError"]
    assert out[1].value == [(kind, "disk full — free some") for kind in kinds]
    assert out[0].value == [(kind, "rank 1: disk full — free some") for kind in kinds]


@pytest.mark.timeout(120)
def test_init_describes_a_group_the_user_built() -> None:
    out = run_workers(_describe_users_own_group, 2, init_pg=True, timeout=90)
    for rank, o in enumerate(out):
        assert o.value == {"rank": rank, "world_size": 2, "launcher": "env", "same_group": True}
