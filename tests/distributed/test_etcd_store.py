"""The workers' c10d store over etcd (runtime/etcdstore.py), against three real members: the
calls torch and gloo make, a gloo group formed through it directly and through a
PrefixStore (as each live generation forms), and phalanx.init() choosing it from the
environment the launcher sets."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

from phalanx.ground.etcd import ENDPOINTS_ENV, LEASE_ENV, PREFIX_ENV, TIMEOUT_ENV
from phalanx.runtime.etcdstore import EtcdStore, etcd_store_from_env
from tests.etcdkit import EtcdCluster
from tests.harness import run_workers


def _store(cluster: EtcdCluster, prefix: str = "s/", wait_s: float = 5.0) -> EtcdStore:
    endpoints = tuple(cluster.endpoints.split(","))
    return EtcdStore(endpoints, prefix, 0, timedelta(seconds=wait_s), 10.0)


def test_the_calls_torch_makes(etcd_cluster: EtcdCluster) -> None:
    store = _store(etcd_cluster, wait_s=0.5)
    store.set("k", "text")  # torch's own store takes str too
    store.set("b", b"\x00\xff")
    assert store.get("k") == b"text" and store.get("b") == b"\x00\xff"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5 and store.get("n") == b"5"
    assert store.compare_set("c", "", "x") == b"x" and store.compare_set("c", "y", "z") == b"x"
    assert store.check(["k", "b"]) and not store.check(["k", "nope"])
    store.wait(["k"])
    with pytest.raises(dist.DistStoreError, match=r"waited 0\.5s for nope"):
        store.get("nope")
    with pytest.raises(dist.DistStoreError):
        store.wait(["nope"], timedelta(seconds=0.1))
    assert store.num_keys() == 4 and store.delete_key("k") and not store.check(["k"])
    assert store.wait_timeout == timedelta(seconds=0.5)
    prefixed = dist.PrefixStore("p", store)  # what gloo's rendezvous goes through
    prefixed.set("x", "1")
    assert store.get("p/x") == b"1" and prefixed.get("x") == b"1" and prefixed.add("m", 4) == 4
    clone = store.clone()
    assert clone.get("p/x") == b"1"


def _allreduce_over_etcd(rank: int, world: int, endpoints: str, prefixed: bool) -> list[float]:
    store: dist.Store = EtcdStore(tuple(endpoints.split(",")), "g/", 0, timedelta(seconds=60), 30.0)
    if prefixed:
        store = dist.PrefixStore("phalanx/live/g1/pg/", store)
    group = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=60))
    value = torch.tensor([float(rank + 1)])
    cast(Any, group).allreduce([value]).wait()
    return value.tolist()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("prefixed", [False, True])
def test_a_gloo_group_meets_through_it(etcd_cluster: EtcdCluster, prefixed: bool) -> None:
    outcomes = run_workers(
        _allreduce_over_etcd, 3, etcd_cluster.endpoints, prefixed, init_pg=False, timeout=90
    )
    assert [o.value for o in outcomes] == [[6.0]] * 3


def _init_over_etcd(rank: int, world: int, env: dict[str, str]) -> dict[str, Any]:
    import phalanx

    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world), TORCHELASTIC_USE_AGENT_STORE="True")
    phalanx.init(backend="gloo", timeout=60)
    value = torch.tensor([1.0])
    dist.all_reduce(value)
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    kind = type(store).__name__
    dist.destroy_process_group()
    return {"sum": value.item(), "store": kind}


@pytest.mark.timeout(120)
def test_init_builds_the_etcd_store_the_launcher_names(etcd_cluster: EtcdCluster) -> None:
    env = {
        ENDPOINTS_ENV: etcd_cluster.endpoints,
        PREFIX_ENV: "phalanx/run/a0/",
        TIMEOUT_ENV: "10",
        # MASTER_* as the launcher sets them: the first etcd member, never dialled as a store
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": etcd_cluster.endpoints.split(",")[0].rpartition(":")[2],
    }
    outcomes = run_workers(_init_over_etcd, 2, env, init_pg=False, timeout=90)
    assert [o.value for o in outcomes] == [{"sum": 2.0, "store": "EtcdStore"}] * 2


def test_the_environment_names_the_store() -> None:
    wait = timedelta(seconds=7)
    assert etcd_store_from_env({}, wait) is None
    store = etcd_store_from_env(
        {ENDPOINTS_ENV: "h1:1,h2", PREFIX_ENV: "p/", LEASE_ENV: "12", TIMEOUT_ENV: "3"}, wait
    )
    assert store is not None and store.endpoints == ("h1:1", "h2:2379")
    assert (store.prefix, store.lease, store.unavailable_s, store.wait_timeout) == (
        "p/",
        12,
        3.0,
        wait,
    )
