"""The planner's logic on real models built on the meta device (phalanx.train.plan): what it
counts, what it predicts, what it chooses, and the one line when nothing fits. No process
group: the machine's rates are given (probe.py measures them; the grid checks them)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from phalanx.errors import ConfigurationError
from phalanx.train.plan import (
    Config,
    ModelCount,
    NothingFits,
    Rates,
    choose,
    count_model,
    parse_size,
    predict_memory,
    predict_step_s,
)
from phalanx.train.plan.budget import cgroup_limit
from phalanx.train.plan.predict import _in_files

MB = 2**20


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Tiny(nn.Module):
    """An embedding, four blocks, a head: a GPT's shape without attention."""

    def __init__(self, vocab: int = 1024, d: int = 128, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _step(model: nn.Module, n: int) -> torch.Tensor:
    tokens = torch.zeros(n, 32, dtype=torch.long, device="meta")
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


RATES = Rates(
    flops_per_s=2e10,
    memory_bytes_per_s=1e10,
    fresh_copy_bytes_per_s=2e9,
    adam_fused_bytes_per_s=4e9,
    adam_loop_bytes_per_s=3e8,
    collective_latency_s=dict.fromkeys(("all_reduce", "all_gather", "reduce_scatter"), 1e-3),
    collective_bytes_per_s=dict.fromkeys(("all_reduce", "all_gather", "reduce_scatter"), 7e8),
    disk_read_bytes_per_s=4e8,
    disk_write_bytes_per_s=4e8,
    disk_direct_read_bytes_per_s=8e8,
    disk_direct_write_bytes_per_s=6e8,
    busy_all_reduce_bytes_per_s=3e8,
    libraries_bytes=300 * MB,
)


def _count(layers: int = 4) -> ModelCount:
    with torch.device("meta"):
        model = Tiny(layers=layers)
    return count_model(model, _step, _adamw)


def test_the_count_is_of_the_model_and_its_micro_step() -> None:
    with torch.device("meta"):
        model = Tiny()
    count = count_model(model, _step, _adamw)
    params = sum(p.numel() for p in model.parameters())
    assert count.params == 4 * params
    assert count.unit_names == ("Block", "Block", "Block", "Block", "root")
    block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    assert count.unit_bytes[:4] == (block,) * 4
    assert count.unit_bytes[-1] == 4 * (1024 * 128 * 2)  # the embedding and the head
    assert count.state_per_param_byte == 2.0  # AdamW's two moments, measured by a step
    # the activations grow with the micro-batch: 32 tokens of 4 blocks of 128 and 512 wide
    assert count.activation_per_sample > 4 * 32 * (128 + 512) * 4
    assert count.activations(8) == pytest.approx(
        count.activations(1) + 7 * count.activation_per_sample
    )
    assert count.flops_per_sample > 6 * params * 32 * 0.5


def test_a_real_model_is_counted_untouched() -> None:
    torch.manual_seed(0)
    model = Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    count = count_model(model, _step, lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert count.state_per_param_byte == 0.0  # SGD without momentum keeps nothing
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None and p.device.type == "cpu" for p in model.parameters())


def test_each_stage_and_fraction_holds_less() -> None:
    """Where the blocks outweigh one gathered block and the root (stage 3's buffers)."""
    count = _count(layers=16)
    totals = [predict_memory(Config(s), count, 2, RATES).total for s in (0, 1, 2, 3)]
    assert totals == sorted(totals, reverse=True), totals
    disk = [
        predict_memory(Config(3, "disk", f), count, 2, RATES).total for f in (0.25, 0.5, 0.75, 1.0)
    ]
    assert disk == sorted(disk, reverse=True) and disk[0] < totals[3], disk


def test_more_accumulation_is_slower_and_smaller() -> None:
    count = _count()
    one = Config(0, micro_batch=8, accumulation=1)
    four = Config(0, micro_batch=2, accumulation=4)
    assert predict_step_s(four, count, RATES, 2) > predict_step_s(one, count, RATES, 2)
    assert (
        predict_memory(four, count, 2, RATES).activations
        < predict_memory(one, count, 2, RATES).activations
    )


def test_stage_3_prices_its_per_use_copies_at_the_fresh_copy_rate() -> None:
    """Found by benchmarks/plan_grid.py: stage 3 makes its gathered parameters and its
    reduce-scatter inputs for each use, and each copy faults its pages in; priced at a warm
    copy's rate, four micro-batches were predicted faster than one and ran 1.9x slower.
    Five parameter-sized copies a micro-batch, at the fresh rate; stage 2 makes none."""
    count = _count()
    p = float(count.params)
    slower = dataclasses.replace(RATES, fresh_copy_bytes_per_s=RATES.fresh_copy_bytes_per_s / 2)
    for k in (1, 4):
        stage3 = Config(3, micro_batch=8 // k, accumulation=k)
        added = predict_step_s(stage3, count, slower, 2) - predict_step_s(stage3, count, RATES, 2)
        assert added == pytest.approx(k * 5 * p / RATES.fresh_copy_bytes_per_s)
    stage2 = Config(2, micro_batch=8, accumulation=1)
    assert predict_step_s(stage2, count, slower, 2) == predict_step_s(stage2, count, RATES, 2)


def test_stage_2_holds_what_the_reductions_beside_the_backward_have_not_sent() -> None:
    """Stage 2's gradients in flight: the backward (its operations, the weights read, its
    gradients written into fresh memory, then copied into the reduce-scatter inputs, made
    for them, and averaged there) against the reductions at the probe's busy all-reduce
    rate; two 25 MB buckets at least, every gradient at most."""
    with torch.device("meta"):
        model = Tiny(d=1024)
    count = count_model(model, _step, _adamw)
    p = float(count.params)
    assert p > 100 * MB
    config = Config(2, micro_batch=8)

    def in_flight(busy: float) -> float:
        rates = dataclasses.replace(RATES, busy_all_reduce_bytes_per_s=busy)
        return predict_memory(config, count, 2, rates).collective_buffers

    backward_s = 2 / 3 * count.flops(8) / RATES.flops_per_s
    backward_s += 2 * p / RATES.memory_bytes_per_s + 2 * p / RATES.fresh_copy_bytes_per_s
    assert in_flight(0.0) == p
    assert in_flight(p / 2 / backward_s) == pytest.approx(p / 2)
    assert in_flight(1e15) == 2 * 25 * MB


def test_stage_2_accumulating_holds_whole_gradients_until_the_last_micro_batch() -> None:
    """Found by benchmarks/plan_grid.py: its micro-batches before the last run no_sync, so
    the whole-size gradients build up as at stage 1, beside the shards (measured: 770 MB
    at 2 x 4 as at 8 x 1, where 655 MB was predicted)."""
    count = _count()
    p = float(count.params)
    alone = predict_memory(Config(2, micro_batch=8, accumulation=1), count, 2, RATES)
    accumulating = predict_memory(Config(2, micro_batch=2, accumulation=4), count, 2, RATES)
    assert alone.gradients == p / 2
    assert accumulating.gradients == p + p / 2


def test_an_offloaded_window_counts_only_what_lives_in_files() -> None:
    """Found by benchmarks/plan_grid.py: with the state in files and the shards in memory
    (stage 3 at 1/2), a window holds a parameter's state alone, its shard and gradient
    being counted as in memory already; counting them again put the 67M MLP 16% high."""
    # No activations and no units in flight: the optimizer step's windows are the peak.
    count = dataclasses.replace(
        _count(layers=16), activation_fixed=0.0, activation_per_sample=0.0,
        unit_bytes=tuple(0 for _ in _count(layers=16).unit_bytes),
    )  # fmt: skip
    largest = max(count.param_bytes) / 2
    windows = 7  # resident at once: read ahead, stepped, written back (predict.py)
    config = Config(3, "disk", 0.5, window_mb=0.001)  # every window a single parameter
    shards_out, state_out = _in_files(config, count)
    assert shards_out == 0.0 and state_out == 1.0
    parts = predict_memory(config, count, 2, RATES)
    in_memory_state = 0.0  # all of it in files
    assert parts.optimizer_state == pytest.approx(
        in_memory_state + windows * count.state_per_param_byte * largest
    )


def test_a_roomy_budget_takes_the_fastest_and_a_tight_one_what_fits() -> None:
    count = _count()
    roomy = choose(count, RATES, 2, 16, 64 * 2**30, "given")
    assert roomy.chosen.config.offload == "none" and roomy.chosen.config.stage in (0, 1)
    smallest = min(c.memory.total for c in roomy.candidates)
    tight = choose(count, RATES, 2, 16, smallest / 0.95 * 1.001, "given")
    assert tight.chosen.config.stage == 3 and tight.chosen.config.offload == "disk"
    assert tight.chosen.step_s >= roomy.chosen.step_s
    for plan in (roomy, tight):
        config = plan.chosen.config
        assert config.micro_batch * config.accumulation == 8  # the global batch is kept


def test_nothing_fits_is_one_line_naming_the_smallest_budget() -> None:
    count = _count()
    with pytest.raises(NothingFits) as caught:
        choose(count, RATES, 2, 16, 100 * MB, "the cgroup's memory limit")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("no configuration fits 100 MB per rank (the cgroup's memory limit)")
    assert "the smallest needs" in message and "stage 3, disk offload 1" in message


def test_a_global_batch_the_world_does_not_divide_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="does not divide among 2 ranks"):
        choose(_count(), RATES, 2, 15, 2**40, "given")


def test_sizes_read_as_people_write_them() -> None:
    assert parse_size("2GB") == parse_size("2G") == parse_size("2gib") == 2 * 2**30
    assert parse_size("700MB") == 700 * MB and parse_size("123") == 123
    with pytest.raises(ValueError, match="is not a size"):
        parse_size("lots")


def test_the_cgroup_limit_is_the_smallest_up_the_path(tmp_path: Path) -> None:
    """v1 and v2, read from real files laid out as the kernel lays them out."""
    v2 = tmp_path / "v2"
    (v2 / "job" / "rank0").mkdir(parents=True)
    (v2 / "job" / "memory.max").write_text("1073741824\n")
    (v2 / "job" / "rank0" / "memory.max").write_text("max\n")
    proc = tmp_path / "cgroup2"
    proc.write_text("0::/job/rank0\n")
    assert cgroup_limit(str(proc), v2) == 2**30
    v1 = tmp_path / "v1"
    (v1 / "memory" / "a").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(2**63 - 4096))  # no limit
    (v1 / "memory" / "a" / "memory.limit_in_bytes").write_text(str(500 * MB))
    proc1 = tmp_path / "cgroup1"
    proc1.write_text("4:memory:/a\n1:cpu:/\n")
    assert cgroup_limit(str(proc1), v1) == 500 * MB
    proc1.write_text("4:memory:/\n")
    assert cgroup_limit(str(proc1), v1) is None


def test_units_kept_gathered_hold_the_whole_model_and_gather_once() -> None:
    """zero3_reshard_after_forward=False: every unit's parameters stay gathered from forward
    to backward (the whole model's, where one block and the root were), and a micro-batch
    gathers once: one all-gather and its two fresh copies fewer."""
    count = _count(layers=16)
    freed, kept = Config(3, micro_batch=8), Config(3, micro_batch=8, keep_gathered=True)
    held = predict_memory(kept, count, 2, RATES).collective_buffers
    assert held == sum(count.unit_bytes) + 2.0 * count.largest_unit
    assert held > predict_memory(freed, count, 2, RATES).collective_buffers
    saved = predict_step_s(freed, count, RATES, 2) - predict_step_s(kept, count, RATES, 2)
    p = float(count.params)
    gather = 1e-3 + p / 7e8  # RATES' all-gather: latency and bytes
    assert saved == pytest.approx(gather + 2 * p / RATES.fresh_copy_bytes_per_s)
    assert "units kept gathered" in kept.describe()
