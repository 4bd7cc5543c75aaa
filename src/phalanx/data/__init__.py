"""Data loading for data-parallel training: which samples each rank reads, and how far it got."""

from __future__ import annotations

from phalanx.data.lengths import check_same_length
from phalanx.data.loader import DataLoader
from phalanx.data.sampler import DistributedSampler

__all__ = ["DataLoader", "DistributedSampler", "check_same_length"]
