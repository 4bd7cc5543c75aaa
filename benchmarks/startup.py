"""The launcher's own cost, ours against torchrun: from the command to the first training
step (`--to step`), or to the end of a job that joins the group and leaves (`--to exit`).

Both launch the same script (first_step.py: init, DDP, one step; or init_exit.py:
init, a barrier, shutdown) on 2 ranks, alternately (phalanx, torchrun, phalanx,
...), so machine noise hits both alike. `phalanx launch` imports no torch in
the launcher process; torchrun does, before it starts any worker.
`--baseline-src DIR` adds a third variant: `phalanx launch` with DIR's phalanx
first on PYTHONPATH (an older tree, to compare a change).

    python benchmarks/startup.py --to exit --trials 9 --out docs/results/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bytecode import compile_tree
from interleave import balanced_order

HERE = Path(__file__).resolve().parent
SCRIPTS = {"step": HERE / "first_step.py", "exit": HERE / "init_exit.py"}


def commands(script: Path) -> dict[str, list[str]]:
    """phalanx launch (fresh workers), phalanx launch --start-method forkserver (forked from
    a warm server, launch/forkstart.py) and torchrun, each on 2 ranks."""
    launch = [sys.executable, "-m", "phalanx", "launch", "--nproc-per-node", "2"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return {
        "phalanx": [*launch, str(script)],
        "phalanx-forkserver": [*launch, "--start-method", "forkserver", str(script)],
        "torchrun": [*torchrun, "--nproc-per-node", "2", str(script)],
    }


def once(command: list[str], to: str, pythonpath: str | None = None) -> float:
    """Seconds from starting `command` to the FIRST_STEP line its rank 0 prints (`to` step),
    or to its end (`to` exit)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    start = time.time()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{command} exited {proc.returncode}:\n{proc.stderr}")
    if to == "exit":
        return time.time() - start
    for line in (proc.stdout + proc.stderr).splitlines():
        if "FIRST_STEP" in line:
            return float(line.rsplit(" ", 1)[1]) - start
    raise RuntimeError(f"{command[0]} printed no FIRST_STEP:\n{proc.stderr}")


def measure(trials: int, to: str, baseline_src: str | None) -> dict[str, Any]:
    cmds = commands(SCRIPTS[to])
    paths: dict[str, str | None] = dict.fromkeys(cmds)
    if baseline_src:
        cmds["baseline"], paths["baseline"] = cmds["phalanx"], baseline_src
    runs: dict[str, list[float]] = {name: [] for name in cmds}
    for name in cmds:  # warm the page cache for each, untimed
        once(cmds[name], to, paths[name])
    for i in range(trials):
        for name in balanced_order(i, list(cmds)):
            runs[name].append(once(cmds[name], to, paths[name]))
    med = {name: statistics.median(ts) for name, ts in runs.items()}
    result: dict[str, Any] = {
        "to": to,
        "trials": trials,
        "machine": f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end",
        "date": time.strftime("%Y-%m-%d"),
        "median_s": med,
        "ratio": med["phalanx"] / med["torchrun"],
        "forkserver_ratio": med["phalanx-forkserver"] / med["torchrun"],
        "runs": runs,
    }
    shown = ", ".join(f"{name} {s:.2f} s" for name, s in med.items())
    what = "first step" if to == "step" else "the end of init + barrier"
    print(
        f"command to {what}, 2 ranks, median of {trials}: {shown} "
        f"(phalanx ÷ torchrun {result['ratio']:.2f}, "
        f"forkserver ÷ torchrun {result['forkserver_ratio']:.2f})",
        flush=True,
    )
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=9)
    parser.add_argument("--to", choices=sorted(SCRIPTS), default="step")
    parser.add_argument("--baseline-src", default=None, help="an older tree's src/ to compare")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = parser.parse_args()
    compile_tree()
    result = measure(args.trials, args.to, args.baseline_src)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
