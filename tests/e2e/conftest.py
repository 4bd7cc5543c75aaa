"""Fixtures of the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from phalanx.ground.store_keys import ALL_HERE_KEY, ATTEMPT_KEY


@pytest.fixture
def master_store() -> Iterator[int]:
    """A torch store serving attempt 0, standing in for node 0's launcher on another node
    that has seen every node arrive (launch/rollcall.py)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    store.set(ATTEMPT_KEY, "0")
    store.set(ALL_HERE_KEY, "1")
    yield int(store.port)
    del store
