"""Agree on a failure: when one rank fails alone, every rank of its group raises.

A rank that fails by itself (rank 0 writing a checkpoint, one host's full disk,
one rank's callback) would otherwise leave the others waiting in their next
collective until the timeout, or reading a closed connection that names
nothing. Every path that can fail on some ranks only ends in this one
collective: the ranks that failed raise their own error, the others the
first failing rank's, of the same class.

One int32 all-reduce when nothing failed (a barrier in effect); the messages
travel, as JSON, only when something did.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from phalanx import errors
from phalanx.errors import PhalanxError
from phalanx.runtime.wire import all_gather_json, group_device

__all__ = ["raise_on_every_rank"]

# The classes re-raised by name on the ranks that did not fail: phalanx.errors' own.
_KINDS: dict[str, type[PhalanxError]] = {name: getattr(errors, name) for name in errors.__all__}


def raise_on_every_rank(
    error: PhalanxError | None,
    group: dist.ProcessGroup | None = None,
    *,
    name_the_rank: bool = True,
) -> None:
    """Collective over `group` (every rank calls it): raise if any rank passed an error.

    A failing rank raises its own `error`; the others raise the first failing
    rank's message, as the same class (a `PhalanxError` if it is none of
    phalanx.errors'), prefixed with that rank's global rank unless
    `name_the_rank` is False (for a message that names its ranks already).
    Outside a group, or in a group of one, it raises `error` if there is one.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=group_device(group))
    dist.all_reduce(flag, group=group)
    if not int(flag.item()):
        return
    mine = None if error is None else (type(error).__name__, str(error))
    failures = [(r, f) for r, f in enumerate(all_gather_json(mine, group)) if f is not None]
    if error is not None:
        raise error
    rank, (kind, message) = failures[0]
    prefix = f"rank {dist.get_global_rank(group, rank) if group is not None else rank}: "
    raise _KINDS.get(kind, PhalanxError)((prefix if name_the_rank else "") + message)
