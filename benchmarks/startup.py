"""The launcher's own cost: from the command to the first training step, ours against torchrun.

Both launch the same script (first_step.py: init, DDP, one step) on 2 ranks,
alternately (phalanx, torchrun, phalanx, ...), so machine noise hits both
alike. `phalanx launch` imports no torch in the launcher process; torchrun
does, before it starts any worker.

    python benchmarks/startup.py --trials 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parent / "first_step.py"


def commands() -> dict[str, list[str]]:
    bin_dir = Path(sys.executable).parent
    phalanx = str(bin_dir / "phalanx") if (bin_dir / "phalanx").exists() else "phalanx"
    return {
        "phalanx": [phalanx, "launch", "--nproc-per-node", "2", str(SCRIPT)],
        "torchrun": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(SCRIPT),
        ],
    }


def once(command: list[str]) -> float:
    """Seconds from starting `command` to the FIRST_STEP line its rank 0 prints."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.time()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    for line in (proc.stdout + proc.stderr).splitlines():
        if "FIRST_STEP" in line:
            return float(line.rsplit(" ", 1)[1]) - start
    raise RuntimeError(
        f"{command[0]} printed no FIRST_STEP (exit {proc.returncode}):\n{proc.stderr}"
    )


def measure(trials: int = 8) -> dict[str, Any]:
    runs: dict[str, list[float]] = {"phalanx": [], "torchrun": []}
    cmds = commands()
    once(cmds["phalanx"])  # warm the page cache for both, untimed
    once(cmds["torchrun"])
    for i in range(trials):
        order = ("phalanx", "torchrun") if i % 2 == 0 else ("torchrun", "phalanx")
        for name in order:
            runs[name].append(once(cmds[name]))
    med = {name: statistics.median(ts) for name, ts in runs.items()}
    result = {
        "trials": trials,
        "phalanx_s": med["phalanx"],
        "torchrun_s": med["torchrun"],
        "ratio": med["phalanx"] / med["torchrun"],
        "runs": runs,
    }
    print(
        f"command to first step, 2 ranks, median of {trials}: phalanx launch "
        f"{med['phalanx']:.2f} s, torchrun {med['torchrun']:.2f} s (ratio {result['ratio']:.2f})",
        flush=True,
    )
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    measure(parser.parse_args().trials)
