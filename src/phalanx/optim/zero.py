"""`ZeroRedundancyOptimizer`: ZeRO stages 1 and 2, sharding by elements.

Stage 1 (the default): every rank keeps the optimizer state of only its
piece of every parameter (phalanx.parallel.sharding), steps that piece with
the wrapped optimizer class, and all-gathers the updated pieces so every
replica is whole again. Adam's state, 8 bytes per parameter in fp32, drops
to 1/N per rank, however the model spreads its parameters over tensors.

Stage 2 (`shard_gradients=True`): the DDP reducer reduce-scatters each
bucket instead of all-reducing it (phalanx.optim.grad_sharding), so each
rank receives only its pieces' averaged gradients.

The constructor is torch's, so a script written for
`torch.distributed.optim.ZeroRedundancyOptimizer` runs with the import
changed. `.optim` is the local optimizer; its parameters are views into the
model's own parameters (this rank's pieces), so the model and the shards
can never drift apart.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from phalanx.ddp import registry
from phalanx.ddp.module import DistributedDataParallel
from phalanx.ddp.reducer_view import ReducerView
from phalanx.errors import ConfigurationError, PhalanxError
from phalanx.offload import DiskOffloadPolicy, offload_optimizer
from phalanx.optim import zero_checkpoint, zero_state
from phalanx.optim.grad_sharding import ReduceScatter, ShardOf
from phalanx.optim.zero_gather import GatherPlan, ParameterGather
from phalanx.parallel.sharding import Piece, piece_of
from phalanx.parallel.traffic import TrafficCounter

# Updates whose step reads only each element's own gradient and state: cutting a tensor
# between ranks leaves the math unchanged.
ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)
# Updates that read whole tensors (or the whole model): a piece alone would step differently.
WHOLE_TENSOR = {
    "Adafactor": "factors each matrix's second moment by rows and columns",
    "Muon": "orthogonalises each matrix as a whole",
    "LBFGS": "searches along one direction over all parameters",
    "SparseAdam": "steps sparse gradients",
}


class ZeroRedundancyOptimizer(Optimizer):
    """Wrap `optimizer_class` so each rank keeps (and steps) only 1/N of its state.

    torch's arguments, with torch's meanings, plus phalanx's:

    params: the parameters, or parameter groups (each group's options kept).
    optimizer_class: an elementwise optimizer (AdamW, SGD, ...); one that reads
        whole tensors (Muon, LBFGS, ...) is refused by name.
    process_group: the ranks that share the state (default: every rank).
    parameters_as_bucket_view: accepted; the all-gather always uses flat buffers.
    overlap_with_ddp: refused (phalanx's stage 2 overlaps through the reducer).
    shard_gradients: (phalanx's) ZeRO-2: the DDP reducer reduce-scatters each
        bucket, so every rank keeps 1/N of the gradients too.
    offload_policy: (phalanx's) a DiskOffloadPolicy keeps the state in files.
    ddp_model: (phalanx's) the phalanx.DistributedDataParallel that averages these
        parameters' gradients: stage 2 reduce-scatters through its reducer, and Join
        learns that this optimizer's step is a collective. Without it (torch's way)
        the wrapper is found from the parameters themselves (ddp/registry.py).
    **defaults: `optimizer_class`'s own options (lr, betas, weight_decay, ...).
    Every tensor is cut in N pieces (docs/zero.md), so a rank's share stays 1/N
    even where one layer holds most of the model.
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[Optimizer],
        process_group: dist.ProcessGroup | None = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        shard_gradients: bool = False,
        offload_policy: DiskOffloadPolicy | None = None,
        ddp_model: DistributedDataParallel | None = None,
        **defaults: Any,
    ) -> None:
        _check_arguments(optimizer_class, overlap_with_ddp)
        self._initialized = False
        self.process_group = _group(process_group)
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self.parameters_as_bucket_view = parameters_as_bucket_view
        """Accepted for torch's signature; the all-gather always goes through flat buffers."""
        self.shard_gradients = shard_gradients
        self._reducer_scatters = False
        """Stage 2 is live: the reducer delivers each piece's gradient (else step slices .grad)."""
        self._params: list[torch.nn.Parameter] = []
        self._pieces: list[Piece] = []
        self._shards: list[torch.Tensor] = []
        self._consolidated: dict[str, Any] | None = None
        self._checked_wrapped = False
        self._given = None if ddp_model is None else ReducerView(ddp_model.reducer)
        """The reducer handed over explicitly (ddp_model=), else None: looked up by parameter."""
        self.stats = TrafficCounter()
        """The parameter all-gathers after each step (`stats.traffic`; stage 2's
        reduce-scatters are the reducer's: DistributedDataParallel.reducer.stats)."""
        super().__init__(params, defaults)
        for group in self.param_groups:
            self._add_shards(group["params"])
        self.optim: Optimizer = optimizer_class(
            [self._local_group(g) for g in self.param_groups], **defaults
        )
        """The local optimizer over this rank's pieces (real tensors it steps)."""
        if offload_policy is not None:  # its state in files, stepped a window at a time
            offload_optimizer(self.optim, offload_policy, self.process_group)
        self._pull_hyperparameters()
        self._plan_gathers()
        self._initialized = True
        for view in self._reducers(self._params):
            view.stepped_by(self)  # Join must know: this optimizer's step is a collective
        if shard_gradients:
            self._install_gradient_sharding()

    # ------------------------------------------------------------------ groups
    def _add_shards(self, params: list[torch.nn.Parameter]) -> None:
        for p in params:
            if not p.is_contiguous():
                with torch.no_grad():  # a flat piece needs flat storage (e.g. channels_last)
                    p.data = p.data.contiguous()
            piece = piece_of(p.numel(), self.world_size, self.rank)
            self._params.append(p)
            self._pieces.append(piece)
            # A view of the parameter's own storage: stepping it updates the model.
            self._shards.append(p.detach().view(-1)[piece.start : piece.stop])

    def _local_group(self, group: dict[str, Any]) -> dict[str, Any]:
        index = {id(p): i for i, p in enumerate(self._params)}
        local = {k: v for k, v in group.items() if k != "params"}
        local["params"] = [self._shards[index[id(p)]] for p in group["params"]]
        return local

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if not getattr(self, "_initialized", False):
            return  # the constructor builds the local optimizer once all groups are in
        self._add_shards(self.param_groups[-1]["params"])
        self.optim.add_param_group(self._local_group(self.param_groups[-1]))
        self._pull_hyperparameters()
        self._plan_gathers()
        if self.shard_gradients:
            self._install_gradient_sharding()

    def _pull_hyperparameters(self) -> None:
        """The class's own defaults (betas, eps, ...) become visible in `param_groups`."""
        for mine, local in zip(self.param_groups, self.optim.param_groups):
            for key, value in local.items():
                if key != "params":
                    mine.setdefault(key, value)

    def _push_hyperparameters(self) -> None:
        """What a scheduler (or the user) changed in `param_groups` reaches the local groups."""
        for mine, local in zip(self.param_groups, self.optim.param_groups):
            for key, value in mine.items():
                if key != "params":
                    local[key] = value

    def _plan_gathers(self) -> None:
        self._gather = ParameterGather(self._params, self.process_group, self.stats)

    # -------------------------------------------------------------------- step
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step this rank's pieces, then all-gather them so every replica is whole."""
        self._check_wrapped()
        self._consolidated = None
        self._push_hyperparameters()
        if not self._reducer_scatters:
            self._slice_gradients()
        if closure is not None or not isinstance(self.optim, ELEMENTWISE):
            loss = self.optim.step(closure) if closure is not None else self.optim.step()
            self._gather_parameters(step_each=False)
            return loss
        self._gather_parameters(step_each=True)
        return None

    def _slice_gradients(self) -> None:
        """Stage 1: this rank's piece of each averaged `.grad`, as a view (no copy)."""
        for p, piece, shard in zip(self._params, self._pieces, self._shards):
            grad = p.grad
            if grad is not None and grad.is_sparse:
                raise ConfigurationError(
                    "a parameter has a sparse gradient, which ZeroRedundancyOptimizer cannot "
                    "cut into pieces — use a dense embedding (sparse=False) or a plain optimizer"
                )
            shard.grad = (
                None if grad is None else grad.detach().reshape(-1)[piece.start : piece.stop]
            )

    @torch.no_grad()
    def _gather_parameters(self, step_each: bool) -> None:
        """All-gather every updated piece; the next gather is in flight while one is copied out.

        `step_each`: step the pieces of one gather at a time, right before its all-gather,
        so each all-gather runs while the optimizer computes the next pieces. Only for the
        elementwise torch optimizers, whose step on a subset of parameters (the others
        without `.grad`) is exactly their share of a whole step.
        """
        grads = [s.grad for s in self._shards]
        if step_each:
            for shard in self._shards:
                shard.grad = None

        def step_plan(plan: GatherPlan) -> None:
            for i in plan.members:
                self._shards[i].grad = grads[i]
            self.optim.step()
            for i in plan.members:
                self._shards[i].grad = None

        self._gather.run(self._shards, step_plan if step_each else None)
        for shard, grad in zip(self._shards, grads):
            shard.grad = grad

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients and the shards' (stage 2 keeps only the latter)."""
        super().zero_grad(set_to_none=set_to_none)
        for shard in self._shards:
            if shard.grad is not None:
                if set_to_none:
                    shard.grad = None
                else:
                    shard.grad.zero_()

    # ---------------------------------------------------------- gradient norm
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm of every gradient, read from the pieces (one all-reduce).

        Equal to `torch.nn.utils.clip_grad_norm_` over the full averaged gradients,
        which under stage 2 no rank holds: each rank sums its pieces' partial norms.
        """
        if not self._reducer_scatters:
            self._slice_gradients()
        return zero_state.clip_pieces(self._shards, max_norm, norm_type, self.process_group)

    # ------------------------------------------------------------- state dicts
    def pieces(self) -> zero_state.PieceOptimizer:
        """The local optimizer seen as pieces of whole tensors (for state conversions)."""
        device = self._params[0].device if self._params else torch.device("cpu")
        return zero_state.PieceOptimizer(
            optim=self.optim,
            shapes=[p.shape for p in self._params],
            pieces=self._pieces,
            group=self.process_group,
            groups=self.param_groups,
            device=device,
        )

    def own_pieces(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """This rank's pieces of the parameters and of the state, copied (`copy=False`: the
        live ones; zero_state.py)."""
        return zero_state.own_pieces(self.pieces(), self._params, copy)

    @torch.no_grad()
    def restore_whole(
        self, assembly: zero_state.Assembly, groups: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """Every rank's `own_pieces` assembled whole (from a world of any size): the parameters
        written, the state returned in the plain format for the new world's load_state_dict."""
        assert assembly.shapes == [p.shape for p in self._params], "another model's pieces"
        whole, state = assembly.finish()
        for p, value in zip(self._params, whole, strict=True):
            p.copy_(value.to(p.device))
        return {"state": state, "param_groups": groups}

    def _adopt_groups(self, saved: list[dict[str, Any]]) -> None:
        for mine, group in zip(self.param_groups, saved):
            mine.update({k: v for k, v in group.items() if k != "params"})

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective: assemble the whole optimizer state, in the plain format, on rank `to`."""
        full = zero_state.consolidate(self.pieces(), to)
        self._consolidated = full if self.rank == to else None

    def state_dict(self) -> dict[str, Any]:
        """The plain optimizer's format, after `consolidate_state_dict(to=this rank)`."""
        if self._consolidated is None:
            raise PhalanxError(
                "the optimizer state has not been consolidated on this rank — call "
                f"consolidate_state_dict(to={self.rank}) on every rank first (it is a collective), "
                "then state_dict() on that rank"
            )
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the plain optimizer's format (whole tensors) and keep this rank's pieces."""
        self._adopt_groups(zero_state.load_plain(self.pieces(), state_dict))

    def save_sharded(self, directory: Path) -> None:
        """Collective: every rank writes its pieces to `directory` (torch DCP format)."""
        zero_checkpoint.save_sharded(self.pieces(), directory)

    def sharded_state_dict(self) -> dict[str, Any]:
        """What `save_sharded` writes, as DCP's state dict (this rank's pieces as DTensors)."""
        return zero_checkpoint.sharded_state_dict(self.pieces())

    def load_sharded(self, directory: Path) -> None:
        """Collective: read this rank's pieces from a `save_sharded` directory, any world size."""
        self._adopt_groups(zero_checkpoint.load_sharded(self.pieces(), directory))

    # ------------------------------------------------------------------ checks
    def _reducers(self, params: list[torch.nn.Parameter]) -> list[ReducerView]:
        """The reducers averaging `params`' gradients: the one handed over, or those found."""
        return [self._given] if self._given is not None else registry.views_of(params)

    def _check_wrapped(self) -> None:
        """Stage 1 steps whatever `.grad` holds: it must be the average over ranks."""
        if self._checked_wrapped or self.world_size == 1:
            return
        trainable = [(i, p) for i, p in enumerate(self._params) if p.requires_grad]
        averaged = [False] * len(trainable)
        for view in self._reducers([p for _, p in trainable]):
            hooked = view.hooks(p for _, p in trainable)
            averaged = [a or h for a, h in zip(averaged, hooked)]
        bare = [i for (i, _), ok in zip(trainable, averaged) if not ok]
        if bare:
            raise ConfigurationError(
                f"ZeroRedundancyOptimizer: {len(bare)} parameter(s) (the first is number "
                f"{bare[0]}) belong to no phalanx.DistributedDataParallel, so their gradients "
                "are not averaged across ranks — wrap the model in phalanx.DistributedDataParallel "
                "before building the optimizer"
            )
        self._checked_wrapped = True

    def _install_gradient_sharding(self) -> None:
        reducers = self._reducers([p for p in self._params if p.requires_grad])
        self._check_wrapped()
        if self.world_size == 1 and not reducers:
            return  # one rank, no wrapper: the one piece is the whole .grad, sliced at step
        if len(reducers) != 1:
            raise ConfigurationError(
                f"shard_gradients=True needs the optimizer's parameters wrapped by exactly one "
                f"phalanx.DistributedDataParallel, found {len(reducers)} — wrap the whole model "
                "once, then build the optimizer over its parameters"
            )
        (view,) = reducers
        view.require_within(self._params)
        shards = {
            id(p): ShardOf(s, piece)
            for p, s, piece in zip(self._params, self._shards, self._pieces)
        }
        view.reduce_with(ReduceScatter(view.group, shards))
        self._reducer_scatters = True


def _group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigurationError(
            "torch.distributed is not initialised — call phalanx.init() before building "
            "ZeroRedundancyOptimizer"
        )
    group = process_group if process_group is not None else dist.group.WORLD
    assert group is not None  # initialised above
    return group


def _check_arguments(optimizer_class: type[Optimizer], overlap_with_ddp: bool) -> None:
    name = getattr(optimizer_class, "__name__", str(optimizer_class))
    if name in WHOLE_TENSOR:
        raise ConfigurationError(
            f"{name} cannot be sharded by elements: it {WHOLE_TENSOR[name]}, and ZeRO cuts "
            "tensors between ranks — use an elementwise optimizer (Adam, AdamW, SGD, ...) or "
            "plain DistributedDataParallel"
        )
    if not issubclass(optimizer_class, ELEMENTWISE):
        warnings.warn(
            f"ZeroRedundancyOptimizer assumes {name} updates each element from its own gradient "
            "and state only (as Adam and SGD do); an update that reads whole tensors would "
            "differ once tensors are cut between ranks",
            UserWarning,
            stacklevel=3,
        )
    if overlap_with_ddp:
        raise ConfigurationError(
            "overlap_with_ddp=True (torch's optimizer step inside the DDP hook) is not "
            "supported — use shard_gradients=True, which reduce-scatters each bucket as "
            "backward runs"
        )
