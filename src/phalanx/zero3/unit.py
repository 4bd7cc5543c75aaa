"""`Unit`: one fully_shard module's parameters, and where they stand in the iteration.

A unit gathers its parameters before it computes (`unshard`), frees them
after (`reshard`, or keeps 1/k of them for a smaller gather in backward),
counts its parameters' gradients as autograd accumulates them, and when the
last one is in, reduce-scatters them (`launch_reduce`). The root (root.py)
finishes every unit's reduction at the end of backward.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from phalanx.errors import OffloadError
from phalanx.parallel.collectives import ReduceScatterState
from phalanx.parallel.traffic import NO_TRAFFIC, Traffic
from phalanx.runtime.agree import raise_on_every_rank
from phalanx.zero3.group import GradHook, ParamGroup, PendingAllReduce, Reduction
from phalanx.zero3.mesh import MeshInfo, post_forward_group, unit_group
from phalanx.zero3.params import ShardedParam
from phalanx.zero3.policies import MixedPrecisionPolicy

if TYPE_CHECKING:
    from phalanx.diagnostics.timeline import Timeline
    from phalanx.zero3.root import Root


class UnitPhase(Enum):
    """Where a unit stands in the iteration."""

    IDLE = "idle"
    """Between iterations, or after its forward."""
    FORWARD = "forward"
    """Its forward is running."""
    BACKWARD = "backward"
    """Its backward has begun (a forward now is activation checkpointing's recompute)."""


class Unit:
    """One fully_shard call: its module (or FSDP2's group of modules, `fully_shard([a, b])`)
    and their sharded parameters, grouped for the collectives."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        params: list[ShardedParam],
        info: MeshInfo,
        policy: MixedPrecisionPolicy,
        reshard_after_forward: bool | int | None,
        broadcast_buffers: bool,
        post_forward_group: dist.ProcessGroup | None,
    ) -> None:
        self.modules = modules
        self.module = modules[0]
        """The first of them: the one module of a unit that is not a group."""
        self.to_run: set[nn.Module] = set()
        """A group's modules whose forward has not run yet in this pass through the group
        (FSDP2's `_modules_to_run_forward`): the group's forward ends with the last."""
        self.params = params
        self.info = info
        self.policy = policy
        self.reshard_after_forward = reshard_after_forward
        """None until the root decides (FSDP2: False for the root, True for the others)."""
        self.broadcast_buffers = broadcast_buffers
        self.post_forward_group = post_forward_group
        self.root: Root | None = None
        self.name = ""
        """The module's name in the root's model (set by the root)."""
        self.phase = UnitPhase.IDLE
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.reshard_after_backward = True
        self.divisor: float = info.data_parallel_size
        # FSDPModule's reduction settings (module.py says what each does).
        self.force_sum = False  # set_force_sum_reduction_for_comms
        self.reduce_unused = False  # set_reduce_scatter_unused_params
        self.reduce_buffers = 1  # set_reduce_scatter_max_input_buffers
        self.reduce_group: dist.ProcessGroup | None = None  # set_separate_reduce_scatter_group
        self.all_reduce_hook: GradHook | None = None  # set_all_reduce_hook
        self.unshard_in_backward = True  # set_unshard_in_backward
        self.forward_prefetch: list[Unit] | None = None
        self.backward_prefetch: list[Unit] | None = None
        self.arrived = 0
        self.reducing: list[tuple[ParamGroup, ReduceScatterState]] | None = None
        self.reduced = False
        """This iteration's reduction is finished (the root may finish it mid-backward)."""
        self.groups: list[ParamGroup] = []
        self.sent_before = NO_TRAFFIC
        """What groups this unit dropped had sent (a regroup after a re-deal or a load with
        assign): its counts go on from there, so a log's per-step figures never go back."""
        self.timeline: Timeline | None = None
        """Where its gathers and reductions are recorded (set by the root, or the Trainer)."""
        self._stale = True
        """A sharded parameter may have been replaced: adopt, then regroup, before gathering."""
        self.refresh()

    # ------------------------------------------------------------------ groups
    def redeal(self, info: MeshInfo, values: list[torch.Tensor], rows: bool = False) -> None:
        """Deal every parameter again over `info`'s mesh from its whole value (`values`, in
        `params` order; `rows`: this rank's rows alone): live recovery's new world. Its
        groups are built again before the next gather."""
        self.reshard()
        self.info = info
        self.divisor = info.data_parallel_size
        for p, value in zip(self.params, values, strict=True):
            p.redeal(info, value, rows)
        setting = self.reshard_after_forward
        if isinstance(setting, int) and not isinstance(setting, bool) and setting > 1:
            self.post_forward_group = post_forward_group(info, setting)
        self._drop_groups()
        self.mark_stale()
        self.refresh()

    def refresh(self) -> None:
        """Follow replaced sharded parameters (load with assign, `_apply`) and regroup."""
        if not self._stale:
            return
        failure: OffloadError | None = None
        try:
            for p in self.params:
                p.adopt_registered()  # a replaced shard in files is copied to a new one
        except OffloadError as e:
            failure = e
        if any(p.home.in_files for p in self.params):
            raise_on_every_rank(failure, unit_group(self.info))
        elif failure is not None:
            raise failure
        self._drop_groups()
        by_key: dict[tuple[torch.device, torch.dtype], list[ShardedParam]] = {}
        for p in self.params:
            device = self.info.device if p.home.away else p.local.device
            by_key.setdefault((device, self._compute_dtype(p)), []).append(p)
        self.groups = [
            ParamGroup(members, self.info, device, dtype, self._on_grad)
            for (device, dtype), members in by_key.items()
        ]
        self.configure_groups()
        self.record_to(self.timeline)
        self.expected = sum(p.sharded.requires_grad for p in self.params)
        self._stale = False

    def _drop_groups(self) -> None:
        for g in self.groups:
            self.sent_before += g.comm.traffic
        self.groups = []

    @property
    def traffic(self) -> Traffic:
        """Everything this unit's groups sent, the dropped ones' included."""
        total = self.sent_before
        for g in self.groups:
            total += g.comm.traffic
        return total

    def record_to(self, timeline: Timeline | None) -> None:
        self.timeline = timeline
        for g in self.groups:
            g.timeline, g.label = timeline, self.name or "root"

    def configure_groups(self) -> None:
        """Hand the reduction settings to the groups (again after a regroup): reduce-scatter
        in `reduce_group` (None: the shard group, shared with the gathers), and call
        `all_reduce_hook` on the reduced rows."""
        for g in self.groups:
            g.reduce_group = self.reduce_group or self.info.shard_group
            g.all_reduce_hook = self.all_reduce_hook

    def mark_stale(self) -> None:
        self._stale = True

    def _compute_dtype(self, p: ShardedParam) -> torch.dtype:
        """The policy's dtype, except for modules that keep floating buffers (BatchNorm's
        running statistics): their kernels need parameters and buffers of one dtype."""
        dtype = self.policy.param_dtype
        if dtype is None or not p.sharded.is_floating_point():
            return p.sharded.dtype
        for owner, _ in p.owners:
            if any(b.is_floating_point() for b in owner.buffers(recurse=False)):
                return p.sharded.dtype
        return dtype

    # ------------------------------------------------------------------- faces
    @property
    def is_unsharded(self) -> bool:
        return bool(self.groups) and all(g.is_unsharded for g in self.groups)

    def prefetch(self) -> None:
        """Issue the all-gathers now; the unit waits for them when it needs them."""
        self.refresh()
        for g in self.groups:
            g.start_gather(self.post_forward_group)

    def unshard(self) -> None:
        """The unsharded parameters present and registered (waits for a prefetch in flight)."""
        self.refresh()
        for g in self.groups:
            g.finish_gather(self.post_forward_group)
        for g in self.groups:
            g.unsharded_params()
        for p in self.params:
            assert p.unsharded is not None
            p.register(p.unsharded)

    def reshard(self) -> None:
        """Register the sharded parameters again and free the unsharded storage."""
        for p in self.params:
            p.register(p.sharded)
        for g in self.groups:
            g.free()
            g.drop_kept()

    def after_forward(self) -> None:
        """FSDP2's reshard_after_forward: free (True), keep 1/k of the blocks (k), or keep."""
        setting = self.reshard_after_forward
        if setting is True:
            self.reshard()
        elif setting and self.post_forward_group is not None:
            size = dist.get_world_size(self.post_forward_group)
            count = self.info.shard_size // size
            first = (self.info.shard_rank % size) * count
            for p in self.params:
                p.register(p.sharded)
            for g in self.groups:
                g.free(keep=(first, count))

    # --------------------------------------------------------------- gradients
    def _on_grad(self, _: torch.Tensor) -> None:
        if self.root is not None:  # a backward that reached no unit's outputs (a group's
            self.root.queue_end_of_backward()  # module called on its own) ends there too
        self.arrived += 1
        if self.arrived == self.expected:
            self.after_backward()

    def after_backward(self) -> None:
        """Every gradient of this unit is in: reduce them, and free the unsharded
        parameters unless this is the root (its end of backward frees it)."""
        if self.requires_gradient_sync:
            self.launch_reduce()
        else:
            self.hold_unsynced()
        root = self.root
        if root is not None and self is not root.unit and self.reshard_after_backward:
            self.reshard()

    def hold_unsynced(self) -> None:
        """No reduction this backward (set_requires_gradient_sync(False)): its gradients
        wait, summed in the reduce dtype, for the next synced backward."""
        for g in self.groups:
            g.hold_unsynced(self.policy.gradient_dtype(g.dtype))

    def launch_reduce(self) -> None:
        if self.reducing is not None or self.reduced:
            return
        self.reducing = []
        for g in self.groups:
            how = Reduction(
                self.policy.gradient_dtype(g.dtype),
                self.divisor,
                self.force_sum,
                self.reduce_unused,
            )
            state = g.start_reduce(how)
            if state is not None:
                self.reducing.append((g, state))
        if self.root is not None:
            self.root.reduce_launched(self)

    def finish_reduce(self) -> list[tuple[ParamGroup, PendingAllReduce]]:
        """Wait for the reduce-scatters; HSDP's all-reduces are returned in flight."""
        pending = []
        for g, state in self.reducing or []:
            all_reduce = g.finish_reduce(state, self.requires_all_reduce)
            if all_reduce is not None:
                pending.append((g, all_reduce))
        self.reduced = self.reducing is not None
        self.reducing = None
        return pending

    def end_iteration(self) -> None:
        self.arrived = 0
        self.to_run.clear()
        self.reduced = False
        self.phase = UnitPhase.IDLE
        if self.reshard_after_backward:
            self.reshard()

    # -------------------------------------------------------------- messages
    def parameter_names(self, limit: int = 4) -> str:
        names = [p.fqn for p in self.params]
        more = f" and {len(names) - limit} more" if len(names) > limit else ""
        return ", ".join(names[:limit]) + more
