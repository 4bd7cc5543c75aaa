"""`profiled` opens a record_function span only while a torch profiler records."""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import profile

from phalanx.parallel.autograd import profiled


def test_a_span_only_while_a_profiler_records() -> None:
    assert isinstance(profiled("phalanx.test"), contextlib.nullcontext)
    with profile() as prof, profiled("phalanx.test"):
        torch.ones(4).sum()
    assert [e.name for e in prof.events()].count("phalanx.test") == 1
    assert isinstance(profiled("phalanx.test"), contextlib.nullcontext)
