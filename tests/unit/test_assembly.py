"""Live recovery's re-deal: every old rank's pieces stream past, each rank keeps its new rows."""

from __future__ import annotations

import math

import pytest
import torch

from phalanx.optim.zero_state import Assembly, Wanted, whole_from_pieces
from phalanx.parallel.sharding import piece_of, row_numel

SHAPES = [torch.Size([7, 3]), torch.Size([5]), torch.Size([2, 2, 2])]


def _wholes() -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g) for s in SHAPES]
    state = [
        {"exp_avg": torch.randn(s, generator=g), "exp_avg_sq": torch.rand(s, generator=g)}
        for s in SHAPES
    ]
    return params, state


def _bundles(world: int) -> list[dict[str, torch.Tensor]]:
    """Each old rank's rows, as stage 3's live_pieces gives them."""
    params, state = _wholes()
    bundles: list[dict[str, torch.Tensor]] = []
    for rank in range(world):
        bundle: dict[str, torch.Tensor] = {}
        for i, shape in enumerate(SHAPES):
            piece = piece_of(math.prod(shape), world, rank, row_numel(shape))
            bundle[f"p{i}"] = params[i].reshape(-1)[piece.start : piece.stop].clone()
            for key, value in state[i].items():
                bundle[f"s{i}.{key}"] = value.reshape(-1)[piece.start : piece.stop].clone()
            bundle[f"s{i}.step"] = torch.tensor(4.0)
        bundles.append(bundle)
    return bundles


def _rows_for(rank: int, world: int) -> Wanted:
    def rows(shape: torch.Size) -> tuple[int, int]:
        piece = piece_of(math.prod(shape), world, rank, row_numel(shape))
        return piece.start, piece.stop

    return rows


@pytest.mark.parametrize(("old", "new"), [(3, 2), (2, 3), (3, 3), (2, 8)])
def test_each_rank_keeps_exactly_its_new_rows(old: int, new: int) -> None:
    params, state = _wholes()
    for rank in range(new):
        wanted = _rows_for(rank, new)
        assembly = Assembly(SHAPES, wanted)
        bundles = _bundles(old)
        for bundle in bundles:
            assembly.add(bundle)
            assert not bundle, "a bundle's pieces are taken out as they pass"
        got, got_state = assembly.finish()
        for i, shape in enumerate(SHAPES):
            start, stop = wanted(shape)
            row = row_numel(shape) or 1
            assert torch.equal(got[i], params[i][start // row : stop // row])
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(got_state[i][key], state[i][key][start // row : stop // row])
            assert got_state[i]["step"].item() == 4.0


def test_wanting_everything_gives_the_wholes() -> None:
    params, state = _wholes()
    got, got_state = whole_from_pieces(SHAPES, _bundles(3))
    for i in range(len(SHAPES)):
        assert torch.equal(got[i], params[i])
        assert list(got_state[i]) == ["exp_avg", "exp_avg_sq", "step"]
        assert torch.equal(got_state[i]["exp_avg_sq"], state[i]["exp_avg_sq"])


def test_pieces_that_do_not_cover_the_rows_are_refused() -> None:
    bundles = _bundles(3)
    assembly = Assembly(SHAPES, _rows_for(1, 2))
    for bundle in bundles[:2]:  # the last old rank's pieces never came
        assembly.add(bundle)
    with pytest.raises(AssertionError, match="pieces cover"):
        assembly.finish()
