"""The test harness starts ranks again on a new port when the store's was taken first (by
another pytest worker's processes), instead of failing the test: one such collision made
every test of a file error at setup (EADDRINUSE on rank 0)."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

import tests.harness as harness


def _rank_of(rank: int, world: int) -> int:
    return dist.get_rank()


@pytest.mark.timeout(120)
def test_a_taken_store_port_is_a_new_start_not_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    real = harness.free_port
    with socket.create_server(("127.0.0.1", 0)) as taken:  # listening: a bind fails
        ports = iter([taken.getsockname()[1]])
        monkeypatch.setattr(harness, "free_port", lambda: next(ports, None) or real())
        outcomes = harness.run_workers(_rank_of, 2, timeout=90)
    assert [o.value for o in outcomes] == [0, 1]
