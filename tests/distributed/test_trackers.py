"""W&B (offline) and MLflow (a local store) through their own clients, on two real ranks:
one run per job (rank 0's), holding exactly what metrics.jsonl holds, under Hugging Face's
names for W&B (`train/loss`, `eval/loss`), with the arguments as the run's config."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest

from phalanx.train import Trainer
from phalanx.train.logging.trackers import rewrite_logs
from tests.distributed.test_trainer_zero import _args, _data, _Net, _xent
from tests.harness import run_workers

pytest.importorskip("wandb", reason="wandb is a test extra")
pytest.importorskip("mlflow", reason="mlflow-skinny is a test extra")
pytest.importorskip("tensorboard", reason="tensorboard is a test extra")


def _train(rank: int, world: int, out: str) -> None:
    args = _args(
        Path(out),
        max_steps=6,
        logging_steps=2,
        eval_steps=3,
        save_steps=10_000,
        report_to=["jsonl", "wandb", "mlflow", "tensorboard"],
    )
    trainer = Trainer(
        model=_Net(), args=args, train_dataset=_data(), eval_dataset=_data(), loss_fn=_xent
    )
    trainer.train()
    trainer.close()


def _wandb_history(path: Path) -> list[dict[str, Any]]:
    """The history records of an offline run's .wandb file (W&B's log format: 32 KiB blocks
    of records with 7-byte headers, after a 7-byte file header; records are protobufs)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, partial = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    records: list[bytes] = []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # the rest of the block is padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        partial = chunk if kind in (1, 2) else partial + chunk
        if kind in (1, 4):
            records.append(partial)
    history = []
    for raw in records:
        # protobuf builds its message classes at import time: no stub names them.
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            history.append(
                {k: v for k, v in items.items() if not k.startswith("_") or k == "_step"}
            )
    return history


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trackers")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_PROJECT": "phalanx-test"}
    run_workers(_train, 2, str(out), env=env, timeout=180)
    return out


def _jsonl(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").open()]


def test_wandb_holds_what_metrics_jsonl_holds_under_hf_names(run: Path) -> None:
    runs = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, "one W&B run per job: rank 0's"
    history = _wandb_history(runs[0])
    expected: dict[int, dict[str, Any]] = {}
    for line in _jsonl(run):
        step = line.pop("step")
        expected.setdefault(step, {}).update(rewrite_logs(line))
    got: dict[int, dict[str, Any]] = {}
    for row in history:
        step = row.pop("_step")
        got.setdefault(step, {}).update(row)
    assert got == expected
    assert "train/loss" in got[2] and "eval/loss" in got[3]


def test_mlflow_holds_what_metrics_jsonl_holds(run: Path) -> None:
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient((run / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("phalanx")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, "one MLflow run per job: rank 0's"
    mlflow_run = runs[0]
    assert mlflow_run.data.params["learning_rate"] == "0.01"
    assert mlflow_run.info.status == "FINISHED"
    for line in _jsonl(run):
        step = line.pop("step")
        for name, value in line.items():
            history = client.get_metric_history(mlflow_run.info.run_id, name)
            assert (step, value) in [(m.step, m.value) for m in history], (name, step)


def test_tensorboard_holds_what_metrics_jsonl_holds_under_hf_names(run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    expected: dict[str, list[tuple[int, float]]] = {}
    for line in _jsonl(run):
        step = line.pop("step")
        for name, value in rewrite_logs(line).items():
            expected.setdefault(name, []).append((step, value))
    tags = events.Tags()["scalars"]
    assert sorted(tags) == sorted(expected) and "train/loss" in tags and "eval/loss" in tags
    for tag, points in expected.items():
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert got == [(s, pytest.approx(v, rel=1e-6)) for s, v in points], tag
