"""`replica_check_steps`: the Trainer catches replicas that drifted apart (issue 11).

Rank 1 nudges one element of one weight during step 3, as a rank-local bug
would; with replica_check_steps=2 the check after step 4 names it on every
rank. Off (the default) the run ends without a word, which is the silent
divergence the check exists for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from phalanx import PhalanxError
from phalanx.train import Trainer
from tests.faults.trainkit import in_step, make_trainer
from tests.harness import run_scenarios, run_workers


def _nudge(trainer: Trainer) -> None:
    if in_step(trainer, 3, rank=1):
        with torch.no_grad():
            trainer.model.get_parameter("net.0.weight")[2, 1] += 1e-3


def _train(out: Path, every: int) -> dict[str, Any]:
    trainer = make_trainer(out, _nudge, replica_check_steps=every, max_steps=6)
    try:
        trainer.train()
    except PhalanxError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "step": trainer.state.global_step}
    return {"error": None, "step": trainer.state.global_step}


def _both(rank: int, world: int, root: str) -> dict[str, Any]:
    base = Path(root)
    return run_scenarios(
        {"on": lambda: _train(base / "on", 2), "off": lambda: _train(base / "off", 0)}, rank
    )


@pytest.mark.timeout(120)
def test_a_one_element_drift_is_named_at_the_next_check_on_every_rank(tmp_path: Path) -> None:
    for run in run_workers(_both, 2, str(tmp_path), init_pg=False, timeout=100):
        on, off = run.value["on"], run.value["off"]
        assert on["step"] == 4, on
        assert on["error"].startswith("ReplicaDivergenceError: replicas differ: 'net.0.weight'")
        assert "on rank(s) [1]" in on["error"]
        assert off == {"error": None, "step": 6}
