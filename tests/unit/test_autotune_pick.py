"""bucket_cap_mb="auto"'s choice: a size replaces the default layout only when clearly faster.

Measured times of near-equal sizes differ by noise; picking the smallest of
them would switch layouts at random. No process group: `pick` is the part of
the decision every rank computes from the same all-reduced times.
"""

from __future__ import annotations

from phalanx.ddp import autotune
from phalanx.ddp.autotune import MARGIN, BucketSizeTuner

UNTIMED = -1.0


def _tuner(distinct_for: dict[float, int]) -> BucketSizeTuner:
    """A tuner whose candidates' layouts are numbered by `distinct_for` (same number:
    same layout), planned as the reducer plans it."""
    tuner = BucketSizeTuner()
    by_cap = {tuple(c): distinct_for[mb] for mb, c in zip(tuner.candidates_mb, tuner.candidates)}
    tuner._plan = tuner._make_plan(lambda caps: [[by_cap[tuple(caps)]]])
    return tuner


def test_sizes_within_the_margin_keep_the_default_layout() -> None:
    tuner = _tuner({1.0: 0, 5.0: 1, 25.0: 2, 100.0: 3})
    assert tuner.candidates_mb[tuner.pick([0.99, 0.985, 1.0, 1.01])] == 25.0
    assert tuner.candidates_mb[tuner.pick([0.99, 1.0 * (1 - MARGIN) - 1e-9, 1.0, 1.0])] == 5.0


def test_a_clearly_faster_size_is_chosen() -> None:
    tuner = _tuner({1.0: 0, 5.0: 1, 25.0: 2, 100.0: 3})
    assert tuner.candidates_mb[tuner.pick([1.2, 1.1, 1.0, 0.9])] == 100.0


def test_the_default_layout_is_whichever_candidate_shares_it() -> None:
    # 5, 25 and 100 MiB give one layout, tried once, as 5 MiB: that is the default's.
    tuner = _tuner({1.0: 0, 5.0: 1, 25.0: 1, 100.0: 1})
    per_pass = autotune.SETTLE_STEPS + autotune.TIMED_STEPS
    assert [k for k, _ in tuner._plan] == ([0] * per_pass + [1] * per_pass) * autotune.PASSES
    assert tuner.candidates_mb[tuner.pick([0.98, 1.0, UNTIMED, UNTIMED])] == 5.0
    assert tuner.candidates_mb[tuner.pick([0.9, 1.0, UNTIMED, UNTIMED])] == 1.0
