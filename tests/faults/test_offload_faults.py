"""Disk offload hit for real (issue 23, "Faults"): a rank SIGKILLed in the middle of an
offloaded optimizer step, then a fresh `phalanx launch` that resumes.

Every trial runs tests/e2e/scripts/trainer_resume.py (2 ranks, dropout, shuffled
data, ZeRO stage 1, 2 or 3 with `zero_offload="disk"` and a window so small
that each tensor is one, a checkpoint every 4 steps, 12 steps) and kills one
rank from inside the streamed step (faultkit.kill_in_offload_step): after a
window's update is made in its mapped pages, or in the I/O thread half way
through writing a window back (through its mappings, or at stages 1-2, where a
window's state is all moved by O_DIRECT, half of that written: before, such a
trial was never killed, and its run ended with exit 0). The rank writes where it died first, so the
kill is known to have come from inside the step, never from a guessed sleep.
After the kill the newest checkpoint must verify against its manifest, and the
dead rank's scratch directory (torn state: half a step in its files) must
still be there; the restart must resume from that checkpoint, end with the
uninterrupted run's parameters bit for bit, and, as the kernel sees it
(/proc/self/maps and fds), map or open only files of its own new directory
(named after its own pid) while the dead run's directory is gone.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from phalanx.train.checkpoint.directory import list_checkpoints, verify_checkpoint
from tests.launchkit import SCRIPTS, clean_env, launch

pytestmark = pytest.mark.faults

SCRIPT = SCRIPTS / "trainer_resume.py"
RUN_TIMEOUT_S = 240
SAVE_STEPS = 4
MAX_STEPS = 12
PREFIX = "phalanx-offload-"


def _run(out: Path, stage: int, *flags: object) -> tuple[int, str]:
    result = launch(
        "--nproc-per-node 2",
        SCRIPT,
        out,
        out.with_suffix(".pt"),
        *("--save-steps", SAVE_STEPS, "--max-steps", MAX_STEPS, "--zero-stage", stage),
        *("--zero-offload-dir", out.with_suffix(".offload")),
        *flags,
        env=clean_env(OMP_NUM_THREADS="1"),
        merge=True,
        timeout_s=RUN_TIMEOUT_S,
    )
    return result.returncode, result.stdout


def _pid_of(directory: str) -> int:
    """The owner's pid in a scratch directory's name:
    phalanx-offload-<host>-<boot id>-<pid namespace>-<pid>-rank<r>-*."""
    assert directory.startswith(PREFIX), directory
    return int(directory.split("-rank")[0].rsplit("-", 1)[1])


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Each stage's uninterrupted offloaded run, made when a trial first needs it."""
    root = tmp_path_factory.mktemp("reference")

    class Lazy(dict[int, Path]):
        def __missing__(self, stage: int) -> Path:
            out = root / f"stage{stage}"
            code, printed = _run(out, stage)
            assert code == 0, printed
            self[stage] = out.with_suffix(".pt")
            return self[stage]

    return Lazy()


@dataclass
class Trial:
    fault: str
    stage: int
    problems: list[str] = field(default_factory=list)
    printed: str = ""


def _identical(a: Path, b: Path) -> bool:
    first, second = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def _after_the_kill(out: Path, trial: Trial, step: int, rank: int) -> tuple[int, int]:
    """Check what the kill left; return the killed rank's pid and the newest checkpoint's
    step (0: none).

    Every save before the killed step is there, except that the newest may be missing:
    a background save still in flight (one at a time; on a loaded machine it can
    outlive a step or two) is lost with its rank, never half there, and the restart
    resumes from the one before."""
    marker = out.with_suffix(".killed")
    if not marker.exists():
        trial.problems.append("the rank was not killed inside the offloaded step")
        return -1, 0
    died = json.loads(marker.read_text())
    if (died["step"], died["rank"]) != (step, rank):
        trial.problems.append(f"killed at the wrong place: {died}")
    expected = [s for s in range(SAVE_STEPS, step, SAVE_STEPS)]
    found = list_checkpoints(out)
    steps = sorted(s for s, _ in found)
    in_flight = bool(expected) and steps == expected[:-1]
    if steps != expected and not in_flight:
        trial.problems.append(f"checkpoints after the kill: {found}, expected {expected}")
    for _, path in found:
        verify_checkpoint(path)  # raises on a torn or damaged file
    left = [p.name for p in out.with_suffix(".offload").iterdir()]
    if not any(_pid_of(name) == died["pid"] for name in left):
        trial.problems.append(f"the dead rank's scratch directory is not there: {left}")
    return int(died["pid"]), max(steps, default=0)


