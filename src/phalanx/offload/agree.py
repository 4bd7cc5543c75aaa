"""A failure to write offloaded state on one rank, raised on every rank of its group.

A full disk is per host: one rank's allocation can fail while the others'
succeed. Left alone, the failing rank raises and the others walk into their
next collective, which it never joins: gloo reports a closed connection, or
NCCL hangs until the timeout, and the disk is named nowhere. Where state is
allocated (sharding, re-homing a shard, an optimizer's state made before a
load), the ranks agree first: every rank then raises the failing rank's
line, prefixed with that rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from phalanx.errors import OffloadError
from phalanx.runtime.wire import all_gather_json


def raise_on_every_rank(failure: OffloadError | None, group: dist.ProcessGroup | None) -> None:
    """Collective over `group` (every rank calls it): raise `failure` here, or the first
    failing rank's, if any rank of the group had one."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        if failure is not None:
            raise failure
        return
    flag = torch.tensor([0 if failure is None else 1], dtype=torch.int32)
    dist.all_reduce(flag, group=group)
    if not int(flag.item()):
        return
    messages: list[Any] = all_gather_json(None if failure is None else str(failure), group)
    if failure is not None:
        raise failure
    rank, message = next((r, m) for r, m in enumerate(messages) if m is not None)
    raise OffloadError(f"rank {dist.get_global_rank(group, rank)}: {message}")
