"""A setting that cannot apply where the run is: said once, by rank 0, as a warning.

Under Ray Train, say, the process group exists before the user's function runs
and the function runs off the main thread: a `ddp_timeout`, a `ddp_backend` or
`save_on_signal` asked for there would otherwise be dropped without a word.
Every rank drops it alike, so rank 0 alone says so (one line, not one per rank).
"""

from __future__ import annotations

import warnings

__all__ = ["SettingIgnoredWarning", "warn_ignored"]


class SettingIgnoredWarning(UserWarning):
    """A setting the run asked for cannot apply here; the run goes on without it."""


def warn_ignored(message: str, rank: int) -> None:
    """Warn on rank 0 (Python shows a warning once per place that raises it)."""
    if rank == 0:
        warnings.warn(message, SettingIgnoredWarning, stacklevel=3)
