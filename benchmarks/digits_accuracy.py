"""The test accuracy `examples/digits.py` prints, on every setting that could move it.

README quotes the digits example's figure; a trial on another machine printed
95.82% against README's 96.4%. This runs the example, with its defaults, for
every combination of:

- world size: 1 (`python examples/digits.py`) and 2 (`phalanx launch
  --nproc-per-node 2`, what `make demo` runs): the same 64 samples per step,
  but one mean over 64 against the average of two means over 32, which round
  differently;
- torch's CPU kernels: the vector ones (AVX2 / AVX-512, where the CPU has
  them) and the plain ones (`ATEN_CPU_CAPABILITY=default`);
- OMP_NUM_THREADS: 1 and 4 (the example sets one thread per rank itself, so
  these must agree; before it did, 2-16 threads printed 95.82%).

and writes each figure, with the machine's kernels and torch's version, as JSON
(docs/results/digits_accuracy.json holds the run README quotes;
tests/unit/test_readme_figures.py holds README to it).

    python benchmarks/digits_accuracy.py          # 8 runs, ~2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "digits.py"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "digits_accuracy.json"


def accuracy(world: int, kernels: str, threads: int, scratch: Path) -> float:
    """What the example prints as its test accuracy, run as a user runs it."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT / "src")}
    env.pop("ATEN_CPU_CAPABILITY", None)
    if kernels == "plain":
        env["ATEN_CPU_CAPABILITY"] = "default"
    launcher = ["-m", "phalanx", "launch", "--nproc-per-node", str(world)] if world > 1 else []
    argv = [sys.executable, *launcher, str(EXAMPLE), "--out", str(scratch / "digits.pt")]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    found = re.search(r"test accuracy: ([0-9.]+)", done.stdout)
    if done.returncode != 0 or not found:
        raise SystemExit(f"{argv} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr}")
    return float(found.group(1))


def vector_kernels() -> str | None:
    """The kernels torch picks here by default (None: only the plain ones)."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    return capability if capability in ("AVX2", "AVX512") else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    import torch

    vector = vector_kernels()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for world in (1, 2):
            for kernels in ("vector", "plain") if vector else ("plain",):
                for threads in (1, 4):
                    value = accuracy(world, kernels, threads, Path(scratch))
                    runs.append(
                        {"world": world, "kernels": kernels, "threads": threads, "accuracy": value}
                    )
                    print(f"world {world}, {kernels} kernels, {threads} threads: {value:.4f}")
    report = {"torch": torch.__version__, "vector_kernels": vector, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
