"""The one private torch call the reducer needs: run a callback when backward ends."""

from __future__ import annotations

from collections.abc import Callable

from torch.autograd import Variable


def at_end_of_backward(callback: Callable[[], None]) -> None:
    """Run `callback` once the autograd engine finishes the backward pass now running.

    Must be called from inside a backward (a gradient hook). torch 2.13 has no
    public form of this; torch's own DDP reducer and FSDP2 use the same engine
    call, so it is as stable as they are. The callback runs on the thread that
    called backward(), after every gradient of that pass was accumulated.
    """
    Variable._execution_engine.queue_callback(callback)
