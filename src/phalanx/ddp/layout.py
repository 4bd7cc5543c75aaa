"""Where the buckets' shape comes from: the parameter order, and the size caps.

The order starts as reverse registration (the last layers' gradients are
ready first) and is replaced once, before the second training forward, by
the order the gradients really arrived in on rank 0, broadcast so that every
rank builds the same buckets. The caps are `bucket_cap_mb`'s, or with
`bucket_cap_mb="auto"` the tuner's candidates and then its choice
(phalanx.ddp.autotune). The reducer builds whatever this plan says.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from phalanx.ddp.autotune import BucketSizeTuner
from phalanx.ddp.buckets import assign_buckets
from phalanx.parallel.sync import rank0_order
from phalanx.parallel.traffic import Collective, ReducerStats, Traffic


class BucketPlan:
    """The order and caps the buckets are built from, and when they change."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        caps: Sequence[int],
        group: dist.ProcessGroup,
        device: torch.device,
        stats: ReducerStats,
        *,
        tune: bool,
    ) -> None:
        self.params = params
        self.group = group
        self.device = device
        self.stats = stats
        self.order = list(reversed(range(len(params))))
        """Parameter indices in expected gradient arrival order."""
        self.tuner = BucketSizeTuner() if tune else None
        """bucket_cap_mb="auto": tries sizes during the first steps."""
        self.caps = self.tuner.initial_caps() if self.tuner else list(caps)
        """Bucket k of a (device, dtype) closes at caps[k] bytes (the last cap repeats)."""
        self.arrival: list[int] = []
        """The first backward's gradient order (the reducer's hook appends to it)."""
        self.rebuilt = False
        """Whether the order is the arrival order already (it changes once)."""

    def layout(self, caps: list[int] | None = None) -> list[list[int]]:
        """Parameter indices per bucket, in launch order, for `caps` (default: the current)."""
        return assign_buckets(self.params, self.order, self.caps if caps is None else caps)

    def rebuild_due(self, backwards_seen: int) -> bool:
        """Whether the next synced forward takes the arrival order (once, after a backward)."""
        return not self.rebuilt and backwards_seen > 0

    def before_sync_forward(self, rebuild: bool) -> bool:
        """Before a grad-enabled synced forward; True when the buckets must be built again.

        `rebuild`: take the arrival order now (every rank decides it alike).
        """
        changed = self._take_arrival_order() if rebuild else False
        if self.tuner is not None and not self.tuner.done and self.rebuilt:
            caps = self.tuner.next_caps(self.layout, self.group, self.device, self.stats)
            if caps is not None:
                before = self.layout()
                self.caps = caps
                self.stats.rebuilds += 1
                changed = changed or self.layout() != before
        return changed

    def _take_arrival_order(self) -> bool:
        """Rank 0's arrival order, on every rank; True if it changes the layout."""
        self.rebuilt = True
        # A parameter counted several times (static_graph's first backward) is ready at
        # its last gradient: keep that arrival.
        arrival = list(dict.fromkeys(reversed(self.arrival)))[::-1]
        n = len(self.params)
        seen = rank0_order(arrival, n, self.group, self.device)
        world_size = dist.get_world_size(self.group)
        self.stats.add(Traffic.of(Collective.BROADCAST, world_size, other_bytes=8 * n))
        self.stats.rebuilds += 1
        self.arrival.clear()
        seen_set = set(seen)
        before = self.layout()
        self.order = seen + [i for i in reversed(range(n)) if i not in seen_set]
        return self.layout() != before
