"""Stage 3: the model itself is sharded (fully_shard); the optimizer steps its shards."""

from __future__ import annotations

from torch import Tensor, nn
from torch.optim import Optimizer

from phalanx import zero3
from phalanx.ddp.stats import Traffic
from phalanx.errors import ConfigurationError
from phalanx.optim.local_sgd import PeriodicSync
from phalanx.runtime.hostmem import return_freed_memory
from phalanx.train.checkpoint.stateful import Entry
from phalanx.train.setup import prepare_device_model
from phalanx.train.strategy.base import Strategy
from phalanx.train.trainer_state import ShardedModel
from phalanx.zero3.meta_init import has_meta_tensors, materialize

__all__ = ["FullyShard"]


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
            zero3.shard_model(model, policy, offload_policy=self.offload)
        if has_meta_tensors(model):
            materialize(model, self.world.device, group=self.world.process_group)
        for unit in zero3.units(model):  # its gathers and reductions on the timeline
            unit.record_to(self.timeline)
        self.wrapped = model
        return model

    def rewrap(self, model: nn.Module) -> nn.Module:
        return self.wrap(model)

    @property
    def records_own_timeline(self) -> bool:
        return zero3.unit_of(self.wrapped) is not None if self.wrapped is not None else False

    def _user_optimizer(self, model: nn.Module) -> Optimizer | None:
        """Its parameters must be the units' sharded ones, the very objects (a `.to()` swaps
        their contents in place, so the Trainer's move to the device keeps them)."""
        optimizer = super()._user_optimizer(model)
        if optimizer is None:
            return None
        sharded = {id(p) for p in zero3.sharded_parameters(model)}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not all(id(p) in sharded for p in params):
            raise ConfigurationError(
                "zero_stage=3 shards the model, so an optimizer built over its whole "
                "parameters steps tensors the model no longer uses — shard the model first "
                "(phalanx.zero3.shard_model) and build the optimizer over model.parameters(), "
                "pass optimizer_cls_and_kwargs=(cls, kwargs) (built after sharding), or drop "
                "optimizer= and let the Trainer build AdamW"
            )
        return optimizer

    def clip(self, model: nn.Module, optimizer: Optimizer, max_norm: float) -> Tensor:
        """torch's clip over the DTensor gradients (one all-reduce of the squares)."""
        return zero3.clip_grad_norm_(model, max_norm)

    def checkpoint_entries(self, model: nn.Module, optimizer: Optimizer) -> dict[str, Entry]:
        """Both through DCP: the model holds shards, and so does its optimizer's state."""
        return {"model": ShardedModel(model), "optimizer": ShardedModel(model, optimizer)}

    def traffic(self, optimizer: Optimizer, periodic_sync: PeriodicSync | None) -> Traffic:
        """Every unit's gathers and reduce-scatters, and the root's buffer broadcasts."""
        assert self.wrapped is not None
        return zero3.communication(self.wrapped)
