"""Who belongs to a live-recovery run is proven, not assumed (runtime/live.py, ground/).

Every new group's ranks show a tag that only the run's secret makes, before any data
moves: a rank without it (a stranger that slipped into gloo's rendezvous through the
store) is named by every honest rank with NotAMember. The store's values are checked
the same way: a stranger's reads as absent, a stranger's garbage in a key the members
claim is swapped out, and a key that keeps being overwritten ends in one line.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest

from phalanx.errors import StoreTampered
from phalanx.ground.live_store import LiveStore
from phalanx.ground.ports import free_port
from phalanx.ground.runauth import SECRET_ENV, RunKey, new_secret
from tests.harness import run_workers


def _form(rank: int, world_size: int, port: int, secrets: list[str]) -> str:
    import torch.distributed as dist

    from phalanx.errors import NotAMember
    from phalanx.runtime.live import LiveGroup

    os.environ[SECRET_ENV] = secrets[rank]
    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0,
                          timeout=timedelta(seconds=30))  # fmt: skip
    try:
        group = LiveGroup(store, rank, world_size, timedelta(seconds=20), RunKey.from_env())
    except NotAMember as exc:
        return f"NotAMember: {exc}"
    finally:  # rank 0 serves the store: it stays until every rank is done with it
        store.set(f"left/{rank}", "1")
        if rank == 0:
            store.wait([f"left/{r}" for r in range(world_size)])
    group._end_watch()
    return f"formed {group.members}"


@pytest.mark.timeout(120)
def test_every_rank_proves_the_run_secret() -> None:
    secret = new_secret()
    honest = run_workers(_form, 3, free_port(), [secret] * 3, init_pg=False, timeout=90)
    assert [o.value for o in honest] == ["formed ['r0', 'r1', 'r2']"] * 3
    mixed = run_workers(_form, 3, free_port(), [secret, new_secret(), secret], init_pg=False,
                        timeout=90)  # fmt: skip
    for o in (mixed[0], mixed[2]):
        assert o.value.startswith("NotAMember: generation 0: rank 1 (claiming to be r1) does "
                                  "not hold the run's secret"), o  # fmt: skip
    assert mixed[1].value.startswith("NotAMember: generation 0: rank 0"), mixed[1]


class _Overwritten:
    """A store whose key a stranger overwrites with garbage just before each compare-and-set
    (the adversary, not the store, is what this double plays)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        self.store.set(key, os.urandom(8))
        return bytes(self.store.compare_set(key, expected, desired))


def test_the_store_reads_only_what_the_run_signed() -> None:
    import torch.distributed as dist

    server: Any = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10),
                           wait_for_workers=False)  # fmt: skip
    ours, theirs = RunKey(new_secret(), "run"), RunKey(new_secret(), "run")
    store, stranger = LiveStore(server, ours), LiveStore(server, theirs)
    stranger.put("k", "forged")  # another secret: absent to us
    assert store.read("k") is None
    server.set("copied", server.get("k"))  # a signed value moved to another key: absent too
    assert store.read("copied") is None
    server.set("claim", b"\x00garbage")
    assert store.first("claim", "mine") == "mine"  # garbage swapped out, never the answer
    assert store.first("claim", "later") == "mine"  # the first claim of the run holds
    store.put("n", "not a number")
    assert store.read_int("n") is None and store.read_json("n") is None
    with pytest.raises(StoreTampered, match="keeps being overwritten by someone outside"):
        LiveStore(_Overwritten(server), ours).first("hot", "mine")
