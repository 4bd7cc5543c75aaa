"""Parity over the next k members (train/live_parity.py): for every ring size, every k a
ring allows and every lost member, the survivors' contributions sum to the lost member's
bytes exactly, whatever they hold (random bytes, uneven lengths, padding)."""

from __future__ import annotations

import pytest
import torch

from phalanx.runtime.wire import pack
from phalanx.train.live_parity import (
    Fill,
    contribution,
    from_pieces,
    from_tensor,
    holders,
    needed,
    redundancy_in,
    stripe_bytes,
)


def read(flat: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return read_with(from_tensor(flat), start, stop)


def read_with(fill: Fill, start: int, stop: int) -> torch.Tensor:
    out = torch.full((stop - start,), 7, dtype=torch.uint8)  # filled whole, never left as is
    fill(start, out)
    return out


def _parity(holder: int, flats: list[torch.Tensor], k: int, stripe: int) -> torch.Tensor:
    """What `exchange` leaves on `holder`: stripe j-1 of member holder-j, summed over j."""
    n, out = len(flats), torch.zeros(stripe, dtype=torch.uint8)
    for j in range(1, k + 1):
        out.add_(read(flats[(holder - j) % n], (j - 1) * stripe, j * stripe))
    return out


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7])
def test_any_one_lost_member_is_rebuilt_from_parity_and_the_others(n: int) -> None:
    generator = torch.Generator().manual_seed(n)
    lengths = [int(x) for x in torch.randint(1, 400, (n,), generator=generator)]
    flats = [torch.randint(0, 256, (m,), dtype=torch.uint8, generator=generator) for m in lengths]
    for k in range(1, n):
        stripe = stripe_bytes(max(lengths), k)
        parities = [_parity(h, flats, k, stripe) for h in range(n)]
        assert all(p.numel() * k >= max(lengths) for p in parities)  # 1/k of the longest
        for lost in range(n):
            total = torch.zeros(k * stripe, dtype=torch.uint8)
            for me in range(n):
                if me != lost:
                    own = from_tensor(flats[me])
                    total.add_(contribution(lost, me, n, k, stripe, own, parities[me]))
            total.add_(contribution(lost, None, n, k, stripe, None, None))  # a replacement
            assert torch.equal(total[: lengths[lost]], flats[lost]), (n, k, lost)
            assert not total[lengths[lost] :].any()  # the padding comes back as zeros


def test_who_holds_and_who_is_needed() -> None:
    assert holders(2, 5, 2) == [3, 4] and holders(4, 5, 2) == [0, 1]
    assert needed(2, 5, 2) == {1, 3}  # 3's parity has 1's stripe, 4's has 3's
    assert needed(0, 2, 1) == set()  # a whole copy: nobody else's snapshot
    assert redundancy_in(3, 2) == 2 and redundancy_in(2, 2) == 1 and redundancy_in(1, 4) == 0
    assert stripe_bytes(10, 3) == 4 and stripe_bytes(9, 3) == 3


def test_read_pads_past_the_end() -> None:
    flat = torch.arange(5, dtype=torch.uint8)
    assert read(flat, 3, 8).tolist() == [3, 4, 0, 0, 0] and read(flat, 6, 8).tolist() == [0, 0]


def test_the_pieces_read_where_they_lie_as_their_run_of_bytes() -> None:
    pieces = {"a": torch.arange(5, dtype=torch.float32), "b": torch.arange(3), "c": torch.ones(0)}
    header, blob = pack(pieces)
    fill = from_pieces(header, pieces)
    for start in range(0, blob.numel() + 4, 3):
        assert torch.equal(read_with(fill, start, start + 7), read(blob, start, start + 7))
