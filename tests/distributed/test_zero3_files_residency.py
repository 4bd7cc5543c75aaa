"""What stage 3 under disk offload keeps resident besides its windows: nothing it need not.

- `zero3.clip_grad_norm_`: torch's numbers, bit for bit, with the gradients read one at
  a time, so they are never all mapped into the process at once (torch's clip reads
  every gradient before it scales any: the whole gradient resident, just before the
  step that streams it a window at a time).
- A gradient kept in memory beside offloaded ones is its own tensor, not a view that
  keeps its unit's whole reduce-scatter output alive.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.harness import run_workers

WIDTH, LAYERS = 512, 6  # a weight's shard is 0.5 MB on 2 ranks


def _mapped_offload_kb(directory: str) -> int:
    """Resident kB of this process's mappings of files under `directory` (smaps)."""
    total, current = 0, ""
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$", line)
        if head:
            current = head.group(1)
        elif line.startswith("Rss:") and current.startswith(directory):
            total += int(line.split()[1])
    return total


def _offloaded_mlp(scratch: str) -> Any:
    """LAYERS Linears of WIDTH, each a unit with its shards in files under `scratch`."""
    import torch
    from torch import nn

    import phalanx

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layer = nn.Linear(WIDTH, WIDTH)
        phalanx.fully_shard(layer, offload_policy=phalanx.DiskOffloadPolicy(path=scratch))
        layers += [layer, nn.Tanh()]
    return phalanx.fully_shard(nn.Sequential(*layers))


def _clip(rank: int, world: int, scratch: str) -> dict[str, Any]:
    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor

    from phalanx import zero3

    model = _offloaded_mlp(scratch)
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(rank))
    (model(x) ** 2).sum().mul(100).backward()  # a norm well above max_norm: they scale
    params: list[Any] = [p for p in model.parameters() if p.grad is not None]
    copies: list[Any] = []
    for p in params:
        twin = nn.Parameter(p.detach().clone())
        twin.grad = p.grad.clone()
        copies.append(twin)
    expected = torch.nn.utils.clip_grad_norm_(copies, 1.0)
    expected = expected.full_tensor() if isinstance(expected, DTensor) else expected
    for unit in zero3.units(model):  # the copies read them all: unmapped again
        for group in unit.groups:
            for sp in group.params:
                grad: Any = sp.sharded.grad
                sp.home.settle([sp.local, grad._local_tensor])
    before = _mapped_offload_kb(scratch)
    norm = zero3.clip_grad_norm_(model, 1.0)
    after = _mapped_offload_kb(scratch)
    same = all(
        torch.equal(p.grad._local_tensor, c.grad._local_tensor) for p, c in zip(params, copies)
    )
    grad_kb = sum(p.grad._local_tensor.nbytes for p in params) // 1024
    return {"norm": norm.item(), "expected": expected.item(), "grads equal": same,
            "mapped before": before, "mapped after": after, "grad kb": grad_kb}  # fmt: skip


@pytest.mark.timeout(120)
def test_a_clip_of_gradients_in_files_is_torchs_and_maps_none_of_them(tmp_path: Path) -> None:
    for out in run_workers(_clip, 2, str(tmp_path)):
        got = out.value
        assert got["norm"] == got["expected"] and got["norm"] > 1.0, got
        assert got["grads equal"], got
        # Each gradient left the process once read and once scaled: nothing stays mapped
        # (torch's clip leaves every gradient resident: `grad kb` more).
        assert got["mapped after"] <= got["mapped before"] + 64 < got["grad kb"], got
        assert got["grad kb"] > 1024, got


def _faults_of_clips(rank: int, world: int, scratch: str) -> dict[str, Any]:
    """The page faults of a clip under its bound (1e9) and of one that scales (1e-3), each
    from the same start (every gradient settled out of the process), after one untimed."""
    import resource

    import torch

    from phalanx import zero3

    model = _offloaded_mlp(scratch)
    model(torch.randn(8, WIDTH)).square().sum().backward()
    faults, norms = {}, {}
    for name, bound in (("warm-up", 1e9), ("under", 1e9), ("scaling", 1e-3)):
        for unit in zero3.units(model):
            for group in unit.groups:
                for sp in group.params:
                    grad: Any = sp.sharded.grad
                    sp.home.settle([grad._local_tensor])
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        norms[name] = zero3.clip_grad_norm_(model, bound).item()
        faults[name] = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    grads: list[Any] = [p.grad for p in model.parameters()]
    pages = sum(g._local_tensor.nbytes for g in grads) // 4096
    return {"faults": faults, "norms": norms, "grad pages": pages}


@pytest.mark.timeout(120)
def test_a_clip_under_its_bound_touches_the_gradients_once(tmp_path: Path) -> None:
    """A norm under max_norm scales by 1.0, which changes no bit: skipped, so the gradients'
    pages are read once (the norm) and not faulted in and dirtied again (the multiply)."""
    for out in run_workers(_faults_of_clips, 2, str(tmp_path)):
        got = out.value
        assert got["norms"]["under"] == got["norms"]["scaling"], got
        under, scaling = got["faults"]["under"], got["faults"]["scaling"]
        assert got["grad pages"] > 256, got  # 0.5 MB shards: a fault count well above noise
        assert under < 0.75 * scaling, got  # measured: 65 against 936


def _mixed_unit(rank: int, world: int, scratch: str) -> dict[str, Any]:
    import torch
    from torch import nn

    import phalanx
    from phalanx import zero3

    torch.manual_seed(0)
    layer = nn.Linear(WIDTH, WIDTH)
    phalanx.fully_shard(layer, offload_policy=phalanx.DiskOffloadPolicy(path=scratch, fraction=0.9))
    layer(torch.randn(4, WIDTH)).sum().backward()
    (unit,) = zero3.units(layer)
    homes = {p.fqn: p.home.in_files for group in unit.groups for p in group.params}
    own = {}
    for name, p in layer.named_parameters():
        grad: Any = p.grad
        local = grad._local_tensor
        own[name] = local.untyped_storage().nbytes() == local.nbytes
    return {"in files": homes, "own storage": own}


@pytest.mark.timeout(120)
def test_a_gradient_kept_in_memory_beside_offloaded_ones_holds_only_itself(
    tmp_path: Path,
) -> None:
    """A unit partly in files: the bias's gradient, kept in memory, must not be a view of
    the unit's whole reduce-scatter output (it kept every unit's rows alive until
    zero_grad: +243 MB on the planner grid's 252M MLP at 3/4 in files)."""
    for out in run_workers(_mixed_unit, 2, str(tmp_path)):
        assert out.value["in files"] == {"weight": True, "bias": False}, out.value
        assert all(out.value["own storage"].values()), out.value
