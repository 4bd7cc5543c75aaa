"""`DistributedDataParallel`: the module wrapper users see; the reducer does the work.

Drop-in for `torch.nn.parallel.DistributedDataParallel`: torch 2.13's
constructor arguments and defaults (each honoured or refused with a reason,
phalanx.ddp.arguments), `no_sync()`, `register_comm_hook()`, `.module`,
`state_dict()` keys prefixed with `module.`, `copy.deepcopy` and pickling, and
the private methods real code calls (phalanx.ddp.torch_surface).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from phalanx.ddp import arguments, registry
from phalanx.ddp.arguments import DEFAULT_BUCKET_CAP_MB
from phalanx.ddp.comm_hooks import CommHook, allreduce_hook, fp16_compress_hook
from phalanx.ddp.join import Join, JoinConfig
from phalanx.ddp.join_ddp import ForwardPlan, JoinableDDP
from phalanx.ddp.reducer import Reducer
from phalanx.ddp.reductions import AllReduce, CommHookReduction
from phalanx.ddp.registry import reducer_of
from phalanx.ddp.torch_surface import TorchSurface, eager, refuse_torch_ddp_around
from phalanx.diagnostics import timeline as timelines
from phalanx.diagnostics.timeline import Timeline
from phalanx.errors import ConfigurationError, ReducerError
from phalanx.parallel.sync import broadcast_coalesced, verify_same_state
from phalanx.runtime.exit import register_exit_hook
from phalanx.runtime.nested import iter_tensors, map_tensors

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["DEFAULT_BUCKET_CAP_MB", "DistributedDataParallel", "reducer_of"]


class DistributedDataParallel(TorchSurface, nn.Module, JoinableDDP):
    """Replicate `module` on every rank and average its gradients during backward.

    Our own reducer (phalanx.ddp.reducer), not a wrapper of torch's: gradients
    are bucketed (reverse registration order, `bucket_cap_mb`, a 1 MiB first
    bucket), each bucket is all-reduced asynchronously as soon as its last
    gradient arrives, and the buckets are rebuilt once in the order gradients
    really arrived. torch 2.13's arguments, with torch's meanings:

    module: the model; every rank must hold the same parameters (checked at wrap,
        then rank 0's values broadcast unless `init_sync=False`).
    device_ids / output_device: one CUDA device (or None on CPU); inputs go there.
    dim: the batch dimension the timeline counts samples along.
    broadcast_buffers: rank 0's buffers to every rank before each forward.
    init_sync: broadcast rank 0's parameters and buffers at wrap.
    process_group: the ranks that average (default: every rank).
    bucket_cap_mb: bucket size in MiB, or "auto" (measured in the first steps);
        bucket_cap_mb_list: one size per bucket instead.
    find_unused_parameters: search the graph after forward for parameters that get
        no gradient (else one is an error naming it).
    gradient_as_bucket_view: `.grad` is a view into the bucket (no copy).
    static_graph: the same graph every step (unused parameters learned once).
    skip_all_reduce_unused_params: leave buckets of unused parameters unsent.
    batched_grad_copy: copy a bucket's gradients in one pass when it launches.
    forward_sync_buffers: None (follow `broadcast_buffers`) or an explicit choice.
    check_reduction: deprecated in torch; warned, ignored.
    mixed_precision, delay_all_reduce_named_params, param_to_hook_all_reduce,
        device_mesh: refused by name where phalanx does not support them
        (docs/ddp.md's table).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = True,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | str | None = DEFAULT_BUCKET_CAP_MB,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Sequence[tuple[str, nn.Parameter]] | None = None,
        param_to_hook_all_reduce: nn.Parameter | None = None,
        mixed_precision: object | None = None,
        device_mesh: DeviceMesh | None = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Sequence[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
    ) -> None:
        super().__init__()
        arguments.require_process_group()
        arguments.refuse_unsupported(
            mixed_precision, delay_all_reduce_named_params, param_to_hook_all_reduce
        )
        arguments.check_skip_unused(
            skip_all_reduce_unused_params, find_unused_parameters, static_graph
        )
        arguments.warn_deprecated(check_reduction)
        self._bucket_caps = arguments.bucket_caps(bucket_cap_mb, bucket_cap_mb_list)
        self._tune_bucket_size = arguments.tuned(bucket_cap_mb, bucket_cap_mb_list)
        self.module = module
        self.process_group = arguments.resolve_group(process_group, device_mesh)
        if device_mesh is not None:
            self.device_mesh = device_mesh
        self.device_ids = self._check_devices(module, device_ids)
        self.output_device, self.dim = output_device, dim
        sync = arguments.buffer_sync(broadcast_buffers, forward_sync_buffers)
        self.forward_sync_buffers, init_sync_buffers = sync
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        self._set_torch_state()
        self._start_replicas(init_sync, init_sync_buffers)
        self._attach_reducer()

    def _set_torch_state(self) -> None:
        """The attributes torch's DDP has and scripts read, at their starting values."""
        self.mixed_precision = None
        self.bucket_bytes_cap = max(self._bucket_caps)
        self.require_backward_grad_sync = True
        # torch's rule, kept for parity: buffers are broadcast before a forward that
        # follows a synced training forward (and before the very first one).
        self.require_forward_param_sync = True
        self._ddp_sink_clone = True
        self.world_size = dist.get_world_size(self.process_group)
        self._join_config = JoinConfig.disabled()
        self._divide_by_initial_world_size = True
        self.parameters_to_ignore = set(
            getattr(self.module, "_ddp_params_and_buffers_to_ignore", ())
        )

    def _start_replicas(self, init_sync: bool, init_sync_buffers: bool) -> None:
        """Check there is something to train, then make every rank start from rank 0's state."""
        # A script converted from torch never calls phalanx.init(), which installs this.
        register_exit_hook()
        self._trainable_parameters()  # before any collective: a frozen module fails alone
        named_buffers = [
            (name, b)
            for name, b in self.module.named_buffers()
            if name not in self.parameters_to_ignore
        ]
        self._buffers_to_sync = [b for _, b in named_buffers]
        if init_sync:
            self._sync_initial_state(named_buffers, init_sync_buffers)

    def _sync_initial_state(
        self, named_buffers: list[tuple[str, torch.Tensor]], with_buffers: bool
    ) -> None:
        """Check that every rank holds the same parameters (and synced buffers), then give
        every rank rank 0's values: replicas start identical."""
        params = self._managed_parameters()
        checked = named_buffers if with_buffers or self.forward_sync_buffers else []
        settings = arguments.collective_settings(
            self._bucket_caps,
            self._tune_bucket_size,
            self.find_unused_parameters,
            self.gradient_as_bucket_view,
            self.static_graph,
            self.forward_sync_buffers,
        )
        verify_same_state(params, checked, self.process_group, settings)
        state: list[torch.Tensor] = [p for _, p in params]
        if with_buffers:
            state += self._buffers_to_sync
        broadcast_coalesced(state, self.process_group)

    def _managed_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The module's parameters DDP synchronises: all but the ignored ones."""
        return [
            (name, p)
            for name, p in self.module.named_parameters()
            if name not in self.parameters_to_ignore
        ]

    def _trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The managed parameters that require a gradient; none is an error (as in torch)."""
        trainable = [(name, p) for name, p in self._managed_parameters() if p.requires_grad]
        if not trainable:
            raise ConfigurationError(
                "the module has no parameter that requires a gradient — DistributedDataParallel "
                "has nothing to synchronise; unfreeze parameters or use the module directly"
            )
        return trainable

    def _attach_reducer(self) -> None:
        """Hook a new reducer on the trainable managed parameters (detaching any earlier one)."""
        trainable = self._trainable_parameters()
        registry.detach_earlier_reducers(p for _, p in trainable)
        self.reducer = Reducer(
            trainable,
            self.process_group,
            self._bucket_caps,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            skip_unused_buckets=self.skip_all_reduce_unused_params,
            batched_copy=self.batched_grad_copy,
            tune_bucket_size=self._tune_bucket_size,
        )
        if "_timeline" not in self.__dict__:  # made, or copied (a copy records anew)
            # Handed one (a Trainer's), or PHALANX_TIMELINE's at the first training forward
            self._timeline: Timeline | None = None
            self._timeline_chosen = False
        # A reducer made again (a rebuild) records where the wrapper's timeline does.
        self.reducer.timeline = self._timeline

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

    # ------------------------------------------------------------ copy and pickle
    def __getstate__(self) -> dict[str, Any]:
        """As torch: the process group and the reducer stay behind (the copy builds its own)."""
        if self.process_group != dist.group.WORLD:
            raise ConfigurationError(
                "a DistributedDataParallel on a process group of its own cannot be copied or "
                "pickled (a group cannot travel) — copy or save model.module, and wrap it again"
            )
        state = dict(self.__dict__)
        del state["process_group"], state["reducer"], state["_timeline"], state["_timeline_chosen"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """`copy.deepcopy` / unpickling: rejoin the default group with a new reducer.

        As in torch, nothing is broadcast (the copy starts from the values it
        carries) and a comm hook is not carried over: register it again.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigurationError(
                "unpickling a DistributedDataParallel needs the default process group — call "
                "phalanx.init() first, or save and load model.module instead"
            )
        super().__setstate__(state)
        self.process_group = arguments.world_group()
        self._attach_reducer()

    @property
    def timeline(self) -> Timeline | None:
        """Where forward, backward and bucket flights are recorded (PHALANX_TIMELINE)."""
        return self._timeline

    @timeline.setter
    def timeline(self, timeline: Timeline | None) -> None:
        self._timeline, self._timeline_chosen = timeline, True
        self.reducer.timeline = timeline

    # ------------------------------------------------------------------ forward
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self._timeline_chosen and torch.is_grad_enabled():
            self.timeline = timelines.from_env(dist.get_rank(), dist.get_world_size())
        if self._timeline is not None and torch.is_grad_enabled():
            with self._timeline.forward(self._batch_size(inputs, kwargs)):
                return self._forward(*inputs, **kwargs)
        return self._forward(*inputs, **kwargs)

    def _batch_size(self, inputs: Any, kwargs: Any) -> int:
        """Samples in this forward, for the timeline: the first input tensor's `dim` size."""
        first = next(iter_tensors((inputs, kwargs)), None)
        return int(first.shape[self.dim]) if first is not None and first.dim() > self.dim else 1

    def _forward(self, *inputs: Any, **kwargs: Any) -> Any:
        refuse_torch_ddp_around(self)
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
    @eager
    def _before_forward(self) -> None:
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        plan = ForwardPlan(
            sync=sync,
            buffers=self.will_sync_module_buffers() and self.world_size > 1,
            rebuild=sync and self.reducer.rebuild_due(),
        )
        buffer_source = 0
        if self._join_config.enable:  # under Join: tell the ranks out of batches what follows
            round_ = Join.notify_join_context(self, plan.flags())
            if round_ is not None:
                self.set_join_divisor(round_)
                buffer_source = round_.authority
        if plan.sync:
            self.reducer.before_sync_forward(plan.rebuild)
        if plan.buffers:
            self.sync_buffers(src=buffer_source)

    def sync_buffers(self, src: int = 0) -> None:
        """Broadcast rank `src`'s buffers (of the process group) to every rank, counted."""
        self.reducer.stats.add(broadcast_coalesced(self._buffers_to_sync, self.process_group, src))

    @eager
    def _after_forward(self, output: Any) -> None:
        grad_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if torch.is_grad_enabled():
            self.reducer.prepare_for_backward(output, sync=self.require_backward_grad_sync)
        self.require_forward_param_sync = grad_sync

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts rank 0's buffers (torch's rule and name)."""
        return (
            self.require_forward_param_sync
            and self.forward_sync_buffers
            and len(self._buffers_to_sync) > 0
        )

    @property
    def broadcast_buffers(self) -> bool:
        """torch 2.13's older name for `forward_sync_buffers`; setting it sets that."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

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

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
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

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """torch's C++ hooks by type: ALLREDUCE and FP16_COMPRESS, as our Python hooks."""
        builtin = {
            dist.BuiltinCommHookType.ALLREDUCE: allreduce_hook,
            dist.BuiltinCommHookType.FP16_COMPRESS: fp16_compress_hook,
        }
        if comm_hook_type not in builtin:
            raise ConfigurationError(
                f"unknown built-in comm hook {comm_hook_type!r} — pass "
                "dist.BuiltinCommHookType.ALLREDUCE or FP16_COMPRESS"
            )
        self.register_comm_hook(self.process_group, builtin[comm_hook_type])

    def _set_static_graph(self) -> None:
        """As static_graph=True, for a wrapper already built (torch's name; call it before
        the first forward)."""
        if self.static_graph:
            return
        self.reducer.set_static_graph()
        self.static_graph = True

    def _remove_autograd_hooks(self) -> None:
        """Unhook the reducer: the module's gradients stay local from now on."""
        self.reducer.remove_hooks()

    def _check_reducer_finalized(self) -> None:
        """Raise if the last synced backward did not finish reducing (torch's check)."""
        self.reducer.check_finalized()
