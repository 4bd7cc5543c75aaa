"""What a machine with one GPU can show that CI cannot, in one table (benchmarks/gpu_check.sh).

Each row is a test of tests/gpu, run by pytest in one session (`--junitxml`): NCCL
at world 1, stage 3 with CPU offload from pinned memory, bf16 (and fp16) in the
Trainer, a background save's pinned staging and a resume bit-exact after it,
torch's fused CUDA AdamW under phalanx's DDP. Where torch sees no CUDA device
every row says "skipped" and the script exits 0; a failed row exits 1. Meant to
finish in under 8 minutes on one GPU (each test has its own timeout).

    benchmarks/gpu_check.sh                 # the table
    benchmarks/gpu_check.sh --out FILE      # and the rows as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GPU_TESTS = "tests/gpu/"
CHECKS = [
    ("nccl at world 1: init picks nccl and cuda:0",
     "test_gpu.py::test_init_picks_nccl_and_the_ranks_gpu"),
    ("nccl at world 1: DDP equals torch DDP (bf16 autocast)",
     "test_gpu.py::test_ddp_matches_torch_ddp_on_cuda_with_nccl"),
    ("stage 3, CPU offload from pinned memory",
     "test_cpu_offload_cuda.py::test_cpu_offload_equals_in_memory_on_cuda"),
    ("bf16 Trainer", "test_gpu.py::test_trainer_mixed_precision_on_the_gpu[bf16]"),
    ("fp16 Trainer (GradScaler)", "test_gpu.py::test_trainer_mixed_precision_on_the_gpu[fp16]"),
    ("async save: pinned staging",
     "test_staging_fused_gpu.py::test_staging_copies_device_state_into_pinned_host_memory"),
    ("async save, resume bit-exact (CUDA RNG)", "test_gpu.py::test_cuda_rng_resume_is_bit_exact"),
    ("fused CUDA AdamW under phalanx DDP",
     "test_staging_fused_gpu.py::test_fused_cuda_adamw_under_phalanx_ddp_equals_torch_ddp"),
    ("workers forked from the warm server (--start-method forkserver): nccl on their GPU",
     "test_launch_gpu.py::test_workers_forked_from_the_warm_server_use_their_gpu"),
]  # fmt: skip


def _device() -> str:
    code = (
        "import torch; print(torch.__version__, torch.version.cuda, "
        "torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    return done.stdout.strip() or done.stderr.strip()[-200:]


def _outcomes(junit: Path) -> dict[str, tuple[str, float, str]]:
    """Each test's (outcome, seconds, first line of why) from pytest's JUnit XML."""
    found = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"
        node = f"{path}::{case.get('name')}"
        outcome, why = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
                why = (
                    (child.get("message") or "").splitlines()[0][:70]
                    if child.get("message")
                    else ""
                )
                break
        found[node] = (outcome, float(case.get("time", 0.0)), why)
    return found


def run(extra: list[str]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        junit = Path(tmp) / "junit.xml"
        nodes = [GPU_TESTS + test for _, test in CHECKS]
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   f"--junitxml={junit}", *nodes, *extra]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
        subprocess.run(command, cwd=ROOT, env=env, check=False)
        outcomes = _outcomes(junit) if junit.exists() else {}
    rows = []
    for what, test in CHECKS:
        node = GPU_TESTS + test
        outcome, seconds, why = outcomes.get(node, ("not run", 0.0, "pytest did not report it"))
        rows.append(
            {"check": what, "test": node, "result": outcome, "seconds": seconds, "why": why}
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    opts, extra = parser.parse_known_args()
    device, started = _device(), time.time()
    rows = run(extra)
    width = max(len(r["check"]) for r in rows)
    print(f"\ngpu check: {device}; {time.strftime('%Y-%m-%d')}, {time.time() - started:.0f} s")
    print(f"{'check':{width}}  {'result':8}  {'s':>6}  why")
    for r in rows:
        print(f"{r['check']:{width}}  {r['result']:8}  {r['seconds']:6.1f}  {r['why']}")
    if opts.out is not None:
        opts.out.write_text(json.dumps({"device": device, "rows": rows}, indent=1) + "\n")
    return 1 if any(r["result"] not in ("passed", "skipped") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
