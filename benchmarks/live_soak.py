"""The sharded live-recovery soak (issue 38): trials at ZeRO stages 1, 2, 3 and 3 with disk
offload, each checked for everything a lost rank must not cost, and the figures written.

Each trial trains tests/faults/scripts/live_trainer.py (the Trainer, 3 ranks, 120 steps,
a checkpoint every 20) under `phalanx launch --live-recovery --max-restarts 1`, losing a
random rank at a random step of 3-39 (SIGKILL, or SIGSTOP: a stall its launcher fences),
then replays the run's recorded membership (the loss at the step it went on from, the
replacement let in at the same step). Per trial, the figures and the checks:

- seconds from the loss to the survivors' first step (must be < 10);
- no checkpoint read after the loss: the access time of every file of the checkpoints
  saved before it is older than the loss (the mount's relatime updates it at the first
  read of a file written since; the script first shows a read is seen), but for the
  manifests every save reads to know the run's checkpoints, and a save still in flight
  at the loss, which reads its own files to hash them;
- the replacement joined: the last step ran on 3 ranks;
- check_replicas every 5 steps at stages 1-2 (the parameters are replicated there; at
  stage 3 nothing is, and the eval loss of each member's whole model must agree);
- every step applied by every member of its world, each finished epoch's samples once
  (no rolled-back step counted);
- `phalanx consolidate` of the final checkpoint equals the replay's, tensor for tensor.

    python benchmarks/live_soak.py --trials 20 --out docs/results/live_soak.json  # ~1 h
    python benchmarks/live_soak.py --trials 1 --settings 3     # one trial, ~1 minute
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from phalanx.train.checkpoint.directory import MANIFEST

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "faults" / "scripts" / "live_trainer.py"
SETTINGS = ("1", "2", "3", "3-disk")
STEPS, SAMPLES, SAVE_EVERY = 120, 480, 20
FLAGS = ["--nproc-per-node", "3", "--live-recovery", "--live-stall-timeout", "5",
         "--max-restarts", "1", "--exit-timeout", "60"]  # fmt: skip


class RunHung(Exception):
    """A launch that did not end in 400 s, or a worker of it killed hung in its exit; its
    output and stacks are in the named file."""


def launch(out: Path, ledger: Path, env: dict[str, str]) -> str:
    """One run to its end (it must succeed): its merged output."""
    ledger.mkdir(parents=True)
    full = {**os.environ, "LEDGER_DIR": str(ledger), "OMP_NUM_THREADS": "1",
            "SAVE_STEPS": str(SAVE_EVERY), **env}  # fmt: skip
    argv = [sys.executable, "-m", "phalanx", "launch", *FLAGS, str(SCRIPT), str(out), str(STEPS)]
    run = subprocess.Popen(argv, env=full, cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        text, _ = run.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        stacks = _stacks(run.pid)  # before the kill: where each process of the run waits
        run.kill()
        text, _ = run.communicate()
        (ledger.parent / "hung.log").write_text(text + "\n" + stacks)
        print(f"a run hung (400 s): {env}\n{text[-4000:]}\n{stacks}", flush=True)
        raise RunHung(str(ledger.parent / "hung.log")) from None
    if run.returncode != 0:
        raise SystemExit(f"a run failed ({run.returncode}): {env}\n{text[-4000:]}")
    if "hung in its teardown" in text:  # the launcher killed it, with its stacks: a finding
        (ledger.parent / "hung.log").write_text(text)
        print(f"a worker hung in its exit: {env}\n{text[-4000:]}", flush=True)
        raise RunHung(str(ledger.parent / "hung.log"))
    return text


def _stacks(pid: int) -> str:
    """Every Python stack of the launcher `pid` and its workers, where py-spy is installed."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return "(no stacks: pip install py-spy to see where a hung run waits)"
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    dumps = []
    for each in [pid, *map(int, children.split())]:
        dump = subprocess.run([spy, "dump", "--pid", str(each)], capture_output=True, text=True)
        dumps.append(f"=== {each}\n{dump.stdout}{dump.stderr}")
    return "\n".join(dumps)


