"""An ended generation's gloo connections are shut down (runtime/gloo_sockets.py): a
collective left blocked on them fails at once, here and on the peer, freeing its thread,
while the listening socket (whose failure would abort the process) and the next
generation's group are untouched."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from phalanx.ground.ports import free_port
from tests.harness import run_workers


def _end_a_generation(rank: int, world_size: int, port: int) -> dict[str, object]:
    from typing import cast

    import torch
    import torch.distributed as dist

    from phalanx.runtime.gloo_sockets import GroupSockets

    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0,
                          timeout=timedelta(seconds=30))  # fmt: skip
    sockets = GroupSockets()

    def group(generation: int) -> dist.ProcessGroup:
        prefix = dist.PrefixStore(f"g{generation}/", store)
        made = sockets.made(
            generation,
            lambda: dist.ProcessGroupGloo(prefix, rank, world_size, timedelta(seconds=600)),
        )
        return cast(dist.ProcessGroup, made)

    old = group(0)
    # Rank 0 starts a collective that rank 1 never joins: blocked for the group's 600 s.
    blocked = old.allreduce([torch.ones(4)]) if rank == 0 else None
    store.set(f"started/{rank}", "1")
    store.wait([f"started/{r}" for r in range(world_size)])
    new = group(1)
    shut = sockets.end_before(1)
    failed = None
    if blocked is not None:
        start = time.monotonic()
        try:
            blocked.wait(timedelta(seconds=20))
        except RuntimeError as exc:
            failed = (str(exc).splitlines()[0][:120], time.monotonic() - start)
    value = torch.full((3,), float(rank + 1))
    new.allreduce([value]).wait()
    store.set(f"left/{rank}", "1")  # rank 0 serves the store: it stays until both are done
    if rank == 0:
        store.wait([f"left/{r}" for r in range(world_size)])
    return {"shut": shut, "failed": failed, "sum": value.tolist()}


@pytest.mark.timeout(120)
def test_an_ended_generations_blocked_collective_fails_and_the_next_one_works() -> None:
    out = run_workers(_end_a_generation, 2, free_port(), init_pg=False, timeout=90)
    first, second = (o.value for o in out)
    # its connection, shut down by one side (the other's may be gone by then: gloo closes it)
    assert first["shut"] + second["shut"] >= 1, (first, second)
    assert first["failed"] is not None, first  # at once, not after its 600 s
    assert first["failed"][1] < 10, first
    assert first["sum"] == second["sum"] == [3.0, 3.0, 3.0]
