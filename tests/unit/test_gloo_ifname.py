"""The one GLOO_SOCKET_IFNAME policy (`netif.choose_gloo_ifname`), and proof that the
launcher and the workers' `phalanx.init()` now reach the same decision.

Routing is faked: `route_interface` answers a fixed interface for a documentation
address (TEST-NET-1), so the decisions do not depend on this host's network.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest

from phalanx import runtime
from phalanx.ground import netif
from phalanx.ground.jobenv import LaunchInfo
from phalanx.launch.config import LaunchConfig
from phalanx.launch.workerenv import gloo_ifname_env

MASTER = "192.0.2.10"  # TEST-NET-1: not loopback, never a real host
ROUTE = "eth-route"


@pytest.fixture(autouse=True)
def fake_route(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netif, "route_interface", lambda host: ROUTE if host == MASTER else None)


def _choose(world: int, local_world: int, master: str = MASTER, **env: str) -> netif.GlooIfname:
    return netif.choose_gloo_ifname(master, world, local_world, env)


def test_world_of_one_needs_no_interface() -> None:
    assert _choose(1, 1) == netif.GlooIfname(None, None)


def test_one_host_with_a_loopback_master_is_left_alone() -> None:
    assert _choose(4, 4, master="127.0.0.1") == netif.GlooIfname(None, None)


def test_two_hosts_pin_the_route_to_the_master() -> None:
    choice = _choose(4, 2)
    assert choice.name == ROUTE and not choice.warning
    assert f"GLOO_SOCKET_IFNAME={ROUTE}" in (choice.note or "")


def test_one_host_with_a_non_loopback_master_pins_it_too() -> None:
    assert _choose(2, 2).name == ROUTE


@pytest.mark.parametrize("var", netif.USER_IFNAME_VARS)
def test_a_users_interface_wins(var: str) -> None:
    choice = _choose(4, 2, **{var: "eth7"})
    assert choice.name is None
    assert f"{var}=eth7" in (choice.note or "")


def test_an_empty_user_value_is_no_choice() -> None:
    """Gloo reads GLOO_SOCKET_IFNAME="" as unset, so it would fall back to the hostname."""
    assert _choose(4, 2, GLOO_SOCKET_IFNAME="").name == ROUTE


def test_no_route_warns_only_when_the_job_spans_hosts() -> None:
    spanning = _choose(4, 2, master="192.0.2.99")
    assert spanning.name is None and spanning.warning
    assert "GLOO_SOCKET_IFNAME=<interface>" in (spanning.note or "")
    assert _choose(2, 2, master="192.0.2.99") == netif.GlooIfname(None, None)


# --- launcher and worker: the cases where their two copies of the policy disagreed ----

# (world, local world, environment). Before, the launcher (multi-node only, NCCL counted,
# "" ignored) and the worker (any job, NCCL ignored, "" counted) split on each of these.
DISAGREED = {
    "nccl_ifname_set": (4, 2, {"NCCL_SOCKET_IFNAME": "eth9"}),
    "empty_gloo_ifname": (4, 2, {"GLOO_SOCKET_IFNAME": ""}),
    "one_host_non_loopback_master": (2, 2, {}),
}
EXPECTED = {
    "nccl_ifname_set": None,
    "empty_gloo_ifname": ROUTE,
    "one_host_non_loopback_master": ROUTE,
}


def _launcher_gives(world: int, local_world: int, environ: dict[str, str]) -> dict[str, str]:
    """The environment `phalanx launch` hands this node's workers."""
    config = LaunchConfig(
        command=["train.py"],
        nproc_per_node=local_world,
        nnodes=world // local_world,
        node_rank=world // local_world - 1,
        master_addr=MASTER,
        master_port=29500,
    )
    return {**environ, **gloo_ifname_env(config, environ, lambda _line: None)}


def _worker_ends_with(world: int, local_world: int, environ: dict[str, str]) -> str | None:
    """GLOO_SOCKET_IFNAME after `phalanx.init()`'s step, started with `environ`."""
    rank = world - 1
    info = LaunchInfo("env", rank, rank % local_world, world, local_world, 0, MASTER, 29500)
    mine = {k: v for k, v in os.environ.items() if k not in netif.USER_IFNAME_VARS}
    with mock.patch.dict(os.environ, {**mine, **environ}, clear=True):
        runtime._pin_gloo_interface("gloo", info)
        return os.environ.get("GLOO_SOCKET_IFNAME") or None


@pytest.mark.parametrize("case", sorted(DISAGREED))
def test_launcher_and_worker_decide_alike(case: str) -> None:
    world, local_world, environ = DISAGREED[case]
    launched = _launcher_gives(world, local_world, environ)
    under_torchrun = _worker_ends_with(world, local_world, environ)
    under_phalanx_launch = _worker_ends_with(world, local_world, launched)
    assert (launched.get("GLOO_SOCKET_IFNAME") or None) == EXPECTED[case]
    assert under_torchrun == under_phalanx_launch == EXPECTED[case]
