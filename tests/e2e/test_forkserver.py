"""`--start-method forkserver`: workers forked from a warm server that has imported torch
(launch/forkstart.py, launch/warmserver.py) start as a fresh interpreter would, end as
one would, and are reported like any other. The live-recovery replay test
(tests/faults/test_live_trainer.py) runs its replay this way, replacement included, and
ends bit-identical to the first run's fresh interpreters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phalanx.launch.warmserver import can_run
from tests.launchkit import SCRIPTS, clean_env, launch

PROBE = SCRIPTS / "start_probe.py"
SAME = ("argv", "name", "file", "path0", "cwd", "session_leader", "stdin_empty", "rank",
        "mark", "threads")  # fmt: skip


def _probe(tmp_path: Path, method: str, *args: str, flags: str = "") -> list[dict[str, object]]:
    out = tmp_path / method
    out.mkdir()
    target = " ".join(args) if args else str(PROBE)
    result = launch(f"--nproc-per-node 2 --start-method {method} {flags} {target}", out,
                    env=clean_env(PROBE_MARK="set by the test"), timeout_s=90)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "[rank 1] stdout of 1" in result.stdout and "[rank 0] stderr of 0" in result.stderr
    return [json.loads((out / f"probe_{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.timeout(120)
def test_a_forked_worker_starts_as_a_fresh_interpreter_would(tmp_path: Path) -> None:
    fresh, forked = _probe(tmp_path, "spawn"), _probe(tmp_path, "forkserver")
    for a, b in zip(fresh, forked, strict=True):
        assert {k: a[k] for k in SAME} == {k: b[k] for k in SAME}
    assert [p["forked"] for p in fresh] == [False] * 2 and [p["warm"] for p in fresh] == [False] * 2
    assert [p["forked"] for p in forked] == [True] * 2 and [p["warm"] for p in forked] == [True] * 2
    # each its own seeds, as fresh interpreters: random's, torch's
    assert forked[0]["py_random"] != forked[1]["py_random"]
    assert forked[0]["torch_rand"] != forked[1]["torch_rand"]
    assert fresh[0]["torch_rand"] != fresh[1]["torch_rand"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("form", ["-m", "--run-path"])
def test_modules_and_run_path_as_fresh(tmp_path: Path, form: str) -> None:
    """`-m module` and `--run-path`: the same argv, __name__ and sys.path[0] as python's."""
    target = ("-m", "tests.e2e.scripts.start_probe") if form == "-m" else (str(PROBE),)
    flags = "--run-path" if form == "--run-path" else ""
    fresh = _probe(tmp_path, "spawn", *target, flags=flags)
    forked = _probe(tmp_path, "forkserver", *target, flags=flags)
    for a, b in zip(fresh, forked, strict=True):
        assert {k: a[k] for k in SAME} == {k: b[k] for k in SAME}
        assert b["forked"] and b["name"] == "__main__"


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("mode", "code", "said"),
    [
        ("exit3", 3, "exit code 3"),
        ("raise", 1, "exit code 1"),
        ("kill", 137, "killed by SIGKILL (signal 9)"),
    ],
)
def test_a_forked_worker_ends_as_a_fresh_one(
    tmp_path: Path, mode: str, code: int, said: str
) -> None:
    result = launch("--nproc-per-node 2 --start-method forkserver", PROBE, tmp_path, mode,
                    timeout_s=60)  # fmt: skip
    assert result.returncode == code, result.stderr
    assert f"rank 1 failed ({said})" in result.stderr
    if mode == "raise":  # python's own traceback: from the script's frame, none of the server's
        lines = [line for line in result.stderr.splitlines() if line.startswith("[rank 1]")]
        start = lines.index("[rank 1] Traceback (most recent call last):")
        assert str(PROBE) in lines[start + 1] and "<module>" in lines[start + 1], lines
        assert "warmserver" not in result.stderr and "runpy" not in result.stderr
        assert lines[-1] == "[rank 1] ValueError: rank 1 failed in its own code"


def test_what_the_server_runs_itself() -> None:
    """Only `python -u` with a script, `-m` or `-c`; anything else starts fresh."""
    assert can_run(["-u", "train.py", "--lr", "1"])
    assert can_run(["-u", "-m", "pkg.train"]) and can_run(["-u", "-c", "print(1)"])
    assert not can_run(["train.py"])  # not unbuffered
    assert not can_run(["-u", "-X", "dev", "train.py"]) and not can_run(["-u", "-m"])