def applied_steps(ledger: Path, out: Path) -> dict[int, list[dict[str, Any]]]:
    """Each step's ledger entries, without those a later generation rolled back."""
    restarts = [(e["generation"], e["step"]) for e in _membership(out)]
    steps: dict[int, list[dict[str, Any]]] = {}
    for path in ledger.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            rolled_back = any(entry["gen"] < gen and entry["step"] > at for gen, at in restarts)
            if not rolled_back:
                steps.setdefault(int(entry["step"]), []).append(entry)
    return steps


def _membership(out: Path) -> list[dict[str, Any]]:
    path = out / "live_membership.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def exact_data(steps: dict[int, list[dict[str, Any]]]) -> tuple[bool, list[int]]:
    """Every step applied by every member of its world, each finished epoch's samples once
    (torch's padding repeats at most world - 1); the world per step."""
    if sorted(steps) != list(range(1, STEPS + 1)):
        return False, []
    worlds, by_epoch = [], dict[int, list[int]]()
    for step in range(1, STEPS + 1):
        entries = steps[step]
        world = entries[0]["world"]
        if len(entries) != world or any(e["world"] != world for e in entries):
            return False, []
        worlds.append(world)
        for entry in entries:
            by_epoch.setdefault(entry["epoch"], []).extend(entry["indices"])
    for epoch in sorted(by_epoch)[:-1]:
        seen = Counter(by_epoch[epoch])
        if set(seen) != set(range(SAMPLES)) or sum(seen.values()) - SAMPLES > max(worlds) - 1:
            return False, worlds
    return True, worlds


def read_after(out: Path, killed_at: float) -> list[str]:
    """Files of the checkpoints saved before the loss whose access time is after it. Not
    counted, since no state is loaded by them: a manifest (every later save reads the
    run's manifests to know its checkpoints, train/checkpoint/lineage.py), and the files of
    a checkpoint sealed after the loss (its manifest written then: it was still being
    saved when the loss came, and that save hashes what DCP wrote before it seals)."""
    read = []
    for path in out.glob("checkpoint-*/**/*"):
        manifest = out / path.relative_to(out).parts[0] / MANIFEST
        if path.name == MANIFEST or (manifest.exists() and manifest.stat().st_mtime >= killed_at):
            continue
        if path.is_file():
            stat = path.stat()
            if stat.st_mtime < killed_at and stat.st_atime > killed_at:
                read.append(str(path.relative_to(out)))
    return read


def consolidated(out: Path, work: Path, tag: str) -> dict[str, Any]:
    target = work / f"{tag}.pt"
    argv = [sys.executable, "-m", "phalanx", "consolidate", str(out / f"checkpoint-{STEPS}")]
    subprocess.run([*argv, str(target)], cwd=ROOT, check=True, capture_output=True, timeout=300)
    state: dict[str, Any] = torch.load(target, weights_only=True)
    return state


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


