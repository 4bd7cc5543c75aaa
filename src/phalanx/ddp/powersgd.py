"""PowerSGD (Vogels et al., 2019): all-reduce two thin matrices instead of each gradient.

A gradient matrix M (n x m) is replaced by P Q^T with P = M Q (n x r) and
Q = M^T P (m x r), each summed across ranks: (n + m) r numbers travel instead
of n m. What the low-rank sum misses is kept on each rank (error feedback)
and added to the next step's gradient, and Q is reused as the next step's
starting point (warm start), so the approximation improves step by step.

Same arguments, defaults and arithmetic as torch's
`torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`, so a script
switches by changing the import; on the same model and data it trains to the
same parameters (tests/distributed/test_powersgd.py). Three things differ:

- State is kept per bucket, but its checkpoint (`state_dict()`) is per
  parameter (named through phalanx DDP's reducer), and a bucket whose
  parameters changed (DDP's one rebuild, or a resumed run whose first step
  uses the initial layout) is refilled from the per-parameter pieces. torch
  keys it by bucket index alone, which a different layout silently scrambles.
- Q's random start comes from a private generator: the global RNG (dropout,
  data order) is never touched.
- The chained all-reduces are joined by callbacks rather than a `wait()` in
  a callback, and every collective's bytes are counted in `state.stats`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from phalanx.ddp.comm_stats import (
    HookState,
    all_reduce_counted,
    all_reduce_mean,
    count_gradients,
    divisor_of,
    process_group_of,
)
from phalanx.ddp.powersgd_memory import Batch, BucketMemory, ParamMemory, make_plan
from phalanx.errors import ConfigurationError

if TYPE_CHECKING:
    from phalanx.ddp.comm_hooks import GradBucket

logger = logging.getLogger(__name__)

Future = torch.futures.Future


class PowerSGDState(HookState):
    """Hyperparameters and per-bucket memory of `powersgd_hook` (torch's names and defaults).

    `state_dict()` is this rank's: error feedback differs between ranks (it is
    what each rank's own gradient lost), so a checkpoint keeps one per rank.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
    ) -> None:
        super().__init__(process_group)
        if matrix_approximation_rank < 1:
            raise ConfigurationError(
                f"matrix_approximation_rank={matrix_approximation_rank} — use 1 or more "
                "(1 to 4 is typical)"
            )
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            # torch's rule: DDP rebuilds its buckets after the first iteration.
            raise ConfigurationError(
                f"start_powerSGD_iter={start_powerSGD_iter} with error feedback or warm start "
                "— use 2 or more: DDP rebuilds its buckets after the first iteration"
            )
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape
        # numpy's generator, as torch's: each new bucket draws the seed of its Qs from it.
        self.rng = np.random.RandomState(random_seed)
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.compression_stats_logging_frequency = max(1, compression_stats_logging_frequency)
        self.next_stats_report = 0
        self.buckets: dict[int, BucketMemory] = {}
        self.pieces: dict[str, ParamMemory] = {}
        """Per parameter (by name): views into `buckets`, or loaded tensors not yet placed."""

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        """Count iterations on the last bucket (torch's method, same meaning)."""
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_powerSGD_iter:
                logger.info("PowerSGD: compressing from iteration %d on", self.iter)

    def compression_stats(self) -> tuple[float, int, int]:
        """torch's (elements before ÷ after, before, after); `stats` counts real bytes."""
        after = self.total_numel_after_compression
        rate = self.total_numel_before_compression / after if after else 0.0
        return rate, self.total_numel_before_compression, after

    def memory_for(self, bucket: GradBucket) -> BucketMemory:
        """This bucket's memory; rebuilt from the per-parameter pieces if its parameters changed."""
        memory = self.buckets.get(bucket.index())
        if memory is None or not memory.holds(bucket.parameters()):
            plan = make_plan(
                bucket.gradients(),
                self.matrix_approximation_rank,
                self.min_compression_rate,
                self.batch_tensors_with_same_shape,
            )
            keys = _parameter_keys(bucket)
            memory = BucketMemory(bucket, keys, plan, self.pieces, self.use_error_feedback)
            self.buckets[bucket.index()] = memory
        return memory

    # ------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """This rank's state, per parameter name, as plain tensors (loads with weights_only)."""
        _, keys, pos, has_gauss, gauss = self.rng.get_state()
        return {
            "iter": self.iter,
            "matrix_approximation_rank": self.matrix_approximation_rank,
            "rng": {
                "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "gauss": float(gauss),
            },
            "numel": [self.total_numel_before_compression, self.total_numel_after_compression],
            "stats": self.stats.state_dict(),
            "pieces": {
                key: {
                    name: t.detach().clone()
                    for name, t in (("error", p.error), ("q", p.q))
                    if t is not None
                }
                for key, p in self.pieces.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`'s output; buckets refill from it on their next step."""
        if state["matrix_approximation_rank"] != self.matrix_approximation_rank:
            raise ConfigurationError(
                f"this PowerSGD state was saved with matrix_approximation_rank="
                f"{state['matrix_approximation_rank']}, not {self.matrix_approximation_rank} — "
                "resume with the same rank"
            )
        rng = state["rng"]
        keys = rng["keys"].numpy().astype(np.uint32)
        self.rng.set_state(("MT19937", keys, rng["pos"], rng["has_gauss"], rng["gauss"]))
        self.iter = int(state["iter"])
        self.total_numel_before_compression, self.total_numel_after_compression = state["numel"]
        self.stats.load_state_dict(state["stats"])
        self.buckets.clear()
        pieces = state["pieces"]
        self.pieces = {key: ParamMemory(p.get("error"), p.get("q")) for key, p in pieces.items()}


def powersgd_hook(state: PowerSGDState, bucket: GradBucket) -> Future[torch.Tensor]:
    """Average the bucket with PowerSGD: plain all-reduce for vectors and small matrices and
    before `start_powerSGD_iter`, low-rank P and Q all-reduces for the rest.

    Issues up to three collectives one after another from future callbacks: safe
    on phalanx DDP, which starts a bucket's hook only when the previous one is done.
    """
    group = process_group_of(state)
    buffer = bucket.buffer()
    count_gradients(state.stats, buffer, bucket.is_last())
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return all_reduce_mean(buffer, group, state.stats, divisor_of(state, group))
    return _Round(state, bucket, group).start()


powerSGD_hook = powersgd_hook
"""torch's spelling, so `powerSGD.powerSGD_hook` works after changing the import alone."""


class _Round:
    """One compressed average of one bucket: plain part, then P, then Q, then decompress."""

    def __init__(self, state: PowerSGDState, bucket: GradBucket, group: dist.ProcessGroup) -> None:
        self.state, self.bucket, self.group = state, bucket, group
        self.memory = state.memory_for(bucket)
        self.buffer = bucket.buffer()
        self.divisor = divisor_of(state, group)
        """The ranks the sums are averaged over (Join's, else the group's size)."""
        self.before: torch.Tensor | None = None

    def start(self) -> Future[torch.Tensor]:
        state, memory, plan = self.state, self.memory, self.memory.plan
        if memory.error is not None and memory.before is not None:
            self.buffer.add_(memory.error)
            self.before = memory.before.copy_(self.buffer)
        state.total_numel_before_compression += plan.numel_before
        state.total_numel_after_compression += plan.numel_after
        _report_compression(state, self.bucket)
        grads = self.bucket.gradients()
        self.plain_grads = [grads[j] for j in plan.plain]
        plain = (
            torch.cat([g.view(-1) for g in self.plain_grads])
            if self.plain_grads
            else self.buffer.new_empty(0)
        )
        # A batch of one is a view into the bucket, written in place; larger ones are copies.
        self.matrices = [
            grads[b.members[0]].view(1, b.n, b.m)
            if len(b.members) == 1
            else torch.stack([grads[j].view(b.n, b.m) for j in b.members])
            for b in plan.batches
        ]
        self.ps = [_batch_view(memory.p, b, b.p_offset, b.n) for b in plan.batches]
        self.qs = [_batch_view(memory.q, b, b.q_offset, b.m) for b in plan.batches]
        self._prepare_qs()
        for matrix, q, p in zip(self.matrices, self.qs, self.ps):
            torch.bmm(matrix, q, out=p)
        future = all_reduce_counted(plain, self.group, state.stats)
        future = _chain(future, self._reduce_ps)
        future = _chain(future, self._reduce_qs)
        return future.then(self._decompress)

    def _prepare_qs(self) -> None:
        """Warm start: orthogonalise last step's Qs. Otherwise draw new ones, as torch does."""
        state, eps = self.state, self.state.orthogonalization_epsilon
        if state.warm_start and not self.memory.needs_random_q:
            for q in self.qs:
                _orthogonalize(q, eps)
            return
        generator = torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))
        for q in self.qs:
            q.copy_(torch.randn(*q.shape, generator=generator, dtype=q.dtype))
            _orthogonalize(q, eps)
        self.memory.needs_random_q = False

    def _reduce_ps(self, done: Future[list[torch.Tensor]]) -> Future[list[torch.Tensor]]:
        plain = done.value()[0].div_(self.divisor)
        offset = 0
        for grad in self.plain_grads:
            grad.copy_(plain[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
        return all_reduce_counted(self.memory.p, self.group, self.state.stats)

    def _reduce_qs(self, done: Future[list[torch.Tensor]]) -> Future[list[torch.Tensor]]:
        done.value()
        for p in self.ps:
            _orthogonalize(p, self.state.orthogonalization_epsilon)
        for matrix, p, q in zip(self.matrices, self.ps, self.qs):
            torch.bmm(matrix.transpose(1, 2), p, out=q)
        return all_reduce_counted(self.memory.q, self.group, self.state.stats)

    def _decompress(self, done: Future[list[torch.Tensor]]) -> torch.Tensor:
        done.value()
        self.memory.q.div_(self.divisor)
        grads = self.bucket.gradients()
        for p, q, matrix, batch in zip(self.ps, self.qs, self.matrices, self.memory.plan.batches):
            torch.bmm(p, q.transpose(1, 2), out=matrix)
            if len(batch.members) > 1:
                for i, j in enumerate(batch.members):
                    grads[j].view(batch.n, batch.m).copy_(matrix[i])
        if self.buffer.is_cuda:
            torch.cuda.synchronize(self.buffer.device)
        if self.before is not None and self.memory.error is not None:
            torch.sub(self.before, self.buffer, out=self.memory.error)
        if not self.state.warm_start:
            self.memory.needs_random_q = True
        self.state.maybe_increase_iter(self.bucket)
        return self.buffer


def _batch_view(flat: torch.Tensor, batch: Batch, offset: int, rows: int) -> torch.Tensor:
    size = len(batch.members) * rows * batch.rank
    return flat[offset : offset + size].view(len(batch.members), rows, batch.rank)


def _chain(
    first: Future[Any], step: Callable[[Future[Any]], Future[list[torch.Tensor]]]
) -> Future[list[torch.Tensor]]:
    """`first.then(step)` for a `step` that starts another collective: the result is that
    collective's future, not a future of a future, and nothing blocks in a callback."""
    result: Future[Any] = Future()

    def settle(done: Future[list[torch.Tensor]]) -> None:
        try:
            result.set_result(done.value())
        except Exception as exc:
            result.set_exception(exc)

    def run(done: Future[Any]) -> None:
        try:
            step(done).add_done_callback(settle)
        except Exception as exc:  # the earlier collective failed, or this step did
            result.set_exception(exc)

    first.add_done_callback(run)
    return result


def _orthogonalize(matrices: torch.Tensor, epsilon: float = 0) -> None:
    """Make each (n, r) matrix's columns orthonormal in place (torch's choice of method:
    Gram-Schmidt for rank <= 2 and half precision, where QR is slower or unsupported)."""
    count, _, rank = matrices.shape
    if rank <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        _gram_schmidt(matrices, epsilon)
    else:
        scratch = torch.empty(count, rank, rank, device=matrices.device, dtype=matrices.dtype)
        torch.linalg.qr(matrices, out=(matrices, scratch))


def _gram_schmidt(matrices: torch.Tensor, epsilon: float) -> None:
    columns = matrices.shape[2]
    for i in range(columns):
        col = matrices[:, :, i : i + 1]
        norm = torch.norm(col, dim=1, keepdim=True)
        # epsilon keeps an all-zero column (a parameter with zero gradient) finite; torch
        # adds it only when nonzero, and so do we, to divide by the very same numbers.
        col /= norm + epsilon if epsilon else norm
        if i + 1 < columns:
            rest = matrices[:, :, i + 1 :]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


def _report_compression(state: PowerSGDState, bucket: GradBucket) -> None:
    if bucket.is_last() and state.iter >= state.next_stats_report:
        rate, before, after = state.compression_stats()
        logger.info(
            "PowerSGD iteration %d: %d elements before compression, %d after (%.1fx)",
            state.iter,
            before,
            after,
            rate,
        )
        state.next_stats_report = state.iter + state.compression_stats_logging_frequency


def _parameter_keys(bucket: GradBucket) -> list[str]:
    """Stable names for the bucket's parameters: the same in a resumed process."""
    # Imported here: the registry imports the reducer, which imports comm_hooks, then this.
    from phalanx.ddp.registry import reducer_of

    params = bucket.parameters()
    reducer = reducer_of(params[0]) if params else None
    if reducer is None:  # torch's DDP: positions, right as long as the layout is the same
        return [f"bucket{bucket.index()}.{j}" for j in range(len(params))]
    name_of = {id(p): name for name, p in zip(reducer.names, reducer.params)}
    return [name_of[id(p)] for p in params]
