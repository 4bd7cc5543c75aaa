"""How the Trainer's replicas communicate, beyond DDP's plain all-reduce.

Two kinds, both public classes the Trainer only assembles from its arguments:

- a DDP communication hook (`ddp_comm_hook`): `phalanx.comm_hooks.hook_by_name`
  registered on the wrapper. PowerSGD's state (error feedback, warm-start Qs,
  its RNG) differs between ranks, so it is checkpointed per rank.
- local synchronisation (`sync_method` "local_sgd" / "diloco"): the model is
  not wrapped, and `phalanx.LocalSGD` / `phalanx.DiLoCo` sync the replicas
  from a hook on the optimizer's step. Between syncs each rank's parameters
  and optimizer state are its own, so their state is checkpointed per rank too.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import SGD, Optimizer

from phalanx.ddp.comm_hooks import hook_by_name
from phalanx.ddp.module import DistributedDataParallel
from phalanx.ddp.powersgd import PowerSGDState
from phalanx.optim.diloco import DiLoCo
from phalanx.optim.local_sgd import LocalSGD, PeriodicSync
from phalanx.runtime import World
from phalanx.train.checkpoint.stateful import Placement, Stateful
from phalanx.train.config.args import TrainingArguments


class PerRank:
    """A checkpoint entry over a rank-local Stateful: each rank saves and loads its own."""

    checkpoint_placement: Placement = "per_rank"

    def __init__(self, inner: Stateful) -> None:
        self.inner = inner

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)


def attach_comm_hook(
    wrapped: DistributedDataParallel, args: TrainingArguments, world: World
) -> PowerSGDState | None:
    """Register `args.ddp_comm_hook` on the DDP wrapper; PowerSGD's state, to checkpoint
    (the strategy calls it only where there is a wrapper: a world of one sends nothing)."""
    if args.ddp_comm_hook is None:
        return None
    options: dict[str, Any] = {}
    if args.ddp_comm_hook == "powersgd":
        options = {
            "matrix_approximation_rank": args.powersgd_rank,
            "start_powerSGD_iter": args.powersgd_start_iter,
            "random_seed": args.seed,
        }
    state, hook = hook_by_name(args.ddp_comm_hook, world.process_group, **options)
    wrapped.register_comm_hook(state, hook)
    return state if isinstance(state, PowerSGDState) else None


def make_periodic_sync(
    model: nn.Module, optimizer: Optimizer, args: TrainingArguments, world: World
) -> PeriodicSync | None:
    """LocalSGD or DiLoCo over the unwrapped model and its optimizer, as sync_method says."""
    if args.sync_method == "local_sgd":
        return LocalSGD(model, optimizer, args.sync_every, world.process_group)
    if args.sync_method == "diloco":
        params = [p for p in model.parameters() if p.requires_grad]
        outer = SGD(
            params,
            lr=args.diloco_outer_lr,
            momentum=args.diloco_outer_momentum,
            nesterov=args.diloco_outer_momentum > 0,  # torch refuses Nesterov without momentum
        )
        return DiLoCo(model, optimizer, args.sync_every, outer, world.process_group)
    return None
