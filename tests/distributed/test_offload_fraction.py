"""Fractional disk offload in the Trainer, for real: part of the state in files, the rest in
memory, equal to the run without offload, and resumed bit for bit.

The model (tests/distributed/test_trainer_zero.py's `_Net`): net.0.weight 144
elements, net.3.weight 72, net.0.bias 24, net.3.bias 3. Under "coldest" at
stage 3 (docs/zero.md, "Fractional offload") a fraction of 0.25 puts half of
the state's bytes in files, the largest first (net.0.weight's alone), and no
shard; 0.75 puts all of the state and half of the shards' bytes (net.0.weight's
shard and gradient). Under "largest", 0.5 moves whole parameters: net.0.weight's
shard, gradient and state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from phalanx.offload import streamer_of
from phalanx.offload.fraction import Order
from phalanx.train import Trainer
from tests.checkpoints import record_losses
from tests.distributed.test_offload import _full_params
from tests.distributed.test_trainer_zero import _args, _data, _Net, _xent
from tests.harness import run_workers

STEPS = 12


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)


def _placement(trainer: Trainer) -> dict[str, list[bool]]:
    """For each parameter (stage 3), whether its shard and its state are in files."""
    return _placement_of(trainer.model, trainer.optimizer, None)


def _placement_of(model: Any, optimizer: Any, policy: Any) -> dict[str, list[bool]]:
    streamer = streamer_of(optimizer)
    assert streamer is not None
    files = streamer.files
    state = optimizer.state
    out = {}
    for name, p in model.named_parameters():
        moments = [v for v in state[p].values() if torch.is_tensor(v) and _local(v).numel() > 1]
        out[name] = [files.holds(_local(p)), all(files.holds(_local(v)) for v in moments)]
    return out


def _train(out: Path, stage: int, fraction: float | None) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if fraction is not None:
        extra = {
            "zero_offload": "disk",
            "zero_offload_dir": str(out / "scratch"),
            "zero_offload_window_mb": 0.001,
            "zero_offload_fraction": fraction,
        }
    args = _args(
        out / f"run-{fraction}",
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
    placement = _placement(trainer) if fraction is not None and stage == 3 else None
    inner = getattr(trainer.optimizer, "optim", trainer.optimizer)
    streamer = streamer_of(inner)
    counts = None
    if streamer is not None:
        moments = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)]
        big = [_local(v) for v in moments if v.numel() > 1]
        counts = [sum(streamer.files.holds(v) for v in big), len(big)]
    full = _full_params(trainer, stage)
    trainer.close()
    return {"losses": losses, "params": full, "placement": placement, "counts": counts}


def _both(rank: int, world: int, out: str, stage: int, fraction: float) -> Any:
    plain = _train(Path(out), stage, None)
    part = _train(Path(out), stage, fraction)
    return {"plain": plain, "part": part}


def _direct(rank: int, world: int, out: str, fraction: float, order: Order) -> dict[str, Any]:
    """fully_shard's own route (shard_model, offload_optimizer) with `order`, against the
    same route in memory: 6 steps of AdamW on the same batches."""
    from phalanx import zero3
    from phalanx.offload import DiskOffloadPolicy, offload_optimizer

    results: dict[str, Any] = {}
    for name in ("plain", "part"):
        policy = None
        if name == "part":
            policy = DiskOffloadPolicy(
                path=str(Path(out) / "scratch"), window_mb=0.001, fraction=fraction, order=order
            )
        model = zero3.shard_model(_Net(), offload_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if policy is not None:
            offload_optimizer(opt, policy)
        data = _data()
        for step in range(6):
            x, y = (
                data.tensors[0][step * 8 : step * 8 + 8],
                data.tensors[1][step * 8 : step * 8 + 8],
            )
            model.train(False)
            _xent(model([x, y]), [x, y]).backward()
            opt.step()
            opt.zero_grad()
        full = zero3.full_state_dict(model, to=0)
        results[name] = {
            "params": None if full is None else {k: v.tolist() for k, v in full.items()},
            "placement": _placement_of(model, opt, policy) if policy is not None else None,
        }
        if policy is not None:
            streamer = streamer_of(opt)
            assert streamer is not None
            streamer.close()
            policy.close()
    return results


CASES = {
    (3, 0.25, "coldest"): {
        "net.0.weight": [False, True],
        "net.0.bias": [False, False],
        "net.3.weight": [False, False],
        "net.3.bias": [False, False],
    },
    (3, 0.75, "coldest"): {
        "net.0.weight": [True, True],
        "net.0.bias": [False, True],
        "net.3.weight": [False, True],
        "net.3.bias": [False, True],
    },
    (1, 0.5, "coldest"): None,
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES), ids=lambda c: f"stage{c[0]}-{c[1]}")
def test_fractional_offload_equals_in_memory(tmp_path: Path, case: tuple[int, float, str]) -> None:
    stage, fraction, _ = case
    outcomes = run_workers(_both, 2, str(tmp_path), stage, fraction, timeout=240)
    for o in outcomes:
        plain, part = o.value["plain"], o.value["part"]
        assert len(plain["losses"]) == STEPS
        assert max(abs(a - b) for a, b in zip(plain["losses"], part["losses"])) <= 1e-6
        held, total = part["counts"]
        assert 0 < held <= total, part["counts"]
        if CASES[case] is not None and o.rank == 0:  # rank 1 holds 1 element of net.3.bias
            assert part["placement"] == CASES[case], part["placement"]
        else:  # stage 1 at 0.5: some of the state in files, not all
            assert held < total, part["counts"]
    plain, part = outcomes[0].value["plain"]["params"], outcomes[0].value["part"]["params"]
    for key in plain:
        diff = (torch.tensor(plain[key]) - torch.tensor(part[key])).abs().max().item()
        assert diff <= 1e-6, (key, diff)
    assert list((tmp_path / "scratch").iterdir()) == []


@pytest.mark.timeout(200)
def test_largest_moves_whole_parameters(tmp_path: Path) -> None:
    """order="largest" (FSDP2's cpu_offload_by_budget's rule) at 0.5: net.0.weight's shard,
    gradient and state in files, the rest in memory; equal to the in-memory run."""
    outcomes = run_workers(_direct, 2, str(tmp_path), 0.5, "largest", timeout=150)
    part = outcomes[0].value["part"]
    assert part["placement"] == {
        "net.0.weight": [True, True],
        "net.0.bias": [False, False],
        "net.3.weight": [False, False],
        "net.3.bias": [False, False],
    }
    plain = outcomes[0].value["plain"]["params"]
    for key in plain:
        diff = (torch.tensor(plain[key]) - torch.tensor(part["params"][key])).abs().max().item()
        assert diff <= 1e-6, (key, diff)


def _resume(rank: int, world: int, out: str) -> dict[str, Any]:
    """12 steps straight (saving at 6), then a new Trainer resumed from the save at 6, both
    at stage 3 with 0.75 of the state in files (state and shards alike split)."""
    root = Path(out)
    results = {}
    for name in ("straight", "resumed"):
        args = _args(
            root / name,
            zero_stage=3,
            max_steps=12,
            save_steps=6,
            gradient_accumulation_steps=2,
            zero_offload="disk",
            zero_offload_dir=str(root / "scratch"),
            zero_offload_window_mb=0.001,
            zero_offload_fraction=0.75,
        )
        trainer = Trainer(model=_Net(), args=args, train_dataset=_data(), loss_fn=_xent)
        resume = str(root / "straight" / "checkpoint-6") if name == "resumed" else None
        trainer.train(resume_from_checkpoint=resume)
        results[name] = {"params": _full_params(trainer, 3), "placement": _placement(trainer)}
        trainer.close()
    return results


@pytest.mark.timeout(300)
def test_a_fractional_run_resumes_bit_identical(tmp_path: Path) -> None:
    value = run_workers(_resume, 2, str(tmp_path), timeout=240)[0].value
    assert value["straight"]["params"] == value["resumed"]["params"]
    assert value["resumed"]["placement"] == CASES[(3, 0.75, "coldest")]
    assert list((tmp_path / "scratch").iterdir()) == []


def _mapped_after_backward(rank: int, world: int, out: str) -> dict[str, int]:
    """Stage 3, every shard and gradient in files: after forward and backward, how many bytes
    of the files this process maps resident (/proc/self/smaps), against their size."""
    from phalanx import zero3
    from phalanx.offload import DiskOffloadPolicy

    policy = DiskOffloadPolicy(path=str(Path(out) / "scratch"))
    torch.manual_seed(0)
    model = zero3.shard_model(
        torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4))),
        offload_policy=policy,
    )
    model(torch.randn(8, 256)).sum().backward()
    directory = str(policy.files().directory)
    resident, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = len(fields) >= 6 and fields[5].startswith(directory)
        elif inside and fields[:1] == ["Rss:"]:
            resident += int(fields[1]) * 1024
    size = policy.files().nbytes
    policy.close()
    return {"resident": resident, "size": size}


@pytest.mark.timeout(120)
def test_shards_and_gradients_in_files_leave_memory_once_used(tmp_path: Path) -> None:
    """A gather copies a unit's shards out of their files and a reduction writes its gradient
    shards in; then their pages are unmapped (the kernel's cache keeps them). Left mapped,
    all of them stayed resident until the optimizer step, and offloading the shards saved
    no resident memory (docs/zero.md, "Fractional offload")."""
    for o in run_workers(_mapped_after_backward, 2, str(tmp_path), timeout=90):
        assert o.value["size"] > 2**20, o.value  # 4 x 256 KB of shards, as much of gradients
        assert o.value["resident"] <= o.value["size"] // 10, o.value
