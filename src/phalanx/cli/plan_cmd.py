"""`phalanx plan MODEL --global-batch N --world N [--budget 8GB]`: which ZeRO stage, offload
and micro-batch to train with.

MODEL is `path/to/file.py:build` or `package.module:build`, a function that
returns the model; it is called on the meta device, so nothing of the model is
allocated. The batch is `--batch MODULE:FN` (FN(n) returns a micro-batch of n
samples, called on the meta device too) or `--input SHAPE[:DTYPE]`, one
sample's shape (`1024`, or `64:int64` for 64 token ids); the loss is
`--loss MODULE:FN` (FN(outputs, batch)), else the model's own (a dict or
object with `.loss`) or the mean of its output. The machine is probed as a
world of `--world` ranks on this host (the collectives through the launcher).
Prints the plan's table, or one line naming the smallest budget that would
fit. Imports torch only when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from phalanx.errors import PhalanxError

OPTIMS = ("adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "rmsprop")


def build_parser() -> argparse.ArgumentParser:
    """The flags (docs/planner.md has their table)."""
    parser = argparse.ArgumentParser(
        prog="phalanx plan",
        usage="phalanx plan MODEL --global-batch N --world N [--budget 8GB] "
        "(--input SHAPE[:DTYPE] | --batch MODULE:FN)",
        description=__doc__.split("\n\n")[0].split(": ", 1)[1],
    )
    add = parser.add_argument
    add("model", help="file.py:build or module:build, a function returning the model")
    add("--global-batch", type=int, required=True, help="samples per optimizer step, all ranks")
    add("--world", type=int, default=1, help="ranks the run will have (default 1)")
    add("--budget", default=None, help="memory per rank (e.g. 8GB); default: detected")
    add("--input", default=None, help="one sample's shape and dtype, e.g. 1024 or 64:int64")
    add("--batch", default=None, help="MODULE:FN giving a micro-batch of n samples")
    add("--loss", default=None, help="MODULE:FN(outputs, batch) giving the loss")
    add("--optim", default="adamw_torch", choices=OPTIMS, help="the Trainer's optim")
    add("--units", default=None, help="stage 3's unit classes, e.g. Block (default: blocks)")
    add(
        "--keep-gathered",
        action="store_true",
        help="stage 3 alone, its units kept gathered (zero3_reshard_after_forward=False)",
    )
    add("--offload-dir", default=None, help="where disk offload would write (probed)")
    add("--no-offload", action="store_true", help="plan without disk offload")
    add("--json", type=Path, default=None, help="also write the plan as JSON here")
    return parser


def plan_main(argv: list[str]) -> int:
    """The command: the plan printed (0), or one line on stderr (1)."""
    ns = build_parser().parse_args(argv)
    try:
        text, document = run_plan(ns)
    except (PhalanxError, ValueError) as exc:
        print(f"phalanx plan: error: {exc}", file=sys.stderr, flush=True)
        return 1
    print(text, flush=True)
    if ns.json is not None:
        ns.json.write_text(json.dumps(document, indent=1))
    return 0


def load(spec: str) -> Any:
    """`file.py:name` or `module:name` -> the object."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"{spec!r} is not MODULE:NAME — e.g. mymodels.py:build")
    if where.endswith(".py"):
        location = importlib.util.spec_from_file_location(Path(where).stem, where)
        if location is None or location.loader is None or not Path(where).is_file():
            raise ValueError(f"{where!r} not found — check the path")
        module = importlib.util.module_from_spec(location)
        sys.modules[location.name] = module
        location.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    if not hasattr(module, name):
        raise ValueError(f"{where} has no {name!r} — name a function it defines")
    return getattr(module, name)


def run_plan(ns: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The plan's text and JSON (torch is imported here, when the command runs)."""
    from phalanx.train.plan import NothingFits, choose, render
    from phalanx.train.plan.inputs import plan_inputs
    from phalanx.train.plan.render import choice_json

    if ns.world < 1 or ns.global_batch < 1:
        raise ValueError("--world and --global-batch must be >= 1")
    count, budget, source, allowed = plan_inputs(ns, load)
    if ns.keep_gathered:  # as the Trainer plans it: the setting means stage 3
        allowed = [(stage, tier) for stage, tier in allowed if stage == 3]
    rates = probe(ns.world, None if ns.no_offload else ns.offload_dir or tempfile.gettempdir())
    try:
        choice = choose(
            count,
            rates,
            ns.world,
            ns.global_batch,
            budget,
            source,
            False,
            allowed,
            keep_gathered=ns.keep_gathered,
        )
    except NothingFits as exc:
        raise ValueError(str(exc)) from None
    return render(choice, ns.world, ns.global_batch), choice_json(choice, count, rates)


def probe(world: int, offload_dir: str | None) -> Any:
    """This machine's rates, probed by a job of `world` ranks under the launcher."""
    from phalanx.train.plan.probe import Rates, measure_rates

    if world == 1:
        return measure_rates(None, offload_dir)
    with tempfile.TemporaryDirectory(prefix="phalanx-plan-") as tmp:
        out = Path(tmp) / "rates.json"
        command = [sys.executable, "-m", "phalanx", "launch", "--nproc-per-node", str(world)]
        command += ["-m", "phalanx.train.plan.probe_job", "--out", str(out)]
        if offload_dir:
            command += ["--offload-dir", offload_dir]
        threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // world))
        env = {**os.environ, "OMP_NUM_THREADS": threads}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0 or not out.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
            raise ValueError(f"the probe job failed ({' '.join(tail)}) — is the world too large?")
        return Rates(**json.loads(out.read_text()))
