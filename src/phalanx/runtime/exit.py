"""Letting go of the process group: `shutdown()`, and the hook that runs it at exit.

The hook exists because of a crash after success, explained on
`_release_at_exit`: a script that trained fine must not abort at its last line.
"""

from __future__ import annotations

import atexit
import time

import torch.distributed as dist

__all__ = ["register_exit_hook", "shutdown"]

# How long the exit hook lets gloo's worker threads finish dropping their last
# collective (see `_release_at_exit`): ample for a thread that is already runnable.
_EXIT_GRACE_S = 0.05


def shutdown() -> None:
    """Destroy the default process group if there is one; calling it twice is fine."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _release_at_exit() -> None:
    """Tear the group down while the interpreter is still whole.

    A gloo worker thread frees each finished collective, and with it a
    reference to a Python tensor, just after the caller's wait returns. If
    that happens once the interpreter is finalizing, taking the GIL kills the
    thread and the process aborts ("terminate called without an active
    exception", pytorch#190489) after a run that succeeded. Anything that still
    holds the group (a `World`, a DDP module) keeps those threads alive until
    then, so destroying the group is not enough: we also release the GIL for a
    moment so a pending free runs now rather than during finalization.
    """
    shutdown()
    time.sleep(_EXIT_GRACE_S)


def register_exit_hook() -> None:
    """Run `_release_at_exit` at interpreter exit, once per process however often we init."""
    atexit.unregister(_release_at_exit)
    atexit.register(_release_at_exit)
