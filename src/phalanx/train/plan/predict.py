"""One configuration's peak memory per rank, by part, and its step time.

Memory is counted from what the configuration allocates (docs/planner.md
lists each term and where in phalanx it is made): the parameters, their
gradients and the optimizer's state, whole or 1/N, less what a disk offload
puts in files (chosen as the policy chooses: offload/fraction.py); the
activations of one micro-batch (counted on the meta device: count.py); the
collective buffers (DDP's buckets at stages 0-2; at stage 3 the root unit kept
gathered, the unit computing, the next one prefetched, the unit's unsharded
gradient and the reduce-scatter in flight); the offloaded step's windows;
and the libraries, measured. Every term is a peak held at once: the sum
bounds the step's peak from above, which is the side a budget needs.

The step time adds the micro-batches' compute (counted operations at the
measured rate), the collectives each stage issues (measured latency and
bandwidth), the optimizer's step over this rank's state (measured AdamW rate)
and the offloaded bytes through the disk (measured), none of it assumed hidden
behind another: on a CPU the collectives and the I/O take the same cores.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from phalanx.ddp.module import DEFAULT_BUCKET_CAP_MB
from phalanx.offload.fraction import largest_first, shard_share, state_share
from phalanx.train.plan.count import ModelCount
from phalanx.train.plan.probe import Rates

__all__ = ["Config", "Parts", "predict_memory", "predict_step_s"]

Tier = Literal["none", "cpu", "disk"]
_WINDOWS_RESIDENT = 7
"""Offloaded windows in memory at once at the step's peak: the one stepping, the next one
read ahead, the next step's first one, and the four stream.py lets be written back at once
(their pages go only once written, at the disk's pace). benchmarks/plan_grid.py measured
it: with 3 counted the peak of a 67M-parameter MLP's stage 3 in files was 35% above the
prediction, its files' pages resident in the step (RssFile 344 MB of its 590)."""


_STAGE3_FRESH_COPIES = 5
"""What stage 3 writes per micro-batch into memory allocated for it, in parameter bytes:
each of its two gathers' outputs and the parameters they are copied into, and the
reduce-scatter's input. Priced at the rate of a copy that faults its pages in (stage 3
frees each after use, and a planned run returns freed memory to the kernel). Priced at a
warm copy's rate (3 passes), a 27M GPT's stage 3 with 4 micro-batches was predicted
faster than with one, and ran 1.9x slower; py-spy put a third of its step in these
copies."""


@dataclass(frozen=True, order=True)
class Config:
    """One way to train: the stage, where the sharded state lives, and the micro-batches."""

    stage: int
    offload: Tier = "none"
    fraction: float = 0.0
    """Disk offload: the share of the offloadable bytes in files (offload/fraction.py)."""
    micro_batch: int = 1
    accumulation: int = 1
    window_mb: float = 16.0
    """Disk offload's window: 16 MB steps as fast as 64 (docs/zero.md, the window table)
    and holds a quarter of the memory in flight."""
    keep_gathered: bool = False
    """Stage 3 with zero3_reshard_after_forward=False: every unit stays gathered from its
    forward to its backward (one gather a micro-batch, not two)."""

    @property
    def gathers(self) -> int:
        """Stage 3's all-gathers of each unit per micro-batch: forward's, and backward's
        unless the units stay gathered."""
        return 1 if self.keep_gathered else 2

    def describe(self) -> str:
        """In words, as the table's heading and the one line name it."""
        where = {"none": "in memory", "cpu": "shards in host memory"}.get(self.offload, "")
        if self.offload == "disk":
            where = f"disk offload {self.fraction:g}"
        if self.stage == 3 and self.keep_gathered:
            where += ", units kept gathered"
        return (
            f"stage {self.stage}, {where}, micro-batch {self.micro_batch} x "
            f"{self.accumulation} accumulation"
        )


@dataclass(frozen=True)
class Parts:
    """Predicted peak bytes per rank, by part."""

    parameters: float
    gradients: float
    optimizer_state: float
    activations: float
    collective_buffers: float
    libraries: float

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


def _in_files(config: Config, count: ModelCount) -> tuple[float, float]:
    """(share of the shards' bytes, share of the state's bytes) this rank keeps in files,
    chosen tensor by tensor as the policy chooses."""
    if config.offload != "disk":
        return 0.0, 0.0
    sizes = list(enumerate(count.param_bytes))
    total = max(1, count.params)
    stage3 = config.stage == 3
    shards = largest_first(sizes, shard_share(config.fraction, "coldest")) if stage3 else set()
    state = largest_first(sizes, state_share(config.fraction, "coldest", stage3))
    share = lambda chosen: sum(count.param_bytes[i] for i in chosen) / total  # noqa: E731
    return share(shards), share(state)


def predict_memory(config: Config, count: ModelCount, world: int, rates: Rates) -> Parts:
    """The configuration's peak bytes per rank, by part: the larger of its two phases,
    forward and backward (activations, stage 3's gathered units, stage 2's reductions in
    flight) and the optimizer step (the offloaded step's windows, the per-tensor AdamW's
    temporaries)."""
    p, n = float(count.params), world
    shards_out, state_out = _in_files(config, count)
    per_rank = 1 if config.stage == 0 else n
    state = count.state_per_param_byte * p / per_rank
    largest = max(count.param_bytes) / per_rank
    if config.stage == 3:
        params = p / n * (1 - shards_out) + count.frozen_bytes
        grads = p / n * (1 - shards_out)
        kept = 0.0
        # the root kept gathered; the unit computing, the next one prefetched, the unit's
        # unsharded gradient and its reduce-scatter in flight; kept gathered, every unit
        passing = count.unit_bytes[-1] + 4.0 * count.largest_unit
        if config.keep_gathered:
            passing = sum(count.unit_bytes) + 2.0 * count.largest_unit
    else:
        params = p + count.frozen_bytes
        grads = p if config.stage < 2 else p / n
        # DDP's buckets (one rank runs without DDP); stage 2 frees each bucket as it is sent
        kept = p if config.stage < 2 and n > 1 else 0.0
        passing = 0.0
        if config.stage == 2 and config.accumulation > 1:
            # the micro-batches before the last run no_sync: their whole-size .grads build up,
            # and the last backward turns them into reduce-scatter inputs (grad_sharding.py)
            grads = p + p / n
        elif config.stage == 2:
            passing = _in_flight(config, count, rates, p)
    if config.offload == "disk":  # the windows in memory; the step fused: no temporaries
        offloaded = state * state_out + 2 * p / n * shards_out
        # a window is a parameter at least: those of its shard, gradient and state that
        # live in files (the largest go first; a shard kept in memory is counted above)
        in_files = count.state_per_param_byte * (state_out > 0) + 2.0 * (shards_out > 0)
        largest_cost = in_files * max(count.param_bytes) / n
        window = max(config.window_mb * 2**20, largest_cost)
        stepping = min(offloaded, _WINDOWS_RESIDENT * window)
    else:
        stepping = 2.0 * largest  # torch's per-tensor AdamW: two temporaries of a tensor
    activations = count.activations(config.micro_batch)
    backward_peak = activations + passing >= stepping  # else the step's is the peak
    libraries = rates.libraries_bytes
    return Parts(
        parameters=params,
        gradients=grads,
        optimizer_state=state * (1 - state_out) + (0.0 if backward_peak else stepping),
        activations=activations if backward_peak else 0.0,
        collective_buffers=kept + (passing if backward_peak else 0.0),
        libraries=libraries,
    )


def _in_flight(config: Config, count: ModelCount, rates: Rates, p: float) -> float:
    """Stage 2's gradient bytes between autograd and their reduce-scatter's end, at most:
    the buckets sent while the backward ran leave at the reductions' pace, so what the
    backward makes faster than that waits, as .grads or as reduce-scatter inputs (two
    buckets at least: the one filling, the one in flight). The backward reads the weights
    and writes its gradients into fresh memory, and the thread that runs it lays each full
    bucket's gradients out as its reduce-scatter's input (a copy into memory made for it,
    averaged in place: grad_sharding.py); the reductions beside it run at the probe's busy
    all-reduce rate (their cores are computing). Measured by plan_grid.py: 2
    buckets counted, a 252M-parameter MLP's peak was 14% above the prediction; a warm
    copy's backward and the idle reduce-scatter rate put it 0.2% below when the probe
    timed gloo's reduce-scatter 2.2x faster than its all-reduce, and 9% above when it
    priced it as the all-reduce it is; 4.8-6.9% above before the reduce-scatter inputs'
    copy was counted (the 252M MLP's backward took 1.0 s beside its reductions, where
    0.52 s was predicted). All measured before 2026-12-06, when a backward's later inputs
    became ones its earlier buckets gave back (memory already faulted in): this still
    prices every copy into fresh memory; plan_grid.py has not been run since."""
    backward_s = 2 / 3 * count.flops(config.micro_batch) / rates.flops_per_s
    # the weights read, the gradients written; then, on the same thread, each bucket's
    # gradients copied into its reduce-scatter input (made for it) and averaged there
    backward_s += 2 * p / rates.memory_bytes_per_s + 2 * p / rates.fresh_copy_bytes_per_s
    sent = backward_s * rates.busy_all_reduce_bytes_per_s
    return min(p, max(2.0 * DEFAULT_BUCKET_CAP_MB * 2**20, p - sent))


def predict_step_s(config: Config, count: ModelCount, rates: Rates, world: int) -> float:
    """The configuration's step time in seconds (see the module doc)."""
    p, n, k = float(count.params), world, config.accumulation
    # Each micro-batch reads the weights twice (forward, backward) and writes their
    # gradients once, whatever its size: why fewer, larger micro-batches are faster.
    passes = 3 * (p + count.frozen_bytes) / rates.memory_bytes_per_s
    if config.stage == 3:  # and stage 3 writes them into memory made for each use
        copies = _STAGE3_FRESH_COPIES - 2 * (2 - config.gathers)  # a gather's output, its copy
        passes += copies * p / rates.fresh_copy_bytes_per_s
    compute = k * (count.flops(config.micro_batch) / rates.flops_per_s + passes)
    comm = _collectives_s(config, p, n, rates)
    shards_out, state_out = _in_files(config, count)
    stepped = p / (1 if config.stage == 0 else n)
    fused = config.offload == "disk"
    optimizer = stepped / (rates.adam_fused_bytes_per_s if fused else rates.adam_loop_bytes_per_s)
    state = count.state_per_param_byte * stepped * state_out
    shards = stepped * shards_out if config.stage == 3 else 0.0
    # The step reads state, shards and gradients, writes state and shards back; each gather
    # of a micro-batch reads the unit's shards again (forward's, and backward's unless kept).
    # The state moves by O_DIRECT, the shards and gradients through the page cache.
    read = 2 * shards + config.gathers * k * shards
    write = shards + k * shards
    io = read / rates.disk_read_bytes_per_s + write / rates.disk_write_bytes_per_s
    io += state / rates.disk_direct_read_bytes_per_s + state / rates.disk_direct_write_bytes_per_s
    return compute + comm + optimizer + io


def _collectives_s(config: Config, p: float, n: int, rates: Rates) -> float:
    if n == 1:
        return 0.0
    k = config.accumulation
    if config.stage == 0:
        return rates.collective_s("all_reduce", p)
    if config.stage == 1:
        return rates.collective_s("all_reduce", p) + rates.collective_s("all_gather", p)
    if config.stage == 2:
        return rates.collective_s("reduce_scatter", p) + rates.collective_s("all_gather", p)
    per_micro = config.gathers * rates.collective_s("all_gather", p)
    return k * (per_micro + rates.collective_s("reduce_scatter", p))
