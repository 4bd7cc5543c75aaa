"""The small messages of issue 12: each mistake named as itself, in one line."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from phalanx.errors import ConfigurationError
from phalanx.ground.jobenv import detect_launch
from phalanx.ground.ports import free_port
from tests.harness import run_workers
from tests.launchkit import SCRIPTS, launch

pytestmark = pytest.mark.faults


def test_world_size_zero_is_a_world_size_problem() -> None:
    with pytest.raises(ConfigurationError) as caught:
        detect_launch({"RANK": "0", "WORLD_SIZE": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert str(caught.value).startswith("WORLD_SIZE=0 must be at least 1 — ")
    assert "LOCAL_WORLD_SIZE" not in str(caught.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bound_to", ["127.0.0.1", "0.0.0.0"])
def test_port_in_use_under_phalanx_launch_names_master_port(tmp_path: Path, bound_to: str) -> None:
    with socket.socket() as other_job:
        other_job.bind((bound_to, 0))
        other_job.listen()
        port = other_job.getsockname()[1]
        result = launch(f"--master-port {port}", SCRIPTS / "env_dump.py", tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert f"port {port} is taken on 127.0.0.1 — another job is using it; pass another " in (
        result.stderr
    )
    assert "--master-port (or leave it unset to pick a free one)" in result.stderr
    assert list(tmp_path.iterdir()) == []


def _claim_rank_0(rank: int, world_size: int, port: int) -> str:
    """Both processes say RANK=0 of 2 (a copy-pasted launch line); return init's error."""
    import os

    from phalanx import runtime

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    os.environ["MASTER_PORT"] = str(port)
    try:
        runtime.init(backend="gloo", timeout=4)
    except runtime.RendezvousError as exc:
        return str(exc)
    raise AssertionError("init returned although rank 1 never came")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_two_processes_given_rank_0_are_told_so() -> None:
    port = free_port()
    outcomes = run_workers(_claim_rank_0, 2, port, init_pg=False, timeout=60)
    messages = sorted(o.value for o in outcomes)
    told = [m for m in messages if "another process given RANK=0" in m]
    assert len(told) == 1, messages
    assert (
        f"rank 0 could not listen on 127.0.0.1:{port}: this job's store is already hosted"
        in (told[0])
    )
    assert "give each process its own RANK, 0..1" in told[0]
    assert "another job" not in told[0]
    # The first one hosts the store and waits for a rank 1 that never comes.
    (host,) = [m for m in messages if m not in told]
    assert "for the other 1 rank; rank 1 never came" in host


@pytest.mark.timeout(60)
def test_one_worker_is_one_worker_and_torch_rank_tags_are_not_doubled(tmp_path: Path) -> None:
    # Lines as torch's excepthook writes them once a process group exists.
    script = 'echo "[rank$RANK]: Traceback (most recent call last):" >&2; echo "[rank9]: x" >&2'
    result = launch("--nproc-per-node 1 --no-python sh -c", script)
    assert result.returncode == 0, result.stderr
    assert "[phalanx] starting 1 worker: rank 0 of 1, master" in result.stderr
    assert "[rank 0] Traceback (most recent call last):" in result.stderr.splitlines()
    # Whatever rank torch's tag names (its group's rank is not always the launcher's: a
    # live-recovery replacement starts as rank 0 of its own), the launcher's tag is the one
    # (issue 36: "[rank 1] [rank0]:" said two things at once).
    assert "[rank 0] x" in result.stderr.splitlines()


WRONG_BACKEND = "import phalanx\nphalanx.init(backend='no-such-backend')\n"
BOTH_READY = """import os, pathlib, time
here = pathlib.Path(__file__).parent
(here / f"ready{os.environ['RANK']}").touch()
while not all((here / f"ready{r}").exists() for r in range(2)):
    time.sleep(0.01)
"""
"""Both ranks imported torch before either fails: the first failure stops the other, which
on a loaded machine may still be importing, before it could say its line."""


@pytest.mark.timeout(60)
def test_an_uncaught_phalanx_error_in_a_users_script_is_one_line(tmp_path: Path) -> None:
    """A script of the user's that meets a PhalanxError: its one line, not 52 of traceback;
    PHALANX_TRACEBACK=1 gives the traceback back."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(WRONG_BACKEND)
    plain = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=50
    )
    assert plain.returncode == 2  # a configuration error's exit code (docs/clusters.md)
    lines = plain.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ConfigurationError: backend 'no-such-backend'")
    assert "PHALANX_TRACEBACK=1" in lines[0]
    env = {**__import__("os").environ, "PHALANX_TRACEBACK": "1"}
    full = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=50, env=env
    )
    assert full.returncode == 2 and "Traceback (most recent call last)" in full.stderr


@pytest.mark.timeout(90)
def test_under_the_launcher_each_rank_says_one_line_and_the_log_dir_keeps_the_traceback(
    tmp_path: Path,
) -> None:
    script = tmp_path / "train.py"
    script.write_text("import torch\n" + BOTH_READY + WRONG_BACKEND)
    logs = tmp_path / "logs"
    result = launch(f"--nproc-per-node 2 --log-dir {logs}", script)
    assert result.returncode != 0
    for rank in (0, 1):
        said = [line for line in result.stderr.splitlines() if line.startswith(f"[rank {rank}]")]
        assert len(said) == 1, result.stderr
        assert "ConfigurationError: backend 'no-such-backend'" in said[0]
        traceback = (logs / f"rank_{rank}.traceback").read_text()
        assert "Traceback (most recent call last)" in traceback
    assert "ConfigurationError: backend 'no-such-backend'" in result.stderr.splitlines()[-1] or (
        "backend 'no-such-backend'" in result.stderr
    )


JOIN = "import phalanx\nphalanx.init(backend='gloo', timeout=20)\n"


@pytest.mark.timeout(90)
def test_ranks_that_disagree_on_world_size_say_so_and_exit(tmp_path: Path) -> None:
    """A hand-set environment: rank 0 says WORLD_SIZE=2, rank 1 says 3. Both name the
    disagreement at once (it was blamed on the network interface, and rank 0 lived on)."""
    import os
    import subprocess
    import sys

    port = free_port()
    procs = []
    for rank, size in ((0, 2), (1, 3)):
        env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size),
                   LOCAL_WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, "-c", JOIN], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
    outputs = [p.communicate(timeout=60) for p in procs]  # well within ddp's 20 s timeout
    for rank, (proc, (_, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 2, err  # a configuration error
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "the ranks disagree on WORLD_SIZE" in lines[0], err
        assert f"rank {rank} was started with WORLD_SIZE={2 + rank}" in lines[0], err


@pytest.mark.timeout(90)
def test_a_hand_set_rank_0_told_a_foreign_master_address_says_so_at_once() -> None:
    """A hand-set environment whose MASTER_ADDR is not an address of rank 0's host: the
    launcher's check, in rank 0 (it took 61 s and blamed a client timeout)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="203.0.113.7", MASTER_PORT=str(free_port()),
               OMP_NUM_THREADS="1")  # fmt: skip
    join = "import phalanx\nphalanx.init(backend='gloo', timeout=300)\n"
    proc = subprocess.Popen([sys.executable, "-c", join], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        _, err = proc.communicate(timeout=60)  # the init timeout is 300 s: not waited out
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 2, err  # a configuration error
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(
        "ConfigurationError: MASTER_ADDR=203.0.113.7 is not an address of this host ("
    ), err
    assert "set MASTER_ADDR on every rank to the address of the host that runs rank 0" in err
