"""The parameters of one unit that share a device and a compute dtype, and their traffic.

The unsharded parameters are views into one flat buffer whose storage is
freed (resized to nothing) whenever the unit is not computing, and refilled
by one all-gather of every rank's shards when it is. After the unit's
backward its gradients go out in one reduce-scatter, and each rank keeps
(adds to its sharded parameter's `.grad`) only its own rows; under HSDP the
reduced rows are then all-reduced across the replicas.

The data is written into the unsharded parameters through separate aliases
of the same storage, so refilling them between forward and backward does not
bump the version counter that autograd checks on the tensors it saved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from phalanx.parallel.collectives import (
    AllGatherState,
    ReduceScatterState,
    scale_to_mean,
    start_all_gather,
    start_reduce_scatter,
    wait_all_gather,
    wait_reduce_scatter,
)
from phalanx.parallel.sharding import ShardedFlat, row_numel
from phalanx.parallel.traffic import Collective, TimedWait, Traffic, TrafficCounter
from phalanx.zero3.mesh import MeshInfo
from phalanx.zero3.params import ShardedParam

if TYPE_CHECKING:
    from phalanx.diagnostics.timeline import Timeline

GradHook = Callable[[torch.Tensor], None]


class Reduction(NamedTuple):
    """How a unit's gradients are reduced (its FSDPModule settings)."""

    dtype: torch.dtype
    divisor: float
    """The sum over ranks is divided by it: the data-parallel size, or
    set_gradient_divide_factor's."""
    force_sum: bool = False
    """set_force_sum_reduction_for_comms: divide after the sum (FSDP2's order), not before."""
    unused: bool = False
    """set_reduce_scatter_unused_params: a parameter with no gradient gets one too."""


class PendingAllReduce(NamedTuple):
    """HSDP: reduced rows on their way across the replicas."""

    work: dist.Work
    output: torch.Tensor