def _after_the_restart(out: Path, trial: Trial, dead: int, resumed_from: int) -> None:
    expected = f"resumed from checkpoint-{resumed_from} " if resumed_from else "no checkpoint in"
    if expected not in trial.printed:
        trial.problems.append(f"did not print {expected!r}")
    reports = [
        json.loads((out.with_suffix(".report") / f"rank{r}.json").read_text()) for r in (0, 1)
    ]
    pids = {report["pid"] for report in reports}
    for report in reports:
        directory = Path(report["directory"])
        if _pid_of(directory.name) != report["pid"] or report["pid"] == dead:
            trial.problems.append(f"rank's directory is not its own new one: {report}")
        stray = [f for f in report["files_used"] if Path(f).parent != directory]
        if stray or not report["files_used"]:
            trial.problems.append(f"the restart used offload files not its own: {stray}")
        if any(_pid_of(name) not in pids for name in report["parent_now"]):
            trial.problems.append(f"a dead run's directory was not swept: {report['parent_now']}")
    if list(out.with_suffix(".offload").iterdir()) or list(out.glob("*.tmp")):
        trial.problems.append("scratch or a torn checkpoint left after the clean exit")


def _trial(tmp_path: Path, references: dict[int, Path], rng: random.Random, i: int) -> Trial:
    stage = rng.choice([1, 2, 3])
    step = rng.choice([s for s in range(1, MAX_STEPS) if s % SAVE_STEPS])  # a save step's
    rank, window = rng.randint(0, 1), rng.randint(0, 3)  # write-behind could outlive its step
    point = rng.choice(["stepped", "writing"])
    where = f"{step}:{rank}:{window}:{point}"
    trial = Trial(where, stage)
    reference = references[stage]
    out = tmp_path / f"trial{i}"
    code, trial.printed = _run(out, stage, "--kill-in-offload-step", where)
    if code == 0:
        trial.problems.append("the killed run exited 0")
        return trial
    dead, newest = _after_the_kill(out, trial, step, rank)
    code, trial.printed = _run(
        out, stage, "--resume", "--offload-report", out.with_suffix(".report")
    )
    if code != 0:
        trial.problems.append(f"the restart failed: exit {code}")
        return trial
    _after_the_restart(out, trial, dead, resumed_from=newest)
    if not _identical(reference, out.with_suffix(".pt")):
        trial.problems.append("the restart's parameters differ from the uninterrupted run's")
    return trial


def _soak(tmp_path: Path, references: dict[int, Path], trials: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    results = [_trial(tmp_path, references, rng, i) for i in range(trials)]
    good = sum(not t.problems for t in results)
    print(f"offload kill soak: {trials} trials, {good} resumed bit-identical with nothing stale")
    return [
        f"stage {t.stage} {t.fault}: {t.problems}\n{t.printed[-2000:]}"
        for t in results
        if t.problems
    ]


@pytest.mark.slow  # its soak too; make test keeps the offloaded full disk and the async kill
@pytest.mark.timeout(4 * RUN_TIMEOUT_S)
def test_a_sigkill_inside_an_offloaded_step_restarts_bit_identical(
    tmp_path: Path, references: dict[int, Path]
) -> None:
    assert _soak(tmp_path, references, 1, seed=23) == []


@pytest.mark.slow
@pytest.mark.timeout(50 * RUN_TIMEOUT_S)
def test_soak_20_sigkills_inside_offloaded_steps(
    tmp_path: Path, references: dict[int, Path]
) -> None:
    assert _soak(tmp_path, references, 20, seed=2323) == []
