"""The order in which interleaved variants run, round after round.

A plain rotation (A B C, B C A, C A B) puts every variant in every position equally
often, but not after every other variant equally often: B follows A in two rounds of
three, A follows B in one. What ran just before a step (its cache and allocator
state, the threads it left busy) moves that step's time, so a rotation can favour
one variant. Measured here: swapping phalanx and torch DDP in a rotation moved
phalanx ÷ torch by about 1% on the CNN and the GPT.

A Williams design balances both: over one cycle of rounds each variant runs in
each position, and right after each other variant, equally often.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def cycle_length(n: int) -> int:
    """Rounds in one balanced cycle of `n` variants: n when n is even, 2n when it is odd."""
    return n if n % 2 == 0 or n == 1 else 2 * n


def balanced_order(round_index: int, variants: Sequence[T]) -> list[T]:
    """The variants in the order round `round_index` runs them (a Williams square's row)."""
    n = len(variants)
    # First row 0, 1, n-1, 2, n-2, ...; row r adds r (mod n) to every entry.
    first = [0]
    low, high = 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    r = round_index % cycle_length(n)
    row = [variants[(x + r) % n] for x in first]
    # For an odd n the rows alone leave some pairs short; their mirror images fill them.
    return row[::-1] if r >= n else row


def balanced_rounds(rounds: int, steps: int, n: int) -> int:
    """`rounds` raised to whole cycles of `n` variants, as long as each round keeps a step."""
    cycle = cycle_length(n)
    whole = -(-rounds // cycle) * cycle
    return whole if whole <= steps else rounds