class ParamGroup:
    """One flat buffer of unsharded parameters, one all-gather, one reduce-scatter."""

    def __init__(
        self,
        params: list[ShardedParam],
        info: MeshInfo,
        device: torch.device,
        dtype: torch.dtype,
        on_grad: GradHook,
    ) -> None:
        self.params = params
        self.info = info
        self.dtype = dtype
        """The unsharded parameters' (compute) dtype: the all-gather runs in it."""
        self.device = device
        """Where the unit computes (the shards may live elsewhere: zero3/home.py)."""
        self.layout = ShardedFlat(
            [p.shape.numel() for p in params],
            info.shard_size,
            info.shard_rank,
            dtype,
            self.device,
            rows=[row_numel(p.shape) or 1 for p in params],
        )
        self.comm = TrafficCounter()
        self.reduce_group = info.shard_group
        """Where the reduce-scatter runs: the shard group, or one of its own
        (set_separate_reduce_scatter_group)."""
        self.all_reduce_hook: GradHook | None = None
        """set_all_reduce_hook: called on the reduced rows (after HSDP's all-reduce), in place,
        before force-sum's division, as FSDP2 calls it."""
        self._on_grad = on_grad
        self._divide_after: float | None = None
        """force_sum: the factor the reduced sum is divided by, once it has arrived."""
        self._with_grad: list[bool] = []
        """Which parameters had a gradient to reduce (the others keep .grad None)."""
        self._storage: torch.UntypedStorage | None = None
        self._nbytes = 0
        self._writers: list[torch.Tensor] = []
        self._gather: AllGatherState | None = None
        self._kept: torch.Tensor | None = None
        """After forward with reshard_after_forward=k: the blocks this rank keeps (1/k)."""
        self._partial: torch.Tensor | None = None
        """HSDP with set_requires_all_reduce(False): reduced rows summed, not yet all-reduced."""
        self.timeline: Timeline | None = None
        self.label = ""
        """The unit's name, for the timeline."""

    # -------------------------------------------------------------- unsharded
    def _build_unsharded(self) -> None:
        """The unsharded parameters, made at the first gather (after meta init, on the device
        the shards ended up on), each a view into one flat buffer."""
        flat = torch.empty(
            sum(p.shape.numel() for p in self.params), dtype=self.dtype, device=self.device
        )
        offset = 0
        for p in self.params:
            view = flat[offset : offset + p.shape.numel()].view(p.shape)
            full = nn.Parameter(view, requires_grad=p.sharded.requires_grad)
            if full.requires_grad:
                full.register_post_accumulate_grad_hook(self._on_grad)
            p.unsharded = full
            offset += p.shape.numel()
        self._storage = flat.untyped_storage()
        self._nbytes = self._storage.nbytes()
        # Aliases of the same storage with their own version counters (see the module doc).
        self._writers = [
            torch.empty(0, dtype=self.dtype, device=self.device).set_(
                self._storage, full.storage_offset(), full.shape, full.stride()
            )
            for full in (p.unsharded for p in self.params)
            if full is not None
        ]
        self._storage.resize_(0)

    @property
    def is_unsharded(self) -> bool:
        return self._storage is not None and self._storage.nbytes() == self._nbytes

    def unsharded_params(self) -> list[nn.Parameter]:
        if self._storage is None:
            self._build_unsharded()
        return [p.unsharded for p in self.params if p.unsharded is not None]

    # ----------------------------------------------------------------- gather
    def start_gather(self, post_forward: dist.ProcessGroup | None = None) -> bool:
        """Issue the all-gather of every rank's shards (or, after a reshard to a smaller
        group, of that group's kept blocks); False if there is nothing to gather."""
        if self._gather is not None or self.is_unsharded:
            return False
        if self._kept is not None and post_forward is not None:
            block, group = self._kept, post_forward
        else:
            with torch.no_grad():
                block = self.layout.own_block_input([p.local for p in self.params])
            for p in self.params:
                p.home.settle([p.local])  # copied: a shard in a file leaves this process
            group = self.info.shard_group
        out = block.new_empty(self.info.shard_size * self.layout.block)
        self._gather = start_all_gather(out, block, group)
        self.comm.add(Traffic.of_tensor(Collective.ALL_GATHER, out, group.size(), gradients=False))
        self._record_flight("gather", self._gather.work, out)
        return True

    def finish_gather(self, post_forward: dist.ProcessGroup | None = None) -> None:
        """Wait for the all-gather and write the unsharded parameters."""
        if self._storage is None:
            self._build_unsharded()
        self.start_gather(post_forward)
        if self._gather is None:
            return
        state, self._gather = self._gather, None
        gathered = self._waited("gather", lambda: wait_all_gather(state))
        assert self._storage is not None
        self._storage.resize_(self._nbytes)
        with torch.no_grad():
            self.layout.copy_out(gathered, self._writers)
        self._kept = None

    def free(self, keep: tuple[int, int] | None = None) -> None:
        """Free the unsharded storage; `keep=(first, count)`: keep those wire blocks first
        (a reshard to a smaller group, whose backward gathers them back)."""
        if keep is not None and self.is_unsharded:
            with torch.no_grad():
                self._kept = self._blocks(*keep)
        if self._storage is not None and self._storage.nbytes():
            self._storage.resize_(0)

    def drop_kept(self) -> None:
        self._kept = None

    def _blocks(self, first: int, count: int) -> torch.Tensor:
        rows = [
            self.layout.padded_rows(w.reshape(-1), i)[first : first + count]
            for i, w in enumerate(self._writers)
        ]
        return torch.cat(rows, dim=1).reshape(-1)

    # ----------------------------------------------------------------- reduce
    def start_reduce(self, how: Reduction) -> ReduceScatterState | None:
        """Average the unsharded gradients into this rank's rows: one async reduce-scatter.

        The unsharded gradients are freed once laid out. None: no gradient arrived.
        """
        self.hold_unsynced(how.dtype)
        grads = [_take_grad(p) for p in self.params]
        if all(g is None for g in grads):
            return None
        with_grad = [g is not None or how.unused for g in grads]
        if self._partial is not None:  # HSDP: rows summed before, not yet written
            with_grad = [a or b for a, b in zip(with_grad, self._with_grad)]
        self._with_grad = with_grad
        with torch.no_grad():
            flats = [None if g is None else g.reshape(-1).to(how.dtype) for g in grads]
            send = self.layout.reduce_scatter_input(flats, how.dtype)
            self._divide_after = None
            if how.force_sum:
                before, self._divide_after = sum_then_divide(how.dtype, how.divisor)
                if before is not None:
                    send.div_(before)
            else:
                scale_to_mean(send, how.divisor)  # type: ignore[arg-type]
        out = send.new_empty(self.layout.block)
        state = start_reduce_scatter(out, send, self.reduce_group)
        self.comm.add(state.traffic())
        self._record_flight("reduce-scatter", state.work, send)
        return state

    def hold_unsynced(self, reduce_dtype: torch.dtype) -> None:
        """A backward that does not reduce: keep its gradients summed in `reduce_dtype`.

        Summing bf16 micro-batch gradients in bf16 loses what FSDP2 keeps: it upcasts the
        first to `reduce_dtype` and adds each later one to that (`to_accumulated_grad_if_needed`,
        `accumulate_unsharded_grad_if_needed`), in this order, so the sums match bit for bit.
        Idempotent: a gradient already folded in is gone from `.grad`.
        """
        with torch.no_grad():
            for p in self.params:
                full = p.unsharded
                grad = None if full is None else full.grad
                if full is None or grad is None:
                    continue
                if p.accumulated_grad is not None:
                    p.accumulated_grad += grad
                elif grad.dtype != reduce_dtype:
                    p.accumulated_grad = grad.to(reduce_dtype)
                else:
                    continue  # the compute dtype is the reduce dtype: autograd's sum is FSDP2's
                full.grad = None

    def finish_reduce(self, state: ReduceScatterState, all_reduce: bool) -> PendingAllReduce | None:
        """Wait for the reduce-scatter. HSDP: start the all-reduce across replicas (returned)
        or, when `all_reduce` is off, keep the rows summed for later. 1-D: write the grads."""
        out = self._waited("reduce-scatter", lambda: wait_reduce_scatter(state, self.reduce_group))
        if self.info.replicate_group is None:
            self._write_grads(out)
            return None
        if self._partial is not None:
            out = out + self._partial
            self._partial = None
        if not all_reduce:
            self._partial = out
            return None
        self.comm.add(
            Traffic.of_tensor(Collective.ALL_REDUCE, out, self.info.replicate_size, gradients=True)
        )
        work = dist.all_reduce(out, group=self.info.replicate_group, async_op=True)
        self._record_flight("all-reduce", work, out)
        return PendingAllReduce(work, out)

    def finish_all_reduce(self, pending: PendingAllReduce) -> None:
        self._write_grads(self._waited("all-reduce", lambda: _done(pending)))

    def _waited(self, what: str, wait: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Wait for a collective, counting the time the training thread waited; its result."""
        with TimedWait() as waited:
            out = wait()
        self.comm.add(waited.traffic())
        if self.timeline is not None:
            self.timeline.comm_waited(
                f"wait for {what} {self.label}", waited.start_ns, waited.end_ns
            )
        return out

    def _record_flight(self, what: str, work: Any, tensor: torch.Tensor) -> None:
        if self.timeline is not None:
            future = work.get_future() if hasattr(work, "get_future") else None
            nbytes = tensor.numel() * tensor.element_size()
            self.timeline.flight(f"{what} {self.label}", nbytes, future)

    def _write_grads(self, out: torch.Tensor) -> None:
        """Each rank's rows become (or add to) the gradients of its sharded parameters that
        had one (FSDP2 leaves the others None: an optimizer then skips them)."""
        with torch.no_grad():
            if self.all_reduce_hook is not None:
                self.all_reduce_hook(out)
            if self._divide_after is not None and self._divide_after != 1:
                out.div_(self._divide_after)
            pieces = self.layout.piece_views(out)
            # A unit partly offloaded: its other pieces go home, so a piece kept here is made
            # its own; as a view it would keep all of `out` (the unit's rows) until zero_grad.
            partly_away = any(p.home.away for p in self.params)
            for p, piece, had in zip(self.params, pieces, self._with_grad, strict=True):
                if not p.sharded.requires_grad or not had:
                    continue
                grad = piece.to(p.sharded.dtype)  # on the device: a view, no copy
                if partly_away and not p.home.away and _shares_storage(grad, out):
                    grad = grad.clone()
                p.set_grad(grad)


def sum_then_divide(dtype: torch.dtype, factor: float) -> tuple[float | None, float]:
    """force_sum's factors, FSDP2's `_get_gradient_divide_factors`: (divide the input by,
    divide the sum by). fp32 and bf16 divide once, after; a narrower dtype (fp16) divides
    by a power of two near sqrt(factor) before, against overflow, and by the rest after."""
    if dtype in (torch.float32, torch.bfloat16):
        return None, factor
    before = 1
    while factor % before == 0 and factor / before > before:
        before *= 2
    return before, factor / before


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _take_grad(p: ShardedParam) -> torch.Tensor | None:
    """The gradient to reduce (the unsynced sum, else this backward's), cleared from `p`."""
    grad, p.accumulated_grad = p.accumulated_grad, None
    if p.unsharded is not None:
        if grad is None:
            grad = p.unsharded.grad
        p.unsharded.grad = None
    return grad


def _done(pending: PendingAllReduce) -> torch.Tensor:
    pending.work.wait()
    return pending.output
