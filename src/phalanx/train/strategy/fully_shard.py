"""Stage 3: the model itself is sharded (fully_shard); the optimizer steps its shards."""

from __future__ import annotations

import inspect
import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from phalanx import zero3
from phalanx.errors import ConfigurationError
from phalanx.offload import OffloadFiles, streamer_of
from phalanx.optim.local_sgd import PeriodicSync
from phalanx.optim.zero_state import Assembly
from phalanx.parallel.sharding import piece_of, row_numel
from phalanx.parallel.traffic import Traffic
from phalanx.runtime.hostmem import return_freed_memory
from phalanx.runtime.live import current_live_group
from phalanx.train.checkpoint.stateful import Entry
from phalanx.train.setup import prepare_device_model
from phalanx.train.strategy.base import Strategy
from phalanx.train.trainer_state import ShardedModel
from phalanx.zero3.meta_init import has_meta_tensors, materialize

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["FullyShard"]


class FullyShard(Strategy):
    """Stage 3: the model is sharded in place (its units, then the root; in a world of one
    too, so checkpoints have one layout whatever the size), and the loop calls it as it is;
    the optimizer steps its DTensor shards."""

    sharded_model = True
    shards_state = True

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
            zero3.shard_model(
                model,
                policy,
                offload_policy=self.offload,
                mesh=self._mesh(),
                reshard_after_forward=args.zero3_reshard_after_forward,
            )
        if has_meta_tensors(model):
            materialize(model, self.world.device, group=self.world.process_group)
        for unit in zero3.units(model):  # its gathers and reductions on the timeline
            unit.record_to(self.timeline)
        self.wrapped = model
        return model

    def rewrap(self, model: nn.Module) -> nn.Module:
        return self.wrap(model)

    def shard_files(self, model: nn.Module) -> list[OffloadFiles]:
        return zero3.shard_files(model)

    def _mesh(self) -> DeviceMesh | None:
        """HSDP's mesh when zero3_shard_size asks for one (zero3/hybrid.py; collective), None
        for every rank. A world it does not divide is refused at the start; after a live
        loss it shards over every rank until a replacement makes the rows whole again."""
        size, world = self.args.zero3_shard_size, self.world
        if size is None or not world.is_distributed:
            return None
        live = current_live_group()
        if world.world_size % size and (live is None or live.generation == 0):
            raise ConfigurationError(
                f"zero3_shard_size={size} does not divide the {world.world_size} ranks into "
                "groups that each hold a copy of the model — launch a multiple of it (e.g. "
                "whole hosts), or change zero3_shard_size"
            )
        device_type = "cuda" if world.device.type == "cuda" else "cpu"
        return zero3.hybrid_mesh(size, world.node_rank, device_type)

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

    # ------------------------------------------------------------------ live recovery
    def live_pieces(self, optimizer: Optimizer, copy: bool = True) -> dict[str, Tensor]:
        """This rank's rows of every parameter ("p<i>", in `sharded_parameters` order) and of
        its optimizer state ("s<i>.<key>"), copied to host memory (`copy=False`: the live
        host ones; a device's are copied anyway)."""
        assert self.wrapped is not None
        out: dict[str, Tensor] = {}
        for i, p in enumerate(zero3.sharded_parameters(self.wrapped)):
            out[f"p{i}"] = _local(p).detach().cpu()
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, Tensor):
                    out[f"s{i}.{key}"] = _local(value).detach().cpu()
        return {name: t.clone() for name, t in out.items()} if copy else out

    def live_groups(self, optimizer: Optimizer) -> list[dict[str, object]]:
        assert self.wrapped is not None
        return _plain_groups(optimizer, zero3.sharded_parameters(self.wrapped))

    def live_slots(self) -> list[list[int]]:
        """The mesh's columns: a shard's holders are its replicas, one per row."""
        assert self.wrapped is not None
        unit = zero3.unit_of(self.wrapped)
        assert unit is not None
        return [list(column) for column in zip(*unit.info.row_ranks, strict=True)]

    def live_restore(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        assembly: Assembly,
        groups: list[dict[str, object]],
    ) -> Optimizer:
        """Every unit dealt again over the new world from what this rank kept of the old
        world's rows (zero3.redeal: its new rows alone, or the wholes under HSDP), and the
        same optimizer class built again over the new shards, loaded with this rank's rows of
        the state. The old one's offload streamer is closed."""
        old_params = zero3.sharded_parameters(model)
        assert assembly.shapes == [p.shape for p in old_params], "another model's rows"
        rows = assembly.rows_only
        values, state = assembly.finish()
        zero3.redeal(model, values, self._mesh(), rows)
        del values
        new_params = zero3.sharded_parameters(model)
        streamer = streamer_of(optimizer)
        if streamer is not None:
            streamer.close()
        fresh = self._offloaded(_rebuilt(optimizer, old_params, new_params), model)
        mine = _my_rows(state, new_params, rows)
        fresh.load_state_dict({"state": mine, "param_groups": groups})
        return fresh

    def live_assembly(self, optimizer: Optimizer, rank: int, world_size: int) -> Assembly:
        """This rank's new rows of each tensor on a 1-D mesh over the new world (what
        zero3.redeal deals it); under HSDP, whose mesh after a loss is built from the hosts,
        the wholes."""
        assert self.wrapped is not None
        shapes = [p.shape for p in zero3.sharded_parameters(self.wrapped)]
        if self.args.zero3_shard_size is not None:
            return Assembly(shapes)

        def rows(shape: torch.Size) -> tuple[int, int]:
            piece = piece_of(math.prod(shape), world_size, rank, row_numel(shape))
            return piece.start, piece.stop

        return Assembly(shapes, rows)

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


