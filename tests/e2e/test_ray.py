"""Ray Train's TorchTrainer running a plain phalanx Trainer function on two CPU workers.

Three runs on one local Ray instance (tests/e2e/scripts/ray_trainer.py has no Ray in
it): undisturbed; rank 1 SIGKILLed at step 3 under FailureConfig(max_failures=1),
whose restart resumes Ray's checkpoint-2 and ends bit-identical to the undisturbed
run; ZeRO stage 3. In each, result.checkpoint is the last phalanx checkpoint and
result.metrics holds its loss; the function saw launcher "ray", its timeline was
written when train() returned, and each console line appeared once. Skipped in one
line where ray is not installed (`pip install phalanx[ray]`; `make test` installs it).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ray_torch = pytest.importorskip(
    "ray.train.torch", reason="ray is not installed (pip install phalanx[ray])"
)

from phalanx.integrations.ray import model_state_dict  # noqa: E402
from tests.e2e.scripts.ray_trainer import MAX_STEPS  # noqa: E402
from tests.launchkit import REPO  # noqa: E402

# One Ray instance for the module: starting one costs about 20 s here, a fit 40-60 s.
FIT_TIMEOUT_S = 400
# Ray's controller notices a dead worker at its next poll (default every 2 s).
RAY_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


@pytest.fixture(scope="module")
def ray_instance() -> Iterator[None]:
    import ray as ray_core

    saved = {key: os.environ.get(key) for key in RAY_ENV}
    os.environ.update(RAY_ENV)
    paths = [str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")]
    try:
        ray_core.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": ":".join(p for p in paths if p)}},
        )
        yield
    finally:
        ray_core.shutdown()  # even when a test failed: Ray's processes must not outlive us
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclass
class Fit:
    result: Any
    attempts: list[dict[str, Any]]
    worker_lines: list[str]
    timeline: Path


def _fit(tmp: Path, stage: int, kill: bool) -> Fit:
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    from tests.e2e.scripts.ray_trainer import train_fn

    records = tmp / "records"
    records.mkdir()
    config = {
        "out": str(tmp / "out"),
        "stage": stage,
        "kill": kill,
        "marker": str(tmp / "killed"),
        "records": str(records),
        "timeline": str(tmp / "timeline.json"),
        "ray_run": str(tmp / "ray" / "run"),
    }
    trainer = ray_torch.TorchTrainer(
        train_fn,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(
            storage_path=str(tmp / "ray"), name="run", failure_config=FailureConfig(max_failures=1)
        ),
    )
    result = trainer.fit()
    attempts = [json.loads(p.read_text()) for p in sorted(records.glob("attempt-*.json"))]
    return Fit(result, attempts, _worker_lines(), tmp / "timeline.json")


def _worker_lines() -> list[str]:
    """What Ray Train's workers of this session wrote (their stdout and stderr files)."""
    import ray as ray_core

    node = ray_core._private.worker._global_node
    assert node is not None, "no local Ray instance"
    logs = Path(node.get_session_dir_path()) / "logs"
    return [
        line for f in logs.glob("worker-*") for line in f.read_text(errors="replace").splitlines()
    ]


def _check(fit: Fit) -> None:
    result = fit.result
    assert result.error is None, result.error
    assert Path(result.checkpoint.path).name == f"checkpoint-{MAX_STEPS}"
    assert (Path(result.checkpoint.path) / "manifest.json").exists()
    assert result.metrics["step"] == MAX_STEPS and result.metrics["checkpoint"] == "checkpoint-6"
    assert math.isfinite(result.metrics["loss"]) and math.isfinite(result.metrics["train_loss"])
    assert len(fit.attempts) == 1, fit.attempts  # a killed attempt's train() never returned
    last = fit.attempts[-1]
    assert (last["launcher"], last["world_launcher"], last["global_step"]) == ("ray", "ray", 6)
    assert last["train_loss"] == pytest.approx(result.metrics["train_loss"])
    assert last["timeline_written"], "the timeline was not written when train() returned"


@pytest.fixture(scope="module")
def undisturbed(ray_instance: None, tmp_path_factory: pytest.TempPathFactory) -> Fit:
    return _fit(tmp_path_factory.mktemp("undisturbed"), stage=0, kill=False)


@pytest.mark.timeout(FIT_TIMEOUT_S)
def test_undisturbed_run_reports_its_checkpoints_and_loss(undisturbed: Fit) -> None:
    _check(undisturbed)
    assert undisturbed.attempts[0]["resumed_from"] is None
    saved = [line for line in undisturbed.worker_lines if "saved checkpoint-4 (" in line]
    assert len(saved) == 1, saved  # once: not through logging and print both


@pytest.mark.timeout(2 * FIT_TIMEOUT_S)
def test_a_killed_worker_resumes_rays_checkpoint_bit_identically(
    undisturbed: Fit, tmp_path: Path
) -> None:
    killed = _fit(tmp_path, stage=0, kill=True)
    assert (tmp_path / "killed").exists(), "rank 1 was never killed"
    _check(killed)
    registered = (tmp_path / "killed").read_text()  # the newest Ray held at the kill
    assert Path(killed.attempts[0]["resumed_from"]).name == registered
    mine, theirs = (
        model_state_dict(killed.result.checkpoint),
        model_state_dict(undisturbed.result.checkpoint),
    )
    assert mine.keys() == theirs.keys()
    for name, tensor in mine.items():
        assert tensor.equal(theirs[name]), name


@pytest.mark.slow
@pytest.mark.timeout(FIT_TIMEOUT_S)
def test_zero_stage_3(undisturbed: Fit, tmp_path: Path) -> None:
    sharded = _fit(tmp_path, stage=3, kill=False)
    _check(sharded)
    assert (Path(sharded.result.checkpoint.path) / "model").is_dir()  # DCP shards, both ranks'
    state = model_state_dict(sharded.result.checkpoint)
    assert state.keys() == model_state_dict(undisturbed.result.checkpoint).keys()
