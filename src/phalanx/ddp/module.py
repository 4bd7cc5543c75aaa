"""`DistributedDataParallel`: the module wrapper users see; the reducer does the work.

Drop-in for `torch.nn.parallel.DistributedDataParallel`: same constructor
arguments and defaults, `no_sync()`, `register_comm_hook()`, `.module`, and
`state_dict()` keys prefixed with `module.`.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.ddp.buckets import MIB
from phalanx.ddp.comm_hooks import CommHook
from phalanx.ddp.reducer import Reducer
from phalanx.ddp.reductions import AllReduce, CommHookReduction
from phalanx.ddp.sync import broadcast_coalesced, verify_same_parameters
from phalanx.errors import ConfigurationError, ReducerError
from phalanx.nested import map_tensors

DEFAULT_BUCKET_CAP_MB = 25.0
logger = logging.getLogger("phalanx")
# Which reducer's hooks sit on a parameter. Hooks are process-wide state attached to
# the tensor itself, so this side table is too; weak both ways, it keeps nothing alive
# and, unlike an attribute on the parameter, never travels with a pickled model.
# Keyed by id(): tensors compare elementwise, so they cannot be dictionary keys.
_REDUCER_OF: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[Reducer]]] = {}


class DistributedDataParallel(nn.Module):
    """Replicate `module` on every rank and average its gradients during backward.

    Our own reducer (phalanx.ddp.reducer), not a wrapper of torch's: gradients
    are bucketed (reverse registration order, `bucket_cap_mb`, a 1 MiB first
    bucket), each bucket is all-reduced asynchronously as soon as its last
    gradient arrives, and the buckets are rebuilt once in the order gradients
    really arrived.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = DEFAULT_BUCKET_CAP_MB,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        forward_sync_buffers: bool | None = None,
    ) -> None:
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigurationError(
                "torch.distributed is not initialised — call phalanx.init() (or "
                "torch.distributed.init_process_group) before wrapping the model in "
                "DistributedDataParallel"
            )
        _warn_ignored_arguments(dim, check_reduction)
        self.module = module
        self.process_group = process_group if process_group is not None else _world_group()
        self.device_ids = self._check_devices(module, device_ids)
        self.broadcast_buffers = broadcast_buffers
        self.forward_sync_buffers = (
            broadcast_buffers if forward_sync_buffers is None else forward_sync_buffers
        )
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        cap_mb = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        if cap_mb <= 0:
            raise ConfigurationError(
                f"bucket_cap_mb must be > 0, got {bucket_cap_mb} — the default is 25"
            )
        self.bucket_bytes_cap = max(1, int(cap_mb * MIB))
        self.require_backward_grad_sync = True
        self.world_size = dist.get_world_size(self.process_group)

        all_params = list(module.named_parameters())
        trainable = [(name, p) for name, p in all_params if p.requires_grad]
        if not trainable:
            raise ConfigurationError(
                "the module has no parameter that requires a gradient — DistributedDataParallel "
                "has nothing to synchronise; unfreeze parameters or use the module directly"
            )
        self._buffers_to_sync = [b for b in module.buffers()]
        if init_sync:
            verify_same_parameters(all_params, self.process_group)
            state: list[torch.Tensor] = [p for _, p in all_params]
            if broadcast_buffers:
                state += self._buffers_to_sync
            broadcast_coalesced(state, self.process_group)
        _detach_earlier_reducers(trainable)
        self.reducer = Reducer(
            trainable,
            self.process_group,
            self.bucket_bytes_cap,
            gradient_as_bucket_view=gradient_as_bucket_view,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
        )
        for _, p in trainable:
            _REDUCER_OF[id(p)] = (weakref.ref(p), weakref.ref(self.reducer))
        # torch's rule, kept for parity: buffers are broadcast before a forward that
        # follows a synced training forward (and before the very first one).
        self._sync_buffers_next_forward = True

    @staticmethod
    def _check_devices(
        module: nn.Module, device_ids: Sequence[int | torch.device] | None
    ) -> list[torch.device] | None:
        devices = {p.device for p in module.parameters()}
        if device_ids is None:
            return None
        if len(device_ids) != 1 or len(devices) != 1:
            raise ConfigurationError(
                f"device_ids={list(device_ids)} is only valid for a module on one device "
                f"(this one is on {sorted(map(str, devices))}) — pass device_ids=None for "
                "CPU or multi-device modules, or one id: device_ids=[local_rank]"
            )
        (raw,) = device_ids
        device = raw if isinstance(raw, torch.device) else torch.device("cuda", raw)
        if device.type == "cpu":
            raise ConfigurationError(
                "device_ids must be None for a CPU module — drop the device_ids argument"
            )
        return [device]

    # ------------------------------------------------------------------ forward
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self._before_forward()
        if self.device_ids is not None:
            device = self.device_ids[0]
            moved = map_tensors(lambda t: t.to(device, non_blocking=True), (inputs, kwargs))
            inputs, kwargs = moved
        output = self.module(*inputs, **kwargs)
        self._after_forward(output)
        return output

    # The bookkeeping around the module's forward runs eagerly even under
    # torch.compile(DDP(model)): it talks to the process group and keeps Python
    # state, which a compiled graph must not capture. The module itself compiles.
    @torch.compiler.disable
    def _before_forward(self) -> None:
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.reducer.rebuild_if_due()
        if self._sync_buffers_next_forward and self.forward_sync_buffers:
            self._broadcast_buffers()

    @torch.compiler.disable
    def _after_forward(self, output: Any) -> None:
        grad_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if torch.is_grad_enabled():
            self.reducer.prepare_for_backward(output, sync=self.require_backward_grad_sync)
        self._sync_buffers_next_forward = grad_sync

    def _broadcast_buffers(self) -> None:
        if self.world_size > 1 and self._buffers_to_sync:
            broadcast_coalesced(self._buffers_to_sync, self.process_group)

    # --------------------------------------------------------------- public API
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next synced backward reduces the sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Replace the all-reduce of each bucket by `hook(state, bucket) -> Future[Tensor]`."""
        if not isinstance(self.reducer.reduction, AllReduce):
            raise ReducerError(
                "a communication hook is already registered — register_comm_hook may be "
                "called once, before the first backward"
            )
        if self.reducer.stats.sync_rounds > 0:
            raise ReducerError(
                "register_comm_hook was called after training started — register it right "
                "after wrapping the model, before the first backward"
            )
        self.reducer.set_reduction(CommHookReduction(hook, state))


def reducer_of(param: torch.Tensor) -> Reducer | None:
    """The live reducer whose hooks sit on `param`, if a phalanx DDP wraps it."""
    entry = _REDUCER_OF.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def _detach_earlier_reducers(trainable: Sequence[tuple[str, nn.Parameter]]) -> None:
    """Unhook any earlier wrapper's reducer from these parameters.

    Wrapping a model again (a second Trainer, a new DDP after a change of
    plan) must not leave two reducers hooked on one parameter: both would
    all-reduce every gradient, and the stale one would wait for buckets forever.
    """
    for key, (param_ref, reducer_ref) in list(_REDUCER_OF.items()):
        if param_ref() is None or reducer_ref() is None:
            del _REDUCER_OF[key]  # prune: that parameter or reducer is gone
    earlier: dict[int, Reducer] = {}
    for _, p in trainable:
        reducer = reducer_of(p)
        if reducer is not None:
            earlier[id(reducer)] = reducer
    for reducer in earlier.values():
        logger.info("re-wrapping: detaching the earlier DistributedDataParallel from the model")
        reducer.remove_hooks()


def _world_group() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None  # the constructor checked dist.is_initialized()
    return group


def _warn_ignored_arguments(dim: int, check_reduction: bool) -> None:
    """torch's arguments that mean nothing for one device per process, accepted for scripts.

    `output_device` is accepted silently: torch, too, leaves a single-device
    module's outputs where the module put them. `check_reduction` is deprecated
    and ignored by torch; `dim` only matters to torch's `scatter()`, which we
    do not have. A non-default value of either may be a user's expectation we
    do not meet, so it is named once.
    """
    ignored = []
    if dim != 0:
        ignored.append(f"dim={dim}")
    if check_reduction:
        ignored.append("check_reduction=True")
    if ignored:
        warnings.warn(
            f"DistributedDataParallel ignores {', '.join(ignored)}: with one device per process "
            "there is nothing to scatter or check — drop the argument",
            UserWarning,
            stacklevel=3,
        )
