"""Live recovery's re-deal of stage-3 rows: each member receives only its new rows (one
all-to-all from the survivors), and a lost rank's rows from its rebuilt pieces."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.harness import run_workers

SHAPES = [torch.Size([7, 3]), torch.Size([2]), torch.Size([5, 2, 2])]
DTYPES = [torch.float32, torch.bfloat16, torch.float32]


def _wholes() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    for i, (shape, dtype) in enumerate(zip(SHAPES, DTYPES, strict=True)):
        out[f"p{i}"] = torch.randn(shape, generator=g).to(dtype)
        out[f"s{i}.exp_avg"] = torch.randn(shape, generator=g).to(dtype)
        out[f"s{i}.step"] = torch.tensor(7.0)
    return out


def _layout(rank: int, world_size: int) -> Any:  # an Assembly
    from phalanx.optim.zero_state import Assembly
    from phalanx.parallel.sharding import piece_of, row_numel

    def rows(shape: torch.Size) -> tuple[int, int]:
        piece = piece_of(math.prod(shape), world_size, rank, row_numel(shape))
        return piece.start, piece.stop

    return Assembly(SHAPES, rows)


def _piece(j: int, n: int) -> dict[str, torch.Tensor]:
    """Old rank j's pieces in a world of n."""
    held = _layout(j, n).wanted
    return {
        name: value if value.dim() == 0 else value.reshape(-1)[slice(*held(value.shape))].clone()
        for name, value in _wholes().items()
    }


def _deal(
    rank: int, world_size: int, old: int, holds: dict[int, list[int]], rebuilt: list[int]
) -> dict[str, list[Any]]:
    import torch.distributed as dist

    from phalanx.train.live_sharded import deal_rows

    assembly = _layout(rank, world_size)
    mine = {j: _piece(j, old) for j in holds.get(rank, [])}
    rebuilds: list[int] = []

    def rebuild(j: int) -> dict[str, torch.Tensor]:  # stands in for the parity all-reduce
        rebuilds.append(j)
        return _piece(j, old)

    world = dist.group.WORLD
    assert world is not None
    deal_rows(assembly, _layout, old, mine, rebuilt, rebuild, world)
    params, state = assembly.finish()
    wholes, wrong = _wholes(), []
    for i, shape in enumerate(SHAPES):
        start, stop = assembly.wanted(shape)
        row = math.prod(shape[1:]) or 1
        expect = {"p": wholes[f"p{i}"], "exp_avg": wholes[f"s{i}.exp_avg"]}
        got = {"p": params[i], "exp_avg": state[i]["exp_avg"]}
        for key, value in got.items():
            want = expect[key][start // row : stop // row]
            if value.dtype != want.dtype or not torch.equal(value, want):
                wrong.append(f"{key}{i}")
        if state[i]["step"].item() != 7.0:
            wrong.append(f"step{i}")
    return {"wrong": wrong, "rebuilds": rebuilds}


@pytest.mark.timeout(60)
def test_a_join_deals_each_member_its_new_rows() -> None:
    """Old world 2 (members 0 and 1), new world 3: the replacement holds nothing."""
    out = run_workers(_deal, 3, 2, {0: [0], 1: [1]}, [])
    assert [o.value for o in out] == [{"wrong": [], "rebuilds": []}] * 3


@pytest.mark.timeout(60)
def test_a_loss_deals_the_lost_ranks_rows_from_its_rebuilt_pieces() -> None:
    """Old world 3, old rank 1 lost: the survivors hold 0 and 2, now ranks 0 and 1."""
    out = run_workers(_deal, 2, 3, {0: [0], 1: [2]}, [1])
    assert [o.value for o in out] == [{"wrong": [], "rebuilds": [1]}] * 2
