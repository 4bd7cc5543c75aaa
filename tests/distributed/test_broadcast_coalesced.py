"""`broadcast_coalesced` on 3 real ranks: every dtype of a device in one broadcast, as bytes.

Before each forward DDP broadcasts the buffers this way (a BatchNorm's float
statistics and its 0-dim int64 counter): one round trip, where torch makes one
per dtype. The receiving ranks must end with the source's values bit for bit,
whatever the dtypes, shapes and strides, also from a source other than rank 0
and inside a subgroup whose ranks are not the global ones.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_workers


def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(5, generator=g, dtype=torch.float32),
        torch.tensor(seed * 7 + 3, dtype=torch.int64),  # 0-dim, as num_batches_tracked
        torch.randn(3, generator=g, dtype=torch.float16),
        torch.rand(4, generator=g) > 0.5,  # bool
        torch.randn(2, 3, generator=g, dtype=torch.float64).t(),  # not contiguous
        torch.randint(0, 255, (7,), generator=g, dtype=torch.uint8),  # odd byte count
        torch.zeros(0),
        torch.randn(3, generator=g, dtype=torch.bfloat16),
        torch.randn(2, generator=g, dtype=torch.complex64),
    ]


def _bits(tensors: list[torch.Tensor]) -> list[list[int]]:
    return [t.contiguous().reshape(-1).view(torch.uint8).tolist() for t in tensors]


def _broadcast(rank: int, world_size: int) -> dict[str, Any]:
    from phalanx.parallel.sync import broadcast_coalesced

    out: dict[str, Any] = {}
    mine = _tensors(seed=rank)
    shapes = [(t.shape, t.stride(), t.dtype) for t in mine]
    assert dist.group.WORLD is not None
    traffic = broadcast_coalesced(mine, dist.group.WORLD, src=1)
    out["world"] = _bits(mine) == _bits(_tensors(seed=1))
    out["layout_kept"] = [(t.shape, t.stride(), t.dtype) for t in mine] == shapes
    out["collectives"] = traffic.collectives
    out["bytes"] = traffic.other_bytes
    # Global ranks 1 and 2 form a subgroup: its rank 1 is global rank 2.
    sub = dist.new_group([1, 2])
    if rank in (1, 2):
        mine = _tensors(seed=10 + rank)
        broadcast_coalesced(mine, sub, src=1)
        out["subgroup"] = _bits(mine) == _bits(_tensors(seed=12))
    return out


@pytest.mark.timeout(120)
def test_every_dtype_arrives_bit_for_bit_in_one_broadcast() -> None:
    expected_bytes = sum(t.numel() * t.element_size() for t in _tensors(0))
    outs = run_workers(_broadcast, 3, timeout=90)
    for o in outs:
        got = o.value
        assert got["world"] and got["layout_kept"], (o.rank, got)
        assert got["collectives"] == 1 and got["bytes"] == expected_bytes, got
        if o.rank in (1, 2):
            assert got["subgroup"], (o.rank, got)
