"""The run's data-parallel strategy, chosen once from `zero_stage`: the Trainer asks it and
never branches on the stage (torchtitan's `parallelize_*` idea).

Each strategy owns what differs between the stages: how the model is prepared
and wrapped, which optimizer is built over it (and which a user may pass), and
what the checkpoint's "model" and "optimizer" entries are. What does not
differ (precision checks, gradient checkpointing, compile, the parameter
groups, offload policies) lives in setup.py and is shared. The traffic the
Trainer logs is the strategy's too (`traffic`): it knows which of its objects
sent what. Clipping dispatches on the objects themselves (a
ZeroRedundancyOptimizer, a fully_shard unit), so it needs no strategy.
"""

from __future__ import annotations

from dataclasses import asdict

from torch import nn
from torch.optim import Optimizer

from phalanx import zero3
from phalanx.ddp.module import DistributedDataParallel
from phalanx.ddp.stats import NO_TRAFFIC, Traffic
from phalanx.errors import ConfigurationError
from phalanx.offload import DiskOffloadPolicy, offload_optimizer
from phalanx.optim.local_sgd import PeriodicSync
from phalanx.optim.zero import ZeroRedundancyOptimizer
from phalanx.runtime import World
from phalanx.runtime.hostmem import return_freed_memory
from phalanx.train.checkpoint.stateful import Entry
from phalanx.train.config.args import TrainingArguments
from phalanx.train.setup import offload_policy, optimizer_recipe, prepare_device_model
from phalanx.train.trainer_state import ShardedModel
from phalanx.zero3.meta_init import has_meta_tensors, materialize


