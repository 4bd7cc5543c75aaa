"""A model that cannot train under a per-rank memory cap with DDP, and trains under ZeRO-3.

Each rank moves itself into a memory cgroup of its own (cgroup v1 or v2, as
root) with a hard limit, then trains an MLP of ~50M parameters (eight
2500x2500 layers) with Adam for a few steps: first as plain DDP (parameters,
gradients, bucket buffers and Adam's state all whole: about 1 GB per rank),
then, in fresh processes, with every layer a fully_shard unit (about 1/N of
that, plus one layer gathered at a time). The kernel, not our counting,
decides: a rank over its limit is killed.

    sudo python benchmarks/zero3_cap.py                      # world 2, 900 MB per rank
    python benchmarks/zero3_cap.py --cap-mb 800 --world 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import spawn
import torch
from torch import nn

CGROUP_V1 = Path("/sys/fs/cgroup/memory")
CGROUP_V2 = Path("/sys/fs/cgroup")


def cap_this_process(limit_mb: int) -> Path:
    """A cgroup just for this process, limited to `limit_mb`, with this process in it."""
    name = f"phalanx-cap-{os.getpid()}"
    if (CGROUP_V1 / "memory.limit_in_bytes").exists():
        group = CGROUP_V1 / name
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit_mb * 1024 * 1024))
        swap = group / "memory.memsw.limit_in_bytes"
        if swap.exists():  # no swapping our way around the limit
            swap.write_text(str(limit_mb * 1024 * 1024))
    else:
        group = CGROUP_V2 / name
        group.mkdir()
        (group / "memory.max").write_text(str(limit_mb * 1024 * 1024))
        (group / "memory.swap.max").write_text("0")
    (group / "cgroup.procs").write_text(str(os.getpid()))
    return group


def remove_empty_cgroups() -> None:
    """The ranks' cgroups, once their processes are gone (a cgroup with members stays)."""
    for root in (CGROUP_V1, CGROUP_V2):
        for group in root.glob("phalanx-cap-*"):
            with contextlib.suppress(OSError):
                group.rmdir()


def cgroups_usable() -> bool:
    root = CGROUP_V1 if (CGROUP_V1 / "memory.limit_in_bytes").exists() else CGROUP_V2
    return os.geteuid() == 0 and os.access(root, os.W_OK)


def build() -> nn.Sequential:
    return nn.Sequential(*(nn.Sequential(nn.Linear(2500, 2500), nn.Tanh()) for _ in range(8)))


def train_rank(rank: int, world: int, stage: int, cap_mb: int) -> dict[str, Any]:
    import resource

    import phalanx

    cap_this_process(cap_mb)
    torch.manual_seed(0)
    net = build()
    if stage == 3:
        for layer in net:
            phalanx.fully_shard(layer)
        model: Any = phalanx.fully_shard(net)
    else:
        model = phalanx.DistributedDataParallel(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(8, 2500, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def attempt(stage: int, world: int, cap_mb: int) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        ranks = spawn.run_ranks(train_rank, world, stage, cap_mb, timeout=600)
    except SystemExit as exc:  # a rank died (the kernel's OOM killer) or failed
        return {"trained": False, "why": str(exc).splitlines()[0], "s": time.perf_counter() - start}
    return {"trained": True, "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap-mb", type=int, default=900)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "zero3_cap.json"
    )
    args = parser.parse_args(argv)
    if not cgroups_usable():
        print("needs root and a writable memory cgroup hierarchy — run as root", file=sys.stderr)
        return 2
    params = sum(p.numel() for p in build().parameters())
    result = {"params": params, "cap_mb": args.cap_mb, "world": args.world}
    for stage in (0, 3):
        result[f"stage{stage}"] = outcome = attempt(stage, args.world, args.cap_mb)
        print(
            f"stage {stage}, {params / 1e6:.0f}M params, cap {args.cap_mb} MB per rank: {outcome}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    ok = not result["stage0"]["trained"] and result["stage3"]["trained"]
    print("stage 0 does not fit, stage 3 trains" if ok else "NOT SHOWN: see the outcomes above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
