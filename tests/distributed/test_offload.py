"""Offload in the Trainer, for real: state in files, stepped a window at a time, equal to
the same run without offload.

Each rank trains the same model twice in one process group, once with
`zero_offload="disk"` (a window so small that every tensor is a window of its
own) and once without, with clipping and gradient accumulation, and the two
must agree within 1e-6: every step's loss and the final parameters. While the
offloaded run trains, its optimizer state (and at stage 3 the sharded
parameters and gradients) must really be file-backed tensors in a scratch
directory under zero_offload_dir, which must be gone once the Trainer closes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest
import torch

from phalanx import zero3
from phalanx.offload import streamer_of
from phalanx.offload.direct import aligned
from phalanx.optim import zero_gather
from phalanx.train import Trainer
from tests.checkpoints import record_losses
from tests.distributed.test_trainer_zero import _args, _data, _Net, _xent
from tests.harness import run_workers

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor  # the parameters' type under stage 3

STEPS = 20


def _full_params(trainer: Trainer, stage: int) -> dict[str, list[Any]] | None:
    """Rank 0's whole parameters as lists (tensors would cross the queue as shared memory
    that dies with the worker)."""
    full = zero3.full_state_dict(trainer.model, to=0) if stage == 3 else trainer.model.state_dict()
    return None if full is None else {k: v.tolist() for k, v in full.items()}


def _train(out: Path, stage: int, offload: str | None, files_seen: list[Any]) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if offload is not None:
        extra = {"zero_offload": offload, "zero_offload_window_mb": 0.001}
        if offload == "disk":
            extra["zero_offload_dir"] = str(out / "scratch")
    args = _args(
        out / f"run-{offload}",
        zero_stage=stage,
        max_steps=STEPS,
        save_steps=10_000,
        logging_steps=1,
        gradient_accumulation_steps=2,
        **extra,
    )
    trainer = Trainer(model=_Net(), args=args, train_dataset=_data(), loss_fn=_xent)
    losses = record_losses(trainer)
    trainer.train()
    if offload == "disk":
        inner = getattr(trainer.optimizer, "optim", trainer.optimizer)
        streamer = streamer_of(inner)
        assert streamer is not None, "the optimizer does not stream its state"
        files = streamer.files
        state = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
        big = [v for v in state if getattr(v, "_local_tensor", v).numel() > 1]
        files_seen.append(
            {
                "state_in_files": all(files.holds(getattr(v, "_local_tensor", v)) for v in big),
                "state_tensors": len(big),
                "params_in_files": [
                    files.holds(cast("DTensor", p)._local_tensor)
                    for p in trainer.model.parameters()
                ]
                if stage == 3
                else None,
                "directory": str(files.directory),
                "exists_while_training": files.directory.is_dir(),
                "read_bytes": streamer.stats.read_bytes,
                "direct_bytes": streamer.stats.direct_bytes,
                "shard_pages_bytes": sum(
                    aligned(cast("DTensor", p)._local_tensor.nbytes)
                    for p in trainer.model.parameters()
                )
                if stage == 3
                else 0,
                "written_bytes": streamer.stats.written_bytes,
                # what a step writes at most: each state tensor once, whole pages by O_DIRECT
                "state_pages_bytes": sum(
                    aligned(getattr(v, "_local_tensor", v).nbytes)
                    for v in state
                    if files.holds(getattr(v, "_local_tensor", v))
                ),
            }
        )
    full = _full_params(trainer, stage)
    trainer.close()
    if offload == "disk":
        files_seen[-1]["exists_after_close"] = Path(files_seen[-1]["directory"]).exists()
    return {"losses": losses, "params": full}


def _both(rank: int, world: int, out: str, stage: int) -> dict[str, Any]:
    # ZeRO-1/2 gather (and step) a few pieces at a time: several gathers a step here.
    zero_gather.GATHER_BUCKET_BYTES = 256
    seen: list[Any] = []
    plain = _train(Path(out), stage, None, seen)
    disk = _train(Path(out), stage, "disk", seen)
    return {"plain": plain, "disk": disk, "seen": seen[0]}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_disk_offload_equals_in_memory(tmp_path: Path, stage: int) -> None:
    outcomes = run_workers(_both, 2, str(tmp_path), stage, timeout=240)
    for o in outcomes:
        seen = o.value["seen"]
        assert seen["exists_while_training"] and not seen["exists_after_close"], seen
        assert seen["state_in_files"] and seen["state_tensors"] > 0, seen
        assert seen["read_bytes"] > 0, seen
        if stage in (1, 2):  # the state only: each byte written once a step, not each gather
            assert 0 < seen["written_bytes"] <= STEPS * seen["state_pages_bytes"], seen
        if stage == 3:
            assert all(seen["params_in_files"]), seen
            # Each step moves the shards by O_DIRECT with the state, both ways (the first
            # step's state is made in memory, then moved into files).
            state, shards = seen["state_pages_bytes"], seen["shard_pages_bytes"]
            assert seen["direct_bytes"] == 2 * (STEPS * shards + (STEPS - 1) * state), seen
        plain, disk = o.value["plain"], o.value["disk"]
        assert len(plain["losses"]) == STEPS
        assert max(abs(a - b) for a, b in zip(plain["losses"], disk["losses"])) <= 1e-6
    params_plain = outcomes[0].value["plain"]["params"]
    params_disk = outcomes[0].value["disk"]["params"]
    assert params_plain.keys() == params_disk.keys()
    for key in params_plain:
        plain, disk = torch.tensor(params_plain[key]), torch.tensor(params_disk[key])
        diff = (plain - disk).abs().max().item()
        assert diff <= 1e-6, (key, diff)
    assert list((tmp_path / "scratch").iterdir()) == []


def _resume(rank: int, world: int, out: str, stage: int) -> dict[str, Any]:
    """12 steps straight (saving at 6 and 12), then a new Trainer resumed from the save at
    6 to 12, both with disk offload."""
    root = Path(out)
    results = {}
    for name in ("straight", "resumed"):
        args = _args(
            root / name,
            zero_stage=stage,
            max_steps=12,
            save_steps=6,
            gradient_accumulation_steps=2,
            zero_offload="disk",
            zero_offload_dir=str(root / "scratch"),
            zero_offload_window_mb=0.001,
        )
        trainer = Trainer(model=_Net(), args=args, train_dataset=_data(), loss_fn=_xent)
        resume = str(root / "straight" / "checkpoint-6") if name == "resumed" else None
        trainer.train(resume_from_checkpoint=resume)
        results[name] = _full_params(trainer, stage)
        trainer.close()
    return results


@pytest.mark.parametrize("stage", [1, 3])
def test_offloaded_run_resumes_bit_identical(tmp_path: Path, stage: int) -> None:
    """The resumed run loads the checkpoint into fresh files (its first run's scratch
    directory is gone) and ends where the uninterrupted run ends, bit for bit."""
    value = run_workers(_resume, 2, str(tmp_path), stage, timeout=240)[0].value
    for key in value["straight"]:
        assert value["straight"][key] == value["resumed"][key], key
    assert list((tmp_path / "scratch").iterdir()) == []


class _Wide(torch.nn.Module):
    """1 MB of parameters: 0.5 MB per rank of shards, as much of gradients, twice that of
    Adam's state."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 256)
        )

    def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:
        return self.net(batch[0])


