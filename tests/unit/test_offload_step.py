"""The offloaded step's I/O savings, on real files: cleared gradients dropped unwritten (their
blocks kept), and torch's fused AdamW where the choice was left to torch.

The offloaded step writes back and drops each window of parameters and state,
but a gradient is dead once zero_grad clears it: writing it back (and reading
it in again before the next backward overwrites it) is I/O for nothing. These
tests check, on real files, that `OffloadFiles.discard` zeroes a tensor by
dropping its dirty pages without keeping them, that the file keeps its blocks
(the next write cannot meet a full disk), and that a streamed optimizer's step
does not count its gradients as written while zero_grad discards them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from phalanx.offload import OffloadFiles, stream_optimizer


@pytest.fixture
def files(tmp_path: Path) -> Iterator[OffloadFiles]:
    out = OffloadFiles(tmp_path, 0, "test")
    if not out.can_discard:
        out.close()
        pytest.skip(f"{tmp_path}'s filesystem has no FALLOC_FL_ZERO_RANGE")
    yield out
    out.close()


def test_discard_zeroes_drops_the_pages_and_keeps_the_blocks(files: OffloadFiles) -> None:
    grad = files.tensor((8 * 2**20 // 4,), torch.float32)
    grad.fill_(3.0)  # 8 MB of dirty pages
    region = files.region(grad)
    assert region is not None
    assert files.resident_bytes() >= grad.nbytes
    files.discard([grad])
    # mincore on a file mapping reports the page cache: dropped there, not just unmapped
    assert files.resident_bytes() == 0, "the pages are still in memory"
    assert os.stat(region.path).st_blocks * 512 >= grad.nbytes, "the blocks were given back"
    assert float(grad.abs().max()) == 0.0, "a discarded tensor must read as zeros"


def test_a_streamed_step_leaves_file_gradients_to_zero_grad(files: OffloadFiles) -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(files.copy(torch.randn(4096))) for _ in range(3)]
    for p in params:
        p.grad = files.copy(torch.randn(4096))
    opt = torch.optim.AdamW(params, lr=0.1)
    streamer = stream_optimizer(opt, files, window_bytes=4096 * 4 * 4)
    opt.step()
    streamer.drain()
    param_and_state = sum(3 * p.numel() * 4 for p in params)  # the parameter, exp_avg, exp_avg_sq
    assert streamer.stats.written_bytes == param_and_state, "the step wrote its gradients back"
    grads = [p.grad for p in params]
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    discarded = all(g is not None and float(g.abs().max()) == 0.0 for g in grads)
    assert discarded, "zero_grad did not discard them"
    streamer.close()


def test_a_streamed_adamw_steps_fused_where_torch_was_left_to_choose(
    files: OffloadFiles,
) -> None:
    torch.manual_seed(0)
    values = [torch.randn(4096) for _ in range(3)]
    grads = [[torch.randn(4096) for _ in values] for _ in range(5)]

    def run(streamed: bool, **options: Any) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(files.copy(v) if streamed else v.clone()) for v in values]
        opt = torch.optim.AdamW(params, lr=0.1, **options)
        streamer = stream_optimizer(opt, files, window_bytes=4096 * 4 * 4) if streamed else None
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            opt.step()
        if streamer is not None:
            assert opt.param_groups[0]["fused"] is None, "the group's setting was not restored"
            streamer.close()
        return [p.detach().clone() for p in params]

    streamed, fused, looped = run(True), run(False, fused=True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(streamed, fused, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(fused, looped, strict=True)), (
        "fused and per-tensor AdamW agree bit for bit here: the test cannot tell them apart"
    )
    explicit = run(True, foreach=False)  # the user's choice stands
    assert all(torch.equal(a, b) for a, b in zip(explicit, looped, strict=True))
