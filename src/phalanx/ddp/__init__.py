"""Our own DistributedDataParallel: bucketed, overlapped gradient all-reduce."""

from __future__ import annotations

from phalanx.ddp.module import DistributedDataParallel
from phalanx.ddp.reducer import Phase, Reducer, ReducerStats

__all__ = ["DistributedDataParallel", "Phase", "Reducer", "ReducerStats"]
