"""A relayed line carries one rank tag: the launcher's (issue 36, item 11).

torch's excepthook tags every traceback line with the rank in torch's group
(`[rank0]: ...`). The launcher used to strip the tag only when that rank was its own,
so a worker whose torch rank differs (a live-recovery replacement starts as rank 0 of
its own group) came out as `[rank 1] [rank0]: Traceback ...`.
"""

from __future__ import annotations

import io
import os

import pytest

from phalanx.launch.output import OutputSink, RankOutput, StreamTarget


def _relay(rank: int, stderr_lines: list[bytes]) -> list[str]:
    """What the console shows for a worker of launcher rank `rank` writing `stderr_lines`
    (real pipes and the launcher's own pump threads)."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    console_out, console_err = io.BytesIO(), io.BytesIO()
    sink = OutputSink(io.TextIOWrapper(console_out), io.TextIOWrapper(console_err))
    output = RankOutput(
        rank,
        os.fdopen(out_r, "rb"),
        os.fdopen(err_r, "rb"),
        sink,
        (StreamTarget(), StreamTarget()),
        [],
    )
    os.close(out_w)
    with os.fdopen(err_w, "wb") as err:
        err.write(b"".join(stderr_lines))
    output.join(timeout_s=10)
    return console_err.getvalue().decode().splitlines()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("torch_rank", [0, 1, 12])
def test_torch_rank_tag_is_dropped_whatever_rank_it_names(torch_rank: int) -> None:
    lines = _relay(
        1,
        [
            f"[rank{torch_rank}]: Traceback (most recent call last):\n".encode(),
            f'[rank{torch_rank}]:   File "x.py", line 1\n'.encode(),
            b"plain line\n",
        ],
    )
    assert lines == [
        "[rank 1] Traceback (most recent call last):",
        '[rank 1]   File "x.py", line 1',
        "[rank 1] plain line",
    ]


@pytest.mark.timeout(30)
def test_text_that_only_looks_like_a_tag_stays() -> None:
    lines = _relay(2, [b"[rank two]: kept\n", b"loss [rank0]: kept too\n"])
    assert lines == ["[rank 2] [rank two]: kept", "[rank 2] loss [rank0]: kept too"]
