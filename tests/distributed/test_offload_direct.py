"""The optimizer state, and stage 3's shards, moved by O_DIRECT (offload/direct.py): the
same numbers as in memory, and their mappings coherent with what the direct I/O moved.

Two ranks train one model three ways in one process group: state in memory, in
files stepped by O_DIRECT (the default where the filesystem takes it), and in
files stepped through mappings (`direct=False`). Small windows make several per
step, so slabs are reused and writes wait for each other. After every step each
rank reads the offloaded state through its mappings (the way a checkpoint save
reads it), and the shards as a gather reads them, and they must equal the in-memory
run's bit for bit; half-way, the state and the shards are changed in place through
the mappings (as a checkpoint loaded in place changes them), and the next direct
step must read the change.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.harness import run_workers

WIDTH, LAYERS, STEPS = 192, 3, 6
CHANGE_AT = 3


def _build(stage: int, policy: Any) -> tuple[Any, Any]:
    import torch
    from torch import nn

    import phalanx

    torch.manual_seed(0)
    layers = [m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())]
    model = nn.Sequential(*layers[:-1])
    if stage == 1:
        opt = phalanx.ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.AdamW, lr=1e-2, fused=True, offload_policy=policy
        )
        return phalanx.DistributedDataParallel(model), opt
    offload = {} if policy is None else {"offload_policy": policy}
    for layer in list(model)[::2]:
        phalanx.fully_shard(layer, **offload)
    phalanx.fully_shard(model, **offload)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    return model, adamw if policy is None else phalanx.offload_optimizer(adamw, policy)


def _state(opt: Any) -> list[Any]:
    """Every state tensor's local values, read as a save reads them (through the mapping)."""
    inner = getattr(opt, "optim", opt)
    out = []
    for group in inner.param_groups:
        for p in group["params"]:
            for key in ("exp_avg", "exp_avg_sq"):
                value = inner.state[p].get(key) if p in inner.state else None
                if value is not None:
                    out.append(getattr(value, "_local_tensor", value).clone())
    return out


def _local(t: Any) -> Any:
    return getattr(t, "_local_tensor", t)


def _three_ways(rank: int, world: int, stage: int, scratch: str) -> dict[str, Any]:
    import torch

    import phalanx
    from phalanx.offload import streamer_of

    ways: dict[str, Any] = {"memory": None}
    for name, direct in (("direct", None), ("mapped", False)):
        ways[name] = phalanx.DiskOffloadPolicy(f"{scratch}/{name}", window_mb=0.1, direct=direct)
    runs = {name: _build(stage, policy) for name, policy in ways.items()}
    unequal: list[str] = []
    for step in range(STEPS):
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step * 7 + rank))
        states, shards = {}, {}
        for name, (model, opt) in runs.items():
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            states[name] = _state(opt)
            shards[name] = [_local(p).clone() for p in model.parameters()]
            if step == CHANGE_AT:  # in place, through the mappings: the next step must see it
                changed = [t for g in getattr(opt, "optim", opt).state.values() for t in g.values()]
                changed += list(model.parameters())
                with torch.no_grad():
                    for t in changed:
                        if torch.is_tensor(t) and t.numel() > 1:
                            _local(t).mul_(0.5)
        for name in ("direct", "mapped"):
            for what, seen in (("state", states), ("parameters", shards)):
                same = len(seen[name]) == len(seen["memory"]) and all(
                    torch.equal(a, b) for a, b in zip(seen[name], seen["memory"])
                )
                if not same:
                    unequal.append(f"{name} {what} at step {step}")
    moved = {}
    for name in ("direct", "mapped"):
        streamer = streamer_of(getattr(runs[name][1], "optim", runs[name][1]))
        assert streamer is not None
        moved[name] = (streamer.stats.direct_bytes, streamer.files.direct)
    return {"unequal": unequal, "moved": moved}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", [1, 3])
def test_state_moved_by_o_direct_equals_memory_and_its_mappings_stay_coherent(
    tmp_path: Path, stage: int
) -> None:
    from phalanx.offload.direct import supported

    if not supported(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    for out in run_workers(_three_ways, 2, stage, str(tmp_path), timeout=150):
        assert out.value["unequal"] == [], out.value
        (direct_bytes, direct_on), (mapped_bytes, mapped_on) = out.value["moved"].values()
        assert direct_on and direct_bytes > 0, out.value
        assert not mapped_on and mapped_bytes == 0, out.value


def test_a_filesystem_that_refuses_o_direct_steps_through_mappings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where an O_DIRECT open fails (EINVAL: what filesystems without it answer), the
    policy keeps the mappings, or says so in one line when direct=True asked for it."""
    import errno

    import phalanx
    from phalanx.errors import ConfigurationError

    real_open = os.open

    def refusing_open(path: Any, flags: int, *args: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    policy = phalanx.DiskOffloadPolicy(str(tmp_path / "a"))
    assert policy.files().direct is False
    with pytest.raises(ConfigurationError, match=r"refuses O_DIRECT .* leave direct=None"):
        phalanx.DiskOffloadPolicy(str(tmp_path / "b"), direct=True).files()
    monkeypatch.undo()
    assert phalanx.DiskOffloadPolicy(str(tmp_path / "c")).files().direct is True
    assert phalanx.DiskOffloadPolicy(str(tmp_path / "d"), direct=False).files().direct is False
