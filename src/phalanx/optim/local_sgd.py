"""Local SGD: each rank takes H optimizer steps on its own, then the ranks average parameters.

Communication drops H-fold against DDP, which all-reduces every step; the
price is that the replicas drift apart between synchronisations. The class
wraps the *unwrapped* module and the optimizer that trains it: do not put
the module in DistributedDataParallel (its per-step all-reduce is exactly
what this replaces). The synchronisation runs from a hook on the optimizer's
`step()`, so a training loop needs no other change:

    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    local = phalanx.LocalSGD(model, opt, sync_every=8)  # broadcasts rank 0's weights
    for x, y in loader:
        loss_fn(model(x), y).backward()
        opt.step()                                       # every 8th step also averages
        opt.zero_grad()
    local.sync()                                         # replicas equal at the end

`PeriodicSync` is the part LocalSGD shares with DiLoCo (diloco.py), which
replaces the plain average by an outer optimizer step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from phalanx.ddp.comm_stats import CommStats, tensor_bytes
from phalanx.errors import ConfigurationError
from phalanx.parallel.sync import broadcast_coalesced, verify_same_state
from phalanx.parallel.traffic import Collective, TimedWait, Traffic

FlatBuffers = dict[tuple[torch.device, torch.dtype, int], torch.Tensor]
"""Flat buffers kept between synchronisations, by (device, dtype, elements)."""


def average_coalesced(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    stats: CommStats,
    flats: FlatBuffers,
) -> None:
    """Replace each tensor by its mean over `group`: one all-reduce per (device, dtype).

    The flat buffer of each kind is kept in `flats` and reused: a model-sized
    buffer allocated afresh is mapped afresh, and faulting its pages in made an
    average of a 33.6 MB model 50 ms instead of 37 (benchmarks/sync_cost.py).
    """
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    world_size = dist.get_world_size(group)
    for (device, dtype), members in by_kind.items():
        key = (device, dtype, sum(t.numel() for t in members))
        if key not in flats:
            flats[key] = torch.empty(key[2], dtype=dtype, device=device)
        flat = torch.cat([t.detach().reshape(-1) for t in members], out=flats[key])
        flat.div_(world_size)
        with TimedWait() as waited:
            dist.all_reduce(flat, group=group)
        sent = Traffic.of_tensor(Collective.ALL_REDUCE, flat, world_size, gradients=False)
        stats.add(sent + waited.traffic())
        pieces = torch.split(flat, [t.numel() for t in members])
        torch._foreach_copy_(
            [t.detach() for t in members], [p.view_as(t) for p, t in zip(pieces, members)]
        )


def _refuse_wrapped(module: nn.Module, who: str) -> None:
    from phalanx.ddp.module import DistributedDataParallel

    if isinstance(module, (DistributedDataParallel, nn.parallel.DistributedDataParallel)):
        raise ConfigurationError(
            f"{who} got a DistributedDataParallel module — pass the unwrapped module "
            f"(ddp.module): {who} replaces DDP's per-step all-reduce, and inside DDP every "
            "step would still be averaged"
        )


def foreign_tensor(optimizer: Optimizer, allowed: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A tensor the optimizer holds that is not in `allowed`, if there is one."""
    ours = {id(p) for p in allowed}
    held = (p for group in optimizer.param_groups for p in group["params"])
    return next((p for p in held if id(p) not in ours), None)


def _check_optimizer(optimizer: Optimizer, module: nn.Module, who: str) -> None:
    stray = foreign_tensor(optimizer, list(module.parameters()))
    if stray is not None:
        raise ConfigurationError(
            f"{who}'s optimizer trains a {list(stray.shape)} tensor that is not a parameter "
            "of the module — build the optimizer on module.parameters()"
        )


