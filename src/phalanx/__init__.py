"""phalanx: data-parallel training for PyTorch."""

from __future__ import annotations

from phalanx.errors import ConfigurationError, PhalanxError, ReducerError

__all__ = ["ConfigurationError", "PhalanxError", "ReducerError"]
__version__ = "0.1.0"
