"""The launchers watching each other under --live-recovery across hosts (launch/livenodes.py),
against a real torch TCPStore: a node whose launcher goes quiet is declared lost and its
members reported lost, a new launcher takes its rank once, and a running node keeps it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest

from phalanx.errors import ConfigurationError
from phalanx.ground.live_store import LiveStore
from phalanx.ground.runauth import RunKey, new_secret
from phalanx.ground.store_keys import lost_key, node_key
from phalanx.ground.storeclient import StoreClient
from phalanx.launch.livenodes import NodeBeat, NodeWatch, claim_live_node

KEY = RunKey(new_secret(), "test")

EVENT_S = 10.0


@pytest.fixture
def port() -> Iterator[int]:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10),
                           wait_for_workers=False)  # fmt: skip
    yield int(server.port)
    del server


def _never() -> bool:
    return False


def _until(seen: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + EVENT_S
    while not seen():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


@pytest.mark.timeout(30)
def test_a_quiet_node_is_lost_its_members_reported_then_taken_over(port: int) -> None:
    said: list[str] = []
    addr = ("127.0.0.1", port)
    with StoreClient(*addr, 5) as client:
        store = LiveStore(client, KEY)
        store.put(node_key(1, "members"), json.dumps(["r1", "j4"]))
        watch = NodeWatch(addr, 2, 0.5, said.append, KEY)
        beat = NodeBeat(addr, 1, KEY)
        try:
            _until(lambda: watch.alive() == 1, "node 1 seen")
            beat.stop()
            _until(lambda: watch.alive() == 0, "node 1 lost")
            assert "node 1 lost" in said[0] and "(r1, j4)" in said[0], said
            assert store.read(lost_key("r1")) and store.read(lost_key("j4"))
            assert claim_live_node(client, 1, KEY, 1.0, said.append, _never) is False
            assert claim_live_node(client, 1, KEY, 1.0, said.append, _never) is True
            with pytest.raises(ConfigurationError, match="taken by a node that is still running"):
                claim_live_node(client, 1, KEY, 0.3, said.append, _never)  # one loss, one taker
            beat = NodeBeat(addr, 1, KEY)
            _until(lambda: watch.alive() == 1, "node 1 back")
            assert any("node 1 is back" in line for line in said), said
            assert watch.report() == (
                "nodes lost during the run: 1 (every lost node was taken over by a new host)"
            )
        finally:
            beat.stop()
            watch.stop()


@pytest.mark.timeout(30)
def test_a_node_that_never_beat_is_not_waited_for_nor_lost(port: int) -> None:
    said: list[str] = []
    watch = NodeWatch(("127.0.0.1", port), 3, 0.2, said.append, KEY)
    try:
        time.sleep(0.6)  # three stall timeouts with no beat at all: nothing to declare
        assert watch.alive() == 0 and said == [] and watch.report() is None
    finally:
        watch.stop()


@pytest.mark.timeout(30)
def test_the_launcher_reads_garbage_as_absent(port: int) -> None:
    """A stranger's garbage where the launcher reads the generation and its members: it
    reports the loss (signed) and says once what it ignored, never a traceback."""
    from phalanx.ground.store_keys import GENERATION_KEY, abort_key, members_key
    from phalanx.launch.live import report_lost

    with StoreClient("127.0.0.1", port, 5) as client:
        client.set(GENERATION_KEY, b"\xff not a number")
        client.set(members_key(3), b"{broken")
        store = LiveStore(client, KEY)
        report_lost(store, "r1", "killed")  # generation unreadable: gen 0, r1 is in it
        assert store.read(lost_key("r1")) == "killed"
        assert store.read(abort_key(0)) == "launcher: r1 lost (killed)"
        store.put(GENERATION_KEY, "3")
        report_lost(store, "r2", "killed")  # its members unreadable: nothing to end
        assert store.read(abort_key(3)) is None and store.read(lost_key("r2")) == "killed"


@pytest.mark.timeout(30)
def test_a_watch_held_up_by_the_store_blames_no_node(port: int) -> None:
    """An etcd member lost or a leader elected holds the watch's reads and every node's
    beat alike: a node whose beat stood still only while the watch could not look is not
    lost; one that stays silent while it looks is."""
    said: list[str] = []
    watch = NodeWatch(("127.0.0.1", port), 2, 0.4, said.append, KEY)
    watch.stop()  # its ticks are driven here
    with StoreClient("127.0.0.1", port, 5) as client:
        LiveStore(client, KEY).put(node_key(1, "beat"), "launcher:1")
        watch.tick(client)
        time.sleep(0.6)  # the watch blind for longer than the stall timeout
        watch.tick(client)
        assert watch.alive() == 1 and said == [], said
        deadline = time.monotonic() + EVENT_S
        while watch.alive() == 1:  # looking, and no beat comes: lost
            assert time.monotonic() < deadline, "never declared lost"
            watch.tick(client)
            time.sleep(0.05)
        assert "node 1 lost" in said[0], said
