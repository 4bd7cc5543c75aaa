"""The Trainer under `phalanx launch`, hit for real: SIGTERM to the launcher, SIGKILLs at
random steps and ranks, SIGKILLs in the middle of a checkpoint save (issue 12, items 3-4
and the fault counts of "What it must show").

Every trial runs tests/e2e/scripts/trainer_resume.py (2 ranks, dropout, shuffled
data, 20 steps across two epoch boundaries, a checkpoint every 5 steps) and
must end with exactly the parameters of the uninterrupted run. The short
versions run one trial each; the soaks (slow) run 20 and print their counts,
recorded in docs/reliability.md.
"""

from __future__ import annotations

import random
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.launchkit import SCRIPTS, clean_env, launch

pytestmark = pytest.mark.faults

SCRIPT = SCRIPTS / "trainer_resume.py"
RUN_TIMEOUT_S = 240  # a loaded two-core machine takes up to ~40 s per attempt
SAVE_STEPS = 5
RANK0_FILES = 8  # trainer, model, optimizer, scheduler, sampler, 2 rng, args.json


def _run(out: Path, flags: str = "", *script_flags: object) -> tuple[int, str]:
    result = launch(
        f"--nproc-per-node 2 {flags}",
        SCRIPT,
        out,
        out.with_suffix(".pt"),
        "--save-steps",
        SAVE_STEPS,
        *script_flags,
        env=clean_env(OMP_NUM_THREADS="1"),
        merge=True,
        timeout_s=RUN_TIMEOUT_S,
    )
    return result.returncode, result.stdout


def _identical(a: Path, b: Path) -> bool:
    first, second = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The parameters of the uninterrupted run."""
    out = tmp_path_factory.mktemp("reference") / "whole"
    code, printed = _run(out)
    assert code == 0, printed
    return out.with_suffix(".pt")


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
def test_sigterm_to_the_launcher_saves_the_step_and_resume_is_bit_identical(
    tmp_path: Path, reference: Path
) -> None:
    # Rank 0 sends SIGTERM to its parent, the launcher, during step 8; the launcher passes
    # it on to both workers, which finish step 8, agree, save it and exit 143.
    out = tmp_path / "preempted"
    code, printed = _run(out, "", "--signal-after-step", 7, "--signal-launcher")
    assert code == 128 + signal.SIGTERM, printed
    assert "stopped by SIGTERM (received by ranks 0, 1) at step 8; saved checkpoint-8" in printed
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-5", "checkpoint-8"]
    code, printed = _run(out, "", "--resume")
    assert code == 0, printed
    assert "resumed from checkpoint-8" in printed
    assert _identical(reference, out.with_suffix(".pt"))


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_sigterm_to_one_worker_is_reported_as_its_preemption_save(tmp_path: Path) -> None:
    """SIGTERM to rank 1 alone: both ranks save step 8 and exit 143; the summary names rank
    1 as the one signalled and calls it a stop, not rank 0's failure (as it did before)."""
    out = tmp_path / "preempted"
    code, printed = _run(out, "", "--signal-after-step", 7, "--signal-rank", 1)
    assert code == 128 + signal.SIGTERM, printed
    stopped = [line for line in printed.splitlines() if line.startswith("[phalanx] STOPPED: ")]
    assert stopped == [
        "[phalanx] STOPPED: stopped by SIGTERM (received by rank 1) at step 8; saved "
        "checkpoint-8 — resume with resume_from_checkpoint=True"
    ], printed
    assert "FAILED" not in printed and "first to fail" not in printed, printed


@dataclass
class Trial:
    fault: str
    expected_resume: str | None
    survived: bool = False
    nothing_lost: bool = False
    printed: str = ""


def _trial(out: Path, reference: Path, fault: list[object], *resume_at: int) -> Trial:
    """One launcher with --max-restarts 1 and resume_from_checkpoint=True, hit by `fault`
    on its first attempt; it must come back from checkpoint-`resume_at` (0: from scratch),
    the first given or, where the save of the first may still have been written in the
    background when the kill came, the second."""
    expected = [f"resumed from checkpoint-{s} " if s else "no checkpoint in" for s in resume_at]
    trial = Trial(" ".join(map(str, fault)), " or ".join(expected))
    code, trial.printed = _run(out, "--max-restarts 1", "--resume", *fault)
    trial.survived = code == 0 and "restart 1 of 1" in trial.printed
    trial.nothing_lost = (
        trial.survived
        and any(e in trial.printed for e in expected)
        and not list(out.glob("*.tmp"))
        and _identical(reference, out.with_suffix(".pt"))
    )
    return trial


def _kill_at_random_step(out: Path, reference: Path, rng: random.Random) -> Trial:
    step, rank = rng.randint(1, 19), rng.randint(0, 1)
    fault: list[object] = ["--kill-after-step", step, "--kill-rank", rank]
    fault.append("--kill-on-first-attempt-only")
    saved = step - step % SAVE_STEPS  # the last save; it may still have been writing
    return _trial(out, reference, fault, saved, max(saved - SAVE_STEPS, 0))


def _kill_during_save(out: Path, reference: Path, rng: random.Random) -> Trial:
    step, rank = rng.choice([10, 15]), rng.randint(0, 1)
    # Rank 0 writes the files; rank 1 can only die as the save begins (it then waits).
    points = ["enter", *(f"file{k}" for k in range(RANK0_FILES)), "seal", "sealed"]
    point = rng.choice(points) if rank == 0 else "enter"
    fault: list[object] = ["--kill-in-save", f"{step}:{rank}:{point}"]
    return _trial(out, reference, fault, step if point == "sealed" else step - 5)


def _soak(tmp_path: Path, reference: Path, kind: str, trials: int, seed: int) -> list[Trial]:
    rng = random.Random(seed)
    make = _kill_at_random_step if kind == "kill" else _kill_during_save
    results = [make(tmp_path / f"{kind}{i}", reference, rng) for i in range(trials)]
    survived = sum(t.survived for t in results)
    intact = sum(t.nothing_lost for t in results)
    print(f"{kind} soak: {trials} trials, {survived} survived, {intact} nothing lost")
    return results


def _failures(results: list[Trial]) -> list[str]:
    return [f"{t.fault}: {t.printed[-2000:]}" for t in results if not t.nothing_lost]


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_a_sigkill_at_a_random_step_and_rank_restarts_bit_identical(
    tmp_path: Path, reference: Path
) -> None:
    assert _failures(_soak(tmp_path, reference, "kill", 1, seed=7)) == []


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT_S)
def test_a_sigkill_during_a_save_keeps_the_previous_checkpoint(
    tmp_path: Path, reference: Path
) -> None:
    assert _failures(_soak(tmp_path, reference, "save", 1, seed=8)) == []


@pytest.mark.slow
@pytest.mark.timeout(40 * RUN_TIMEOUT_S)
@pytest.mark.parametrize("kind", ["kill", "save"])
def test_soak_20_sigkills(tmp_path: Path, reference: Path, kind: str) -> None:
    assert _failures(_soak(tmp_path, reference, kind, 20, seed=12)) == []