def _local(tensor: Tensor) -> Tensor:
    return getattr(tensor, "_local_tensor", tensor)


def _my_rows(
    state: dict[int, dict[str, Tensor]], params: list[nn.Parameter], rows: bool
) -> dict[int, Any]:
    """The optimizer state, whole or (`rows`) this rank's rows already, as this rank's
    DTensor rows of the new shards."""
    from torch.distributed.tensor import DTensor

    out: dict[int, Any] = {}
    for i, entry in state.items():
        p = params[i]
        assert isinstance(p, DTensor)
        out[i] = {
            key: value
            if value.dim() == 0
            else DTensor.from_local(
                value if rows else _rows_of(value, p),
                p.device_mesh,
                p.placements,
                shape=p.shape,
                stride=p.stride(),
            )
            for key, value in entry.items()
        }
    return out


def _rows_of(whole: Tensor, param: Any) -> Tensor:
    """This rank's rows of `whole`, as `param`'s local shard holds them."""
    local = param._local_tensor
    mesh = param.device_mesh
    rank, size = mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1)
    piece = piece_of(whole.numel(), size, rank, row_numel(whole.shape))
    row = row_numel(whole.shape) or 1
    return whole[piece.start // row : piece.stop // row].to(local.device).clone()


def _plain_groups(optimizer: Optimizer, params: list[nn.Parameter]) -> list[dict[str, object]]:
    index = {id(p): i for i, p in enumerate(params)}
    return [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [index[id(p)] for p in g["params"]],
        }
        for g in optimizer.param_groups
    ]


def _rebuilt(optimizer: Optimizer, old: list[nn.Parameter], new: list[nn.Parameter]) -> Optimizer:
    """The same optimizer class and groups over the new sharded parameters (no state yet; an
    offloaded one is streamed again by the caller)."""
    index = {id(p): i for i, p in enumerate(old)}
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [new[index[id(p)]] for p in g["params"]],
        }
        for g in optimizer.param_groups
    ]
    cls: type[Optimizer] = type(optimizer)
    if streamer_of(optimizer) is not None:  # Offloaded<Class>: stream_optimizer's subclass
        cls = cls.__bases__[0]
    accepted = inspect.signature(cls).parameters
    return cls(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