class PeriodicSync(ABC):
    """Count the optimizer's steps and synchronise the replicas every `sync_every` of them."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        sync_every: int,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        who = type(self).__name__
        _refuse_wrapped(module, who)
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ConfigurationError(
                f"{who}(sync_every={sync_every!r}) — use a whole number of steps >= 1 "
                "(the papers use 8 to 500)"
            )
        _check_optimizer(optimizer, module, who)
        self.module, self.optimizer, self.sync_every = module, optimizer, sync_every
        group = process_group if process_group is not None else dist.group.WORLD
        assert isinstance(group, dist.ProcessGroup), "call phalanx.init() first"
        self.group = group
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        # Floating buffers (BatchNorm's running stats) drift like parameters: averaged too.
        self.buffers = [b for b in module.buffers() if b.is_floating_point()]
        if group.size() > 1:  # as DDP's wrap: the same parameters everywhere, rank 0's values
            verify_same_state(named, list(module.named_buffers()), group)
            broadcast_coalesced([*self.params, *module.buffers()], group)
        self.stats = CommStats()
        """Bytes sent (at syncs) against the gradient bytes DDP would have sent (every step)."""
        self.inner_steps = 0
        """Optimizer steps taken since the start (restored by load_state_dict)."""
        self.synced_at = 0
        """`inner_steps` at the last synchronisation."""
        self._step_bytes = sum(tensor_bytes(p) for p in self.params)
        self._flats: FlatBuffers = {}
        self._hook = optimizer.register_step_post_hook(self._after_step)
        self.deferred = False
        """When True a due synchronisation waits for `sync_if_due()` instead of running in
        the optimizer's step (the Trainer's live recovery: a step then counts as done before
        its sync, so a sync lost with a peer never leaves a step half applied)."""

    @property
    def in_sync(self) -> bool:
        """True right after a synchronisation, when every rank holds the same parameters."""
        return self.inner_steps == self.synced_at

    def _after_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self.inner_steps += 1
        self.stats.steps += 1
        self.stats.gradient_bytes += self._step_bytes
        if not self.deferred:
            self.sync_if_due()

    def sync_if_due(self) -> None:
        """Synchronise if `sync_every` steps have passed since the last time."""
        if self.inner_steps - self.synced_at >= self.sync_every:
            self.sync()

    def sync(self) -> None:
        """Synchronise now (every rank must call it): at the end of training, for instance.
        A no-op right after a synchronisation, on every rank alike."""
        if self.in_sync:
            return
        with torch.no_grad():
            self._synchronise()
            if self.buffers:
                average_coalesced(self.buffers, self.group, self.stats, self._flats)
        self.synced_at = self.inner_steps

    @abstractmethod
    def _synchronise(self) -> None:
        """Bring every rank's parameters to the same new values."""

    # ------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Everything this rank needs to continue bit for bit, rank-local on purpose.

        Between synchronisations each rank's parameters differ, and the inner
        optimizer's state (Adam's moments) always does, since it saw only this
        rank's gradients: so this holds this rank's module and optimizer state
        too. Save one per rank; load it after the model and optimizer.
        """
        return {
            "inner_steps": self.inner_steps,
            "synced_at": self.synced_at,
            "sync_every": self.sync_every,
            "stats": self.stats.state_dict(),
            "module": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            **self._extra_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["sync_every"] != self.sync_every:
            raise ConfigurationError(
                f"this {type(self).__name__} state was saved with sync_every="
                f"{state['sync_every']}, not {self.sync_every} — resume with the same value"
            )
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.inner_steps, self.synced_at = int(state["inner_steps"]), int(state["synced_at"])
        self.stats.load_state_dict(state["stats"])
        self._load_extra_state(state)

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:  # noqa: B027 (optional)
        """Subclasses restore what `_extra_state` saved."""

    # -------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Stop synchronising: remove the hook from the optimizer."""
        self._hook.remove()

    def __enter__(self) -> PeriodicSync:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class LocalSGD(PeriodicSync):
    """Average the parameters over the ranks every `sync_every` optimizer steps.

    Lin et al., "Don't use large mini-batches, use local SGD" (2020); torch's
    `PeriodicModelAverager` does the same averaging. `stats.compression_ratio()`
    is 1/sync_every for a model without floating buffers.
    """

    def _synchronise(self) -> None:
        average_coalesced(self.params, self.group, self.stats, self._flats)
