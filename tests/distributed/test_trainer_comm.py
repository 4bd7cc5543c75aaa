"""The Trainer's communication methods: PowerSGD on DDP, local SGD and DiLoCo without DDP.

Two real ranks. Each method trains 8 steps uninterrupted, saving at step 3
(after PowerSGD starts compressing at step 2; mid-period for sync_every=4);
a fresh Trainer resumes that checkpoint and trains to 8: every rank must end
with bit-identical parameters. That holds only if the per-rank "comm" entry
(PowerSGD's error feedback and Qs; LocalSGD/DiLoCo's own parameters, inner
and outer optimizer state, step counts) went through the checkpoint.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import phalanx
from phalanx.train import Trainer
from tests.distributed.test_trainer_zero import _args, _data, _Net, _xent
from tests.harness import run_scenarios, run_workers

METHODS: dict[str, dict[str, Any]] = {
    "powersgd": {"ddp_comm_hook": "powersgd", "powersgd_start_iter": 2, "powersgd_rank": 2},
    "local_sgd": {"sync_method": "local_sgd", "sync_every": 4},
    "diloco": {"sync_method": "diloco", "sync_every": 4},
}


def _flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def _train(out_dir: Path, options: dict[str, Any], resume: str | None) -> dict[str, Any]:
    args = _args(
        out_dir, max_steps=8, save_steps=3, logging_steps=4, report_to=["jsonl"], **options
    )
    trainer = Trainer(model=_Net(), args=args, train_dataset=_data(), loss_fn=_xent)
    try:
        out = trainer.train(resume_from_checkpoint=resume)
        result: dict[str, Any] = {"params": _flat(trainer.model), "step": out.global_step}
        if trainer.comm_state is not None:
            result["compression"] = trainer.comm_state.compression_stats()[0]
        return result
    finally:
        trainer.close()


def _methods(rank: int, world: int, root: str) -> dict[str, Any]:
    phalanx.init(backend="gloo")

    def scenario(name: str) -> Any:
        base = Path(root) / name
        whole = _train(base / "whole", METHODS[name], None)
        resumed = _train(base / "resumed", METHODS[name], str(base / "whole" / "checkpoint-3"))
        return {"whole": whole, "resumed": resumed}

    return run_scenarios({name: functools.partial(scenario, name) for name in METHODS}, rank)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("comm")
    outcomes = run_workers(_methods, 2, str(root), init_pg=False, timeout=120)
    return root, [o.value for o in outcomes]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", list(METHODS))
def test_a_run_resumed_mid_run_ends_bit_identical(
    runs: tuple[Path, list[dict[str, Any]]], method: str
) -> None:
    _, ranks = runs
    for rank, result in enumerate(ranks):
        got = result[method]
        assert "error" not in got, got.get("error")
        assert got["resumed"]["step"] == got["whole"]["step"] == 8
        assert got["resumed"]["params"] == got["whole"]["params"], f"rank {rank} differs"
    # Step 8 is a sync step (and DDP keeps replicas equal every step): one model.
    assert ranks[0][method]["whole"]["params"] == ranks[1][method]["whole"]["params"]


@pytest.mark.timeout(180)
def test_powersgd_really_compressed(runs: tuple[Path, list[dict[str, Any]]]) -> None:
    _, ranks = runs
    assert all(r["powersgd"]["whole"]["compression"] > 1.2 for r in ranks)  # 243 numbers -> 159


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["powersgd", "local_sgd", "diloco"])
def test_the_checkpoint_holds_each_ranks_own_comm_state(
    runs: tuple[Path, list[dict[str, Any]]], method: str
) -> None:
    root, _ = runs
    comm = root / method / "whole" / "checkpoint-3" / "comm"
    states = [torch.load(comm / f"rank-{r:05d}.pt", weights_only=True) for r in range(2)]
    if method == "powersgd":  # each rank's error feedback is what its own gradient lost
        errors = [s["pieces"]["net.0.weight"]["error"] for s in states]
        assert not torch.equal(errors[0], errors[1])
    else:  # mid-period, the replicas have drifted apart
        weights = [s["module"]["net.0.weight"] for s in states]
        assert not torch.equal(weights[0], weights[1])


# The model's 243 fp32 parameters: 972 bytes, what DDP's all-reduce sends every step.
_PARAM_BYTES = 4 * sum(p.numel() for p in _Net().parameters())


def _logged(root: Path, method: str) -> list[dict[str, float]]:
    lines = (root / method / "whole" / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if "comm_bytes_per_step" in row]


@pytest.mark.timeout(180)
def test_the_log_counts_what_each_method_sent(runs: tuple[Path, list[dict[str, Any]]]) -> None:
    """comm_bytes_per_step is what the method sent, whichever sent it: local SGD averages
    the parameters once per sync_every=4 steps, so a 4-step window sends a quarter of
    them per step, in a quarter of a collective; PowerSGD sends less than the gradients."""
    root, _ = runs
    local = _logged(root, "local_sgd")
    assert [row["step"] for row in local] == [4, 8]
    for row in local:
        assert row["comm_bytes_per_step"] == _PARAM_BYTES / 4
        assert row["collectives_per_step"] == 0.25
    assert all(row["comm_bytes_per_step"] > 0 for row in _logged(root, "diloco"))
    compressed = _logged(root, "powersgd")[-1]  # steps 5-8: all compressed
    assert 0 < compressed["comm_bytes_per_step"] < _PARAM_BYTES


@pytest.mark.timeout(180)
def test_a_resumed_run_logs_only_its_own_traffic(runs: tuple[Path, list[dict[str, Any]]]) -> None:
    """The hook's counters come back with the checkpoint; the first window after the resume
    (step 4 alone) must not count them again: it sends what every compressed step sends.
    (The next window holds the resumed reducer's bucket rebuild too: 32 bytes more.)"""
    root, _ = runs
    resumed = [
        row
        for row in map(json.loads, (root / "powersgd" / "resumed" / "metrics.jsonl").open())
        if "comm_bytes_per_step" in row
    ]
    whole = _logged(root, "powersgd")[-1]  # steps 5-8, compressed as step 4 is
    assert [row["step"] for row in resumed] == [4, 8]
    assert resumed[0]["comm_bytes_per_step"] == whole["comm_bytes_per_step"], (resumed, whole)
