"""Stage 0, and what every strategy is asked: the run's data-parallel resources and their
questions, answered by the object that owns them.

A strategy is made once per run (`strategy_for`) and holds what differs between
the stages: how the model is prepared, wrapped and rewrapped, which optimizer
is built (and which a user may bring), how a micro-batch is run and the
gradients clipped, who records the timeline, the checkpoint's entries, the
traffic, and how it all lets go. The Trainer asks; nothing outside this
package tests what a strategy's objects are (tests/unit/test_strategy.py).
The offload policy is made here, once: its files hold the units' shards and
gradients and the optimizer's state alike, and are closed here, once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from phalanx import zero3
from phalanx.ddp.module import DistributedDataParallel
from phalanx.ddp.powersgd import PowerSGDState
from phalanx.diagnostics.timeline import Timeline
from phalanx.errors import ConfigurationError
from phalanx.offload import (
    DiskOffloadPolicy,
    OffloadFiles,
    OffloadPolicy,
    Streamer,
    offload_optimizer,
    streamer_of,
)
from phalanx.optim.local_sgd import PeriodicSync
from phalanx.optim.zero import ZeroRedundancyOptimizer
from phalanx.optim.zero_state import Assembly
from phalanx.parallel.traffic import NO_TRAFFIC, Traffic
from phalanx.runtime import World
from phalanx.runtime.hostmem import return_freed_memory
from phalanx.train.checkpoint.stateful import Entry
from phalanx.train.comm import attach_comm_hook
from phalanx.train.config.args import TrainingArguments
from phalanx.train.setup import offload_policy, optimizer_recipe, prepare_device_model
from phalanx.train.strategy.choice import OptimizerChoice
from phalanx.train.uneven import Shadow, uneven_inputs
from phalanx.zero3.meta_init import has_meta_tensors, materialize


class Strategy:
    """Stage 0: every rank holds everything; DDP all-reduces the gradients (or, under a
    local sync_method, the parameters are synced by LocalSGD / DiLoCo instead)."""

    sharded_model = False
    """Whether the model's parameters are shards (then saving it streams them)."""

    shards_state = False
    """Whether a rank holds state no other rank has (ZeRO's pieces): live recovery then
    keeps each rank's with a neighbour (train/live_snapshots.py) and rolls back to it."""

    def __init__(
        self,
        args: TrainingArguments,
        world: World,
        choice: OptimizerChoice | None = None,
        timeline: Timeline | None = None,
    ) -> None:
        self.args = args
        self.world = world
        self.choice = choice or OptimizerChoice()
        self.timeline = timeline
        """Where the wrapper, the units and the offloaded step record themselves."""
        self.offload: OffloadPolicy | None = offload_policy(args)
        """zero_offload as a policy, made once; under "disk" its files are made now (an
        unwritable zero_offload_dir fails before any step) and shared by all that offload."""
        self.wrapped: nn.Module | None = None
        """What the loop calls, once `wrap` has run."""

    # ------------------------------------------------------------------ the model
    def frees_host_memory(self) -> bool:
        """Whether freed host memory goes back to the kernel (runtime/hostmem.py): the point
        of these runs is less host memory."""
        return self.offload is not None

    def prepare(self, model: nn.Module) -> nn.Module:
        """The model on this rank's device, a meta-built one given rank 0's values whole."""
        self._refuse_sharded(model)
        if self.frees_host_memory():
            return_freed_memory()
        model = prepare_device_model(model, self.args, self.world)
        if has_meta_tensors(model):
            materialize(model, self.world.device, group=self.world.process_group)
        return model.to(self.world.device)

    def _refuse_sharded(self, model: nn.Module) -> None:
        """A model whose parameters are DTensors already (fully_shard) trains at stage 3 only:
        DDP and ZeRO-1/2 compute on whole tensors."""
        from torch.distributed.tensor import DTensor

        if zero3.units(model):
            raise ConfigurationError(
                f"the model was sharded with fully_shard, which zero_stage={self.args.zero_stage}"
                " cannot train — pass zero_stage=3 (it trains the model as you sharded it), or "
                "give the Trainer the model before fully_shard"
            )
        if any(isinstance(p, DTensor) for p in model.parameters()):
            raise ConfigurationError(
                "the model's parameters are DTensors (torch's fully_shard, or tensor parallel), "
                f"which zero_stage={self.args.zero_stage} cannot train — give the Trainer the "
                "plain model (zero_stage=3 shards it with phalanx's fully_shard)"
            )

    def wrap(self, model: nn.Module) -> nn.Module:
        """phalanx DDP with the arguments' DDP options, or the model itself in a world of one
        or under a local sync_method; what the loop calls from now on."""
        self.wrapped = self._wrap(model)
        if isinstance(self.wrapped, DistributedDataParallel):
            self.wrapped.timeline = self.timeline
        return self.wrapped

    def _wrap(self, model: nn.Module) -> nn.Module:
        if not self.world.is_distributed or self.args.sync_method != "ddp":
            # One rank has nothing to all-reduce; local SGD / DiLoCo sync parameters themselves.
            return model
        # A model wrapped before (by an earlier Trainer) is unhooked from it by DDP itself.
        world = self.world
        return DistributedDataParallel(
            model,
            device_ids=[world.device] if world.device.type == "cuda" else None,
            process_group=world.process_group,
            **asdict(self.args.ddp_options()),
        )

    def rewrap(self, model: nn.Module) -> nn.Module:
        """Wrap again for the current world (live recovery, once the members changed): the
        old wrapper's hooks come off first."""
        if isinstance(self.wrapped, DistributedDataParallel):
            self.wrapped.reducer.remove_hooks()
        return self.wrap(model)

    def attach_comm_hook(self) -> PowerSGDState | None:
        """`ddp_comm_hook` on the DDP wrapper (none without one); PowerSGD's state, to save."""
        wrapped = self.wrapped
        if not isinstance(wrapped, DistributedDataParallel):
            return None
        return attach_comm_hook(wrapped, self.args, self.world)

    # ------------------------------------------------------------------ the step
    @property
    def records_own_timeline(self) -> bool:
        """Whether the wrapper records its own forward, backward and collectives (DDP and a
        fully_shard root do); else the loop records them."""
        return isinstance(self.wrapped, DistributedDataParallel)

    def micro_step(self, sync: bool) -> AbstractContextManager[None]:
        """A micro-batch's forward and backward: under DDP all but the step's last run
        no_sync, so one all-reduce per step."""
        wrapped = self.wrapped
        if isinstance(wrapped, DistributedDataParallel) and not sync:
            return wrapped.no_sync()
        return nullcontext()

    def clip(self, model: nn.Module, optimizer: Optimizer, max_norm: float) -> Tensor:
        """Clip the global gradient norm (after the reduction: the same on every rank); the
        norm before clipping. `max_norm=inf` only measures it."""
        params = [p for p in model.parameters() if p.grad is not None]
        if math.isinf(max_norm):
            return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    @contextmanager
    def uneven_inputs(self, even_batches: bool) -> Iterator[Shadow | None]:
        """An epoch's context: under even_batches=False with DDP, Join's shadow callable."""
        wrapped = self.wrapped
        if even_batches or not isinstance(wrapped, DistributedDataParallel):
            yield None
            return
        with uneven_inputs(wrapped) as shadow:
            yield shadow

    # ------------------------------------------------------------------ the optimizer
    def build_optimizer(self, model: nn.Module) -> Optimizer:
        """The user's optimizer (checked), or `optimizer_cls_and_kwargs`, or `args.optim`,
        over the two parameter groups (setup.optimizer_recipe); its state in files under
        disk offload."""
        optimizer = self._user_optimizer(model)
        if optimizer is None:
            cls, groups, settings = self._recipe(model)
            optimizer = cls(groups, **settings)
        return self._offloaded(optimizer, model)

    def _user_optimizer(self, model: nn.Module) -> Optimizer | None:
        optimizer = self.choice.optimizer
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            raise ConfigurationError(
                "the Trainer builds ZeroRedundancyOptimizer itself, after it wraps the model "
                "(stage 2 must hook that wrapper) — pass zero_stage=1 or 2 instead of "
                "optimizer=ZeroRedundancyOptimizer(...)"
            )
        if optimizer is not None:
            _refuse_foreign(optimizer, model)
        return optimizer

    def _recipe(self, model: nn.Module) -> tuple[type[Optimizer], list[dict[str, object]], dict]:
        """The optimizer's class, groups and settings: `optimizer_cls_and_kwargs` (Hugging
        Face's: its class and options over the Trainer's two groups), else `args.optim`."""
        cls, groups, settings = optimizer_recipe(model, self.args)
        if self.choice.cls_and_kwargs is not None:
            cls, settings = self.choice.cls_and_kwargs[0], dict(self.choice.cls_and_kwargs[1])
        return cls, groups, settings

    def _offloaded(self, optimizer: Optimizer, model: nn.Module) -> Optimizer:
        disk = self.offload
        if not isinstance(disk, DiskOffloadPolicy):
            return optimizer
        offloaded = offload_optimizer(optimizer, disk)
        streamer = streamer_of(offloaded)
        if streamer is not None:
            streamer.timeline = self.timeline
            for files in self.shard_files(model):  # a model sharded with a policy of its own
                streamer.streams_from(files)
        return offloaded

    def shard_files(self, model: nn.Module) -> list[OffloadFiles]:
        """The scratch directories the model's shards live in (stage 3's), each once."""
        return []

    def scheduler_for(self, optimizer: Optimizer) -> LRScheduler | None:
        """The user's scheduler (optimizers=(optimizer, scheduler)), now driving `optimizer`,
        the one the run steps; None: the Trainer makes one from the arguments."""
        scheduler = self.choice.scheduler
        if scheduler is not None and scheduler.optimizer is not optimizer:
            scheduler.optimizer = optimizer  # stages 1-2 rebuilt it sharded, same groups
        return scheduler

    # ------------------------------------------------------------------ live recovery
    def live_pieces(self, optimizer: Optimizer, copy: bool = True) -> dict[str, Tensor]:
        """The state only this rank holds, copied (`copy=False`: the live tensors, for a
        caller that copies them itself); none here: every rank holds everything."""
        return {}

    def live_groups(self, optimizer: Optimizer) -> list[dict[str, object]]:
        """The optimizer's hyperparameters per group, to roll back with the pieces."""
        return []

    def live_slots(self) -> list[list[int]]:
        """Who holds each piece of the sharded state, in piece order (the ranks now): each
        rank its own here; under HSDP every replica of a shard (train/live_sharded.py takes
        a lost rank's piece from one, and keeps no snapshot while each piece has two)."""
        return [[rank] for rank in range(self.world.world_size)]

    def live_assembly(self, optimizer: Optimizer, rank: int, world_size: int) -> Assembly:
        """Where this process keeps, as rank `rank` of `world_size`, what it needs of every
        old rank's pieces while they stream past it (live recovery): nothing sharded here."""
        return Assembly([])

    def live_restore(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        assembly: Assembly,
        groups: list[dict[str, object]],
    ) -> Optimizer:
        """After a change of members, from what this process kept of every old rank's
        pieces (`live_wanted`): the optimizer of the new world (here the same one: nothing
        was sharded)."""
        return optimizer

    # ------------------------------------------------------------------ the rest
    def checkpoint_entries(self, model: nn.Module, optimizer: Optimizer) -> dict[str, Entry]:
        """The checkpoint's "model" and "optimizer": replicated state dicts here (a
        ZeroRedundancyOptimizer is a sharded entry of its own)."""
        return {"model": model, "optimizer": optimizer}

    def traffic(self, optimizer: Optimizer, periodic_sync: PeriodicSync | None) -> Traffic:
        """This rank's collectives so far (docs/trainer.md, Logging): DDP's reducer (its
        buckets, its comm hook's collectives, its signals), or local SGD / DiLoCo's averages."""
        total = NO_TRAFFIC
        if isinstance(self.wrapped, DistributedDataParallel):
            total += self.wrapped.reducer.stats.traffic
        if periodic_sync is not None:
            total += periodic_sync.stats.traffic
        return total

    def offload_streamer(self, optimizer: Optimizer | None) -> Streamer | None:
        """The windowed step of the optimizer's offloaded state (disk offload), if any."""
        inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local one
        return streamer_of(inner) if isinstance(inner, Optimizer) else None

    def release(self, optimizer: Optimizer | None) -> None:
        """Unhook DDP from the model (it outlives the Trainer: left hooked, its parameters
        would report gradients to a reducer nobody drives), finish the offloaded step's
        writes, and remove the offload files, once."""
        if isinstance(self.wrapped, DistributedDataParallel):
            self.wrapped.reducer.remove_hooks()
        streamer = self.offload_streamer(optimizer)
        if streamer is not None:
            streamer.close()
        if isinstance(self.offload, DiskOffloadPolicy):
            self.offload.close()


def _refuse_foreign(optimizer: Optimizer, model: nn.Module) -> None:
    """An optimizer over tensors the model does not hold would step nothing that trains."""
    own = {id(p) for p in model.parameters()}
    foreign = sum(id(p) not in own for g in optimizer.param_groups for p in g["params"])
    if foreign:
        raise ConfigurationError(
            f"your {type(optimizer).__name__} steps {foreign} tensors that are not parameters "
            "of the model given to the Trainer — build it over that model's parameters "
            "(model.parameters()), or pass optimizer_cls_and_kwargs=(cls, kwargs)"
        )
