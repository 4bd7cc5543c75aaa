"""Where the reducer stands in the current iteration (phalanx.ddp.reducer drives it)."""

from __future__ import annotations

from enum import Enum


class Phase(Enum):
    """Where the reducer stands in the current iteration."""

    IDLE = "idle"
    """No DDP forward since the last reduction: gradients are ignored."""
    LOCAL_ARMED = "local_armed"
    """A forward ran under no_sync(): its backward only accumulates."""
    LOCAL = "local"
    """A no_sync() backward is running."""
    ARMED = "armed"
    """A synced forward ran: its backward will reduce."""
    REDUCING = "reducing"
    """A synced backward is running: buckets fill and launch in order."""
    RECORDING = "recording"
    """static_graph's first synced backward: gradients are only counted; every bucket
    goes at its end (torch's DDP does the same)."""
    REDUCED = "reduced"
    """Reduced: another gradient before the next forward is an error."""