def trial(setting: str, member: str, step: int, how: str, work: Path) -> dict[str, Any]:
    stage, offload = setting.removesuffix("-disk"), "disk" if setting.endswith("-disk") else ""
    base = {"ZERO_STAGE": stage, "ZERO_OFFLOAD": offload,
            "REPLICA_CHECK_STEPS": "5" if stage in ("1", "2") else "0"}  # fmt: skip
    out, ledger = work / "run", work / "ledger"
    text = launch(out, ledger, {**base, "KILL_MEMBER": member, "KILL_STEP": str(step),
                                "KILL_SIGNAL": how, "HOLD_STEP": str(step + 3),
                                "HOLD_WORLD": "3"})  # fmt: skip
    killed = float((ledger / "killed_at").read_text())
    steps = applied_steps(ledger, out)
    exact, worlds = exact_data(steps)
    on_two = [e["t"] for entries in steps.values() for e in entries if e["world"] == 2]
    log = _membership(out)
    went_on_at = int(log[0]["step"]) if log else -1
    replay_out = work / "replay"
    recorded = str(out / "live_membership.jsonl")
    launch(replay_out, work / "replay_ledger", {**base, "KILL_MEMBER": member,
                                                "KILL_STEP": str(went_on_at),
                                                "PHALANX_LIVE_REPLAY": recorded})  # fmt: skip
    evals = set(re.findall(r"eval=(\S+)", text))
    result = {
        "setting": setting, "member": member, "step": step, "signal": how,
        "went_on_at_step": went_on_at,
        "rolled_back_steps": step - went_on_at,
        "first_step_after_loss_s": round(min(on_two) - killed, 3) if on_two else None,
        "checkpoint_files_read_after_loss": read_after(out, killed),
        "world_at_end": worlds[-1] if worlds else None,
        "exact_data": exact,
        "replicas_checked": base["REPLICA_CHECK_STEPS"] != "0",
        "replicas_agree": "ReplicaDivergenceError" not in text and len(evals) == 1,
        "consolidated_equals_replay": same(consolidated(out, work, "run"),
                                           consolidated(replay_out, work, "replay")),
    }  # fmt: skip
    first = min(on_two) - killed if on_two else None
    result["passed"] = bool(
        first is not None and first < 10 and not result["checkpoint_files_read_after_loss"]
        and result["world_at_end"] == 3 and exact and result["replicas_agree"]
        and result["consolidated_equals_replay"]
    )  # fmt: skip
    return result


def a_read_is_seen(work: Path) -> bool:
    """The detector itself: a file written, renamed into place and then read shows the read."""
    path = work / "probe"
    (work / "probe.tmp").write_bytes(b"x" * 4096)
    os.replace(work / "probe.tmp", path)
    before = time.time()
    time.sleep(0.05)
    path.read_bytes()
    return path.stat().st_atime > before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="per setting")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="of " + ",".join(SETTINGS))
    parser.add_argument("--seed", type=int, default=38)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    ns = parser.parse_args()
    rng = random.Random(ns.seed)
    root = Path(tempfile.mkdtemp(prefix="live-soak-"))
    seen = a_read_is_seen(root)
    print(f"a read after a write is seen by the access time here: {seen}", flush=True)
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    for setting in ns.settings.split(","):
        for index in range(ns.trials):
            member, step = f"r{rng.randrange(3)}", rng.randrange(3, 40)
            how = ("SIGKILL", "SIGSTOP")[index % 2]
            work = root / f"{setting}-{index}"
            try:
                result = trial(setting, member, step, how, work)
                shutil.rmtree(work, ignore_errors=True)
            except RunHung as hung:  # counted as failed; its directory kept for a look
                result = {"setting": setting, "member": member, "step": step, "signal": how,
                          "hung": str(hung), "passed": False}  # fmt: skip
            results.append(result)
            print(json.dumps(result), flush=True)
    passed = {
        s: sum(r["passed"] for r in results if r["setting"] == s) for s in ns.settings.split(",")
    }
    firsts = sorted(f for r in results if (f := r.get("first_step_after_loss_s")) is not None)
    summary = {"passed_per_setting": passed, "trials_per_setting": ns.trials,
               "first_step_after_loss_s": {"median": firsts[len(firsts) // 2] if firsts else None,
                                           "max": firsts[-1] if firsts else None},
               "atime_detector_works": seen,
               "wall_s": round(time.perf_counter() - started, 1)}  # fmt: skip
    print(json.dumps(summary), flush=True)
    if all(r["passed"] for r in results):
        shutil.rmtree(root, ignore_errors=True)
    if ns.out is not None:
        figures = {"settings": vars(ns) | {"out": str(ns.out)}, "summary": summary,
                   "trials": results}  # fmt: skip
        ns.out.write_text(json.dumps(figures, indent=1) + "\n")
    if not all(r["passed"] for r in results) or not seen:
        raise SystemExit("some trials failed: see above")


if __name__ == "__main__":
    main()
