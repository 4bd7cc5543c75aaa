"""The torch-free etcd client (ground/etcd.py) against three real etcd members on loopback:
what a TCPStore client offers, leases, a member lost, the quorum lost."""

from __future__ import annotations

import threading
import time

import pytest

from phalanx.errors import ConfigurationError, StoreLost
from phalanx.ground.etcd import Etcd, EtcdKV, parse_endpoints, prefix_end
from tests.etcdkit import EtcdCluster


def _kv(cluster: EtcdCluster, prefix: str = "t/", timeout_s: float = 10.0) -> EtcdKV:
    return EtcdKV(Etcd(cluster.endpoints.split(","), timeout_s), prefix)


def test_endpoints_are_parsed_as_torchrun_writes_them() -> None:
    assert parse_endpoints("h1:2379, h2:2380,http://h3:1/") == ("h1:2379", "h2:2380", "h3:1")
    assert parse_endpoints("h1") == ("h1:2379",)
    assert parse_endpoints("[::1]:2379") == ("[::1]:2379",)
    with pytest.raises(ConfigurationError, match="plain HTTP"):
        parse_endpoints("https://h1:2379")
    with pytest.raises(ConfigurationError, match="names no etcd member"):
        parse_endpoints(" , ")


def test_prefix_end_is_the_first_key_past_the_prefix() -> None:
    assert prefix_end(b"a/") == b"a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff") == b"\0"


def test_the_store_operations(etcd_cluster: EtcdCluster) -> None:
    kv = _kv(etcd_cluster)
    assert kv.read("k") is None and not kv.check(["k"])
    with pytest.raises(KeyError):
        kv.get("k")
    kv.set("k", b"\x00v\xff")
    assert kv.get("k") == b"\x00v\xff" and kv.check(["k"]) and not kv.check(["k", "j"])
    # torch's compare_set: b"" expects the key absent; a mismatch returns what is there.
    assert kv.compare_set("c", b"", b"one") == b"one"
    assert kv.compare_set("c", b"", b"two") == b"one"
    assert kv.compare_set("c", b"one", b"two") == b"two"
    assert kv.compare_set("absent", b"x", b"y") == b"x" and not kv.check(["absent"])
    assert kv.add("n", 0) == 0 and not kv.check(["n"])
    assert kv.add("n", 5) == 5 and kv.add("n", -2) == 3 and kv.get("n") == b"3"
    assert kv.num_keys() == 3
    other = kv.view("sub/")
    other.set("k", b"inner")
    assert kv.get("k") == b"\x00v\xff" and other.get("k") == b"inner" and kv.num_keys() == 4
    assert kv.delete("k") and not kv.delete("k") and not kv.check(["k"])
    assert other.check(["k"])
    assert kv.wait_for(["c", "n"], 1.0) and not kv.wait_for(["never"], 0.2)
    kv.close()


def test_counters_and_claims_hold_under_contention(etcd_cluster: EtcdCluster) -> None:
    winners: list[bytes] = []

    def claim_and_count(me: int) -> None:
        kv = _kv(etcd_cluster)
        winners.append(kv.compare_set("claim", b"", b"%d" % me))
        for _ in range(10):
            kv.add("count", 1)
        kv.close()

    threads = [threading.Thread(target=claim_and_count, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(set(winners)) == 1 and len(winners) == 4
    assert _kv(etcd_cluster).add("count", 0) == 40


def test_keys_go_with_their_lease(etcd_cluster: EtcdCluster) -> None:
    etcd = Etcd(etcd_cluster.endpoints.split(","), 10.0)
    lease, ttl = etcd.grant(2)
    assert ttl >= 2 and etcd.keepalive(lease) >= 2
    kv = EtcdKV(etcd, "leased/", lease)
    kv.set("k", b"v")
    assert kv.check(["k"])
    deadline = time.monotonic() + 30
    while kv.check(["k"]):  # no keepalive any more: gone within the TTL
        assert time.monotonic() < deadline, "the leased key outlived its lease"
        time.sleep(0.1)
    assert etcd.keepalive(lease) == 0


def test_one_member_lost_changes_nothing(etcd_cluster: EtcdCluster) -> None:
    kv = _kv(etcd_cluster)
    kv.set("before", b"1")
    etcd_cluster.stop(0)  # the member every call tries first
    kv.set("after", b"2")
    assert kv.get("before") == b"1" and kv.add("n", 1) == 1


def test_a_lost_quorum_is_one_line_naming_every_member(etcd_cluster: EtcdCluster) -> None:
    kv = _kv(etcd_cluster, timeout_s=2.0)
    kv.set("k", b"v")
    etcd_cluster.stop(1)
    etcd_cluster.stop(2)
    start = time.monotonic()
    with pytest.raises(StoreLost) as lost:
        kv.set("k", b"w")
    assert time.monotonic() - start < 10
    text = str(lost.value)
    assert "\n" not in text and "has not answered for 2s" in text, text
    for member in etcd_cluster.members:
        assert member.endpoint in text
    assert "a majority of its members is down" in text


def test_an_add_sent_twice_counts_once(etcd_cluster: EtcdCluster) -> None:
    """`Etcd.call` sends a request again when its answer is lost or late: an add that had
    committed must then read as done, not as a conflict to add once more after."""
    kv = _kv(etcd_cluster)
    assert kv.add("n", 1) == 1
    current = kv._kv("n")
    txn = kv.add_txn("n", current, 2)
    first, again = (kv.etcd.call("kv/txn", txn) for _ in range(2))
    assert kv.added(first) and kv.added(again) and kv.get("n") == b"2"
    stale = kv.add_txn("n", current, 2)  # another adder's, read before the write above
    assert not kv.added(kv.etcd.call("kv/txn", stale)) and kv.add("n", 1) == 3
    assert kv.num_keys() == 1  # the markers live outside the view
    kv.close()