def _offload_into(rank: int, world: int, out: str, scratch: str) -> str:
    import phalanx

    phalanx.init(backend="gloo")
    torch.manual_seed(0)
    model = _Wide()
    args = _args(
        Path(out),
        zero_stage=3,
        max_steps=2,
        zero_offload="disk",
        zero_offload_dir=scratch,
    )
    data = torch.utils.data.TensorDataset(torch.randn(32, 256), torch.randn(32, 256))
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        loss_fn=lambda out, batch: torch.nn.functional.mse_loss(out, batch[1]),
    )
    trainer.train()
    return "trained"


def test_a_full_offload_disk_is_one_line_on_every_rank(tmp_path: Path, small_disk: Path) -> None:
    """4 MB of tmpfs holds the shards and their gradients but not Adam's state: the first
    step fails on every rank with the disk named, whichever rank's disk filled."""
    outcomes = run_workers(
        _offload_into, 2, str(tmp_path / "out"), str(small_disk), init_pg=False, allow_errors=True
    )
    for o in outcomes:
        assert o.error_type == "OffloadError", (o.error_type, o.error)
        assert f"zero_offload_dir={small_disk}: the disk is full" in (o.error or "")
        assert "\n" not in (o.error or "").strip()
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_an_unwritable_offload_dir_is_one_line_on_every_rank(
    tmp_path: Path, read_only_dir: Path
) -> None:
    outcomes = run_workers(
        _offload_into,
        2,
        str(tmp_path / "out"),
        str(read_only_dir),
        init_pg=False,
        allow_errors=True,
    )
    for o in outcomes:
        assert o.error_type == "OffloadError", (o.error_type, o.error)
        assert f"zero_offload_dir={read_only_dir}: cannot create" in (o.error or "")


def _io_spans(rank: int, world: int, out: str) -> list[str]:
    root = Path(out)
    args = _args(
        root / "run",
        zero_stage=3,
        max_steps=2,
        save_steps=10_000,
        zero_offload="disk",
        zero_offload_dir=str(root / "scratch"),
        zero_offload_window_mb=0.001,
        timeline=str(root / "trace.json"),
    )
    trainer = Trainer(model=_Net(), args=args, train_dataset=_data(), loss_fn=_xent)
    trainer.train()
    assert trainer.timeline is not None
    spans = [name for name, track, *_ in trainer.timeline.spans if track == "io"]
    trainer.close()
    return spans


def test_the_trainer_puts_offload_io_on_the_timeline(tmp_path: Path) -> None:
    """The offloaded step's reads and writes are spans on the timeline's "io" track."""
    for o in run_workers(_io_spans, 2, str(tmp_path), timeout=120):
        assert "offload read" in o.value and "offload write" in o.value, o.value
