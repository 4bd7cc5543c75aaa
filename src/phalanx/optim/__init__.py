"""ZeRO: optimizer state (stage 1) and gradients (stage 2) sharded by elements across ranks."""

from __future__ import annotations

from phalanx.optim.zero import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer"]
