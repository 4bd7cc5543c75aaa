"""The launcher's cutting of a terminal stream into lines and progress-bar redraws."""

from __future__ import annotations

import random

from phalanx.launch.terminal import BarSplitter

STREAM = (
    b"loading\r\n"
    b"\r  0%|          | 0/3\r 33%|###       | 1/3\r 67%|######    | 2/3"
    b"\r100%|##########| 3/3\n"
    b"done\n"
    b"tail without newline"
)
LINES = [b"loading\n", b"100%|##########| 3/3\n", b"done\n", b"tail without newline\n"]
# The last state is not a redraw: its line feed makes it the line tqdm leaves behind.
BARS = [b"  0%|          | 0/3", b" 33%|###       | 1/3", b" 67%|######    | 2/3"]


def _split(chunks: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    lines: list[bytes] = []
    bars: list[bytes] = []
    splitter = BarSplitter(lines.append, bars.append)
    for chunk in chunks:
        splitter.feed(chunk)
    splitter.flush()
    return lines, bars


def test_lines_and_redraws_in_one_piece() -> None:
    lines, bars = _split([STREAM])
    assert lines == LINES
    assert bars == BARS


def test_any_chunking_gives_the_same_lines_and_final_bar_states() -> None:
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(STREAM)), rng.randint(1, 20)))
        chunks = [STREAM[a:b] for a, b in zip([0, *cuts], [*cuts, len(STREAM)])]
        lines, bars = _split(chunks)
        assert lines == LINES
        # A redraw may show up in pieces as it arrives, but each completed state is shown,
        # in order, and nothing but prefixes of states is ever drawn.
        assert [b for b in bars if b in BARS] == BARS
        states = [*BARS, LINES[1].rstrip(b"\n")]
        assert all(any(s.startswith(b) for s in states) for b in bars)
