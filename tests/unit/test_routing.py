"""torchrun's -r/-t/--local-ranks-filter semantics, per local rank and stream
(torch/distributed/elastic/multiprocessing/api.py: DefaultLogsSpecs.reify)."""

from __future__ import annotations

import pytest

from phalanx.errors import ConfigurationError
from phalanx.launch.routing import ERR, OUT, OutputRouting, parse_filters, parse_std


def test_stream_specs() -> None:
    assert parse_std("-r", "3") == 3
    assert parse_std("-r", "0:1,1:2") == {0: OUT, 1: ERR}
    for bad in ("4", "x", "0:9", "0-1"):
        with pytest.raises(ConfigurationError):
            parse_std("-r", bad)


def test_filters_keep_doubled_commas_as_commas() -> None:
    assert parse_filters("apple,orange") == ("apple", "orange")
    assert parse_filters("a,,b,c") == ("a,b", "c")


@pytest.mark.parametrize(
    ("routing", "expected"),
    [
        # (to_file OUT, to_file ERR, console OUT, console ERR) for local ranks 0 and 1.
        (OutputRouting(), [(False, False, True, True)] * 2),
        (OutputRouting(redirects=3), [(True, True, False, False)] * 2),
        (OutputRouting(tee=OUT), [(True, False, True, True)] * 2),
        (OutputRouting(redirects={0: OUT}, tee={1: 3}),
         [(True, False, False, True), (True, True, True, True)]),
        (OutputRouting(tee=3, local_ranks_filter=frozenset({1})),
         [(True, True, False, False), (True, True, True, True)]),
    ],
)  # fmt: skip
def test_where_each_stream_goes(routing: OutputRouting, expected: list[tuple[bool, ...]]) -> None:
    got = [
        (routing.to_file(r, OUT), routing.to_file(r, ERR),
         routing.to_console(r, OUT), routing.to_console(r, ERR))
        for r in (0, 1)
    ]  # fmt: skip
    assert got == expected
