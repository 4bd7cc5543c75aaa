"""Data loading for data-parallel training: which samples each rank reads."""

from __future__ import annotations

from phalanx.data.sampler import DistributedSampler

__all__ = ["DistributedSampler"]