class Strategy:
    """Stage 0: every rank holds everything; DDP all-reduces the gradients (or, under a
    local sync_method, the parameters are synced by LocalSGD / DiLoCo instead)."""

    sharded_model = False
    """Whether the model's parameters are shards (then saving it streams them)."""
    lost_rank_note: str | None = None
    """Why a lost rank's state exists nowhere else (ZeRO's shards), so live recovery must
    fall back to a restart from the checkpoint; None: every rank holds everything."""

    def __init__(self, args: TrainingArguments, world: World) -> None:
        self.args = args
        self.world = world

    def frees_host_memory(self) -> bool:
        """Whether freed host memory goes back to the kernel (runtime/hostmem.py): the point
        of these runs is less host memory."""
        return self.args.zero_offload is not None

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
        or under a local sync_method."""
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

    def build_optimizer(self, model: nn.Module, wrapped: nn.Module) -> Optimizer:
        """`args.optim` over the two parameter groups (setup.optimizer_recipe), its state in
        files under disk offload."""
        cls, groups, settings = optimizer_recipe(model, self.args)
        optimizer: Optimizer = cls(groups, **settings)
        disk = offload_policy(self.args)
        return (
            offload_optimizer(optimizer, disk) if isinstance(disk, DiskOffloadPolicy) else optimizer
        )

    def check_user_optimizer(self, optimizer: Optimizer, model: nn.Module) -> None:
        """Refuse the optimizers the Trainer cannot drive over `model` (prepared, wrapped):
        it builds ZeRO itself, after it wraps the model (stage 2 hooks that wrapper)."""
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            raise ConfigurationError(
                "the Trainer builds ZeroRedundancyOptimizer itself, after it wraps the model "
                "(stage 2 must hook that wrapper) — pass zero_stage=1 or 2 instead of "
                "optimizer=ZeroRedundancyOptimizer(...)"
            )

    def checkpoint_entries(self, model: nn.Module, optimizer: Optimizer) -> dict[str, Entry]:
        """The checkpoint's "model" and "optimizer": replicated state dicts here (a
        ZeroRedundancyOptimizer is a sharded entry of its own)."""
        return {"model": model, "optimizer": optimizer}

    def traffic(
        self, wrapped: nn.Module, optimizer: Optimizer, periodic_sync: PeriodicSync | None
    ) -> Traffic:
        """This rank's collectives so far (docs/trainer.md, Logging): DDP's reducer (its
        buckets, its comm hook's collectives, its signals), or local SGD / DiLoCo's averages."""
        total = NO_TRAFFIC
        if isinstance(wrapped, DistributedDataParallel):
            total += wrapped.reducer.stats.traffic
        if periodic_sync is not None:
            total += periodic_sync.stats.traffic
        return total


class ShardedOptimizer(Strategy):
    """Stage 1: a ZeroRedundancyOptimizer over the same groups, built after the model is
    wrapped (and handed the wrapper: stage 2 reduce-scatters through its reducer).

    A world of one runs it too, with one shard: its checkpoints then have the
    sharded layout, so a one-process run and a many-rank run resume each
    other's. Stage 2 there is stage 1: with no reducer there is nothing to
    reduce-scatter, and the single shard is the whole gradient.
    """

    lost_rank_note = "a lost rank's optimizer shard exists nowhere else"

    shards_gradients = False
    """Stage 2: the reducer reduce-scatters each bucket into the optimizer's shards."""

    def build_optimizer(self, model: nn.Module, wrapped: nn.Module) -> Optimizer:
        """Handed the DDP wrapper explicitly: stage 2 reduce-scatters through its reducer."""
        cls, groups, settings = optimizer_recipe(model, self.args)
        disk = offload_policy(self.args)
        return ZeroRedundancyOptimizer(
            groups,
            cls,
            process_group=self.world.process_group,
            shard_gradients=self.shards_gradients and self.world.is_distributed,
            offload_policy=disk if isinstance(disk, DiskOffloadPolicy) else None,
            ddp_model=wrapped if isinstance(wrapped, DistributedDataParallel) else None,
            **settings,
        )

    def check_user_optimizer(self, optimizer: Optimizer, model: nn.Module) -> None:
        super().check_user_optimizer(optimizer, model)
        raise ConfigurationError(
            f"zero_stage={self.args.zero_stage} shards the AdamW the Trainer builds, so it "
            f"cannot take your {type(optimizer).__name__} — drop optimizer= (and set "
            "learning_rate and weight_decay), or keep your optimizer with zero_stage=0"
        )

    def traffic(
        self, wrapped: nn.Module, optimizer: Optimizer, periodic_sync: PeriodicSync | None
    ) -> Traffic:
        """The reducer's (stage 2: its reduce-scatters) and the optimizer's parameter
        all-gathers after each step."""
        total = super().traffic(wrapped, optimizer, periodic_sync)
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            total += optimizer.stats.traffic
        return total


class ShardedGradients(ShardedOptimizer):
    """Stage 2: stage 1, and each bucket is reduce-scattered, so a rank keeps 1/N of the
    gradients too."""

    shards_gradients = True


class FullyShard(Strategy):
    """Stage 3: the model is sharded in place (its units, then the root; in a world of one
    too, so checkpoints have one layout whatever the size), and the loop calls it as it is;
    the optimizer steps its DTensor shards."""

    lost_rank_note = "a lost rank's parameter and optimizer shards exist nowhere else"
    sharded_model = True

    def frees_host_memory(self) -> bool:
        return True

    def prepare(self, model: nn.Module) -> nn.Module:
        """A meta-built model stays meta until `wrap` has sharded it, so each rank only ever
        holds its shards (zero3/meta_init.py); fully_shard moves the rest to the device."""
        return_freed_memory()  # a model sharded already is this stage's to train
        model = prepare_device_model(model, self.args, self.world)
        return model if has_meta_tensors(model) else model.to(self.world.device)

    def wrap(self, model: nn.Module) -> nn.Module:
        if zero3.unit_of(model) is None:  # unless it arrives sharded already
            args = self.args
            policy = zero3.by_class_names(args.zero3_units) if args.zero3_units else None
            zero3.shard_model(model, policy, offload_policy=offload_policy(args))
        if has_meta_tensors(model):
            materialize(model, self.world.device, group=self.world.process_group)
        return model

    def check_user_optimizer(self, optimizer: Optimizer, model: nn.Module) -> None:
        """Its parameters must be the units' sharded ones, the very objects (a `.to()` swaps
        their contents in place, so the Trainer's move to the device keeps them)."""
        super().check_user_optimizer(optimizer, model)
        sharded = {id(p) for p in zero3.sharded_parameters(model)}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not all(id(p) in sharded for p in params):
            raise ConfigurationError(
                "zero_stage=3 shards the model, so an optimizer built over its whole "
                "parameters steps tensors the model no longer uses — shard the model first "
                "(phalanx.zero3.shard_model) and build the optimizer over model.parameters(), "
                "or drop optimizer= and let the Trainer build AdamW"
            )

    def checkpoint_entries(self, model: nn.Module, optimizer: Optimizer) -> dict[str, Entry]:
        """Both through DCP: the model holds shards, and so does its optimizer's state."""
        return {"model": ShardedModel(model), "optimizer": ShardedModel(model, optimizer)}

    def traffic(
        self, wrapped: nn.Module, optimizer: Optimizer, periodic_sync: PeriodicSync | None
    ) -> Traffic:
        """Every unit's gathers and reduce-scatters, and the root's buffer broadcasts."""
        return zero3.communication(wrapped)


_BY_STAGE: dict[int, type[Strategy]] = {
    0: Strategy,
    1: ShardedOptimizer,
    2: ShardedGradients,
    3: FullyShard,
}


def strategy_for(args: TrainingArguments, world: World) -> Strategy:
    """The one place that reads zero_stage to decide how the run is data-parallel."""
    return _BY_STAGE[args.zero_stage](args, world)


__all__ = ["FullyShard", "ShardedGradients", "ShardedOptimizer", "Strategy", "strategy_for"]
