"""The exit-code contract, each code produced for real and matched against docs/clusters.md.

Kubeflow's `restartPolicy: ExitCode` restarts a pod that exited 128-255 and fails the
job on 1-127; docs/clusters.md's table says which code phalanx gives what. Each test
makes a process end that way and reads the code both from the process and from the
docs' table, so the code, the docs and `phalanx.errors.ExitCode` cannot drift apart.
"""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import pytest

from phalanx.errors import ExitCode
from phalanx.ground.ports import free_port
from tests.launchkit import REPO, SCRIPTS, clean_env, finish, launch, start

SCRIPT = SCRIPTS / "exit_codes.py"
DOC = REPO / "docs" / "clusters.md"
TIMEOUT_S = 90


def documented() -> dict[str, int]:
    """`ExitCode.NAME` -> the code docs/clusters.md's table gives it."""
    section = DOC.read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        found = re.match(r"\|\s*(\d+)[^|]*\|\s*`ExitCode\.([A-Z]+)`", line)
        if found:
            table[found.group(2)] = int(found.group(1))
    return table


def test_the_docs_table_is_the_enum() -> None:
    assert documented() == {code.name: int(code) for code in ExitCode}


def _python(*args: object) -> tuple[int, str]:
    proc = start([sys.executable, SCRIPT, *args], env=clean_env(PHALANX_TRACEBACK=None))
    out, err = finish(proc, TIMEOUT_S)
    return proc.returncode, out + err


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_a_configuration_error_exits_2_and_is_not_restarted() -> None:
    code, printed = _python("config")
    assert code == ExitCode.CONFIGURATION == documented()["CONFIGURATION"], printed
    assert printed.startswith("ConfigurationError: backend 'nccl' needs NVIDIA GPUs"), printed
    done = launch("--max-restarts 2", SCRIPT, "config", merge=True, timeout_s=TIMEOUT_S)
    assert done.returncode == ExitCode.CONFIGURATION, done.stdout
    assert "exit code 2 (a configuration error)" in done.stdout
    assert "configuration error (exit code 2): not restarting" in done.stdout
    assert "restart 1" not in done.stdout, done.stdout


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_an_error_raised_in_a_group_keeps_its_line_and_its_code() -> None:
    """torch's init_process_group wraps sys.excepthook to prefix each line with the rank,
    holding the text back until the hook it wraps returns: a status raised in there lost
    the line (accelerate launch printed nothing but exit codes)."""
    env = clean_env(PHALANX_TRACEBACK=None, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))  # fmt: skip
    proc = start([sys.executable, SCRIPT, "config-in-group"], env=env)
    _, err = finish(proc, TIMEOUT_S)
    assert proc.returncode == ExitCode.CONFIGURATION, err
    assert "[rank0]: ConfigurationError: raised with the group up — fix it here" in err, err
    assert "Traceback" not in err


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_a_lost_peer_exits_203_on_the_survivor() -> None:
    """Two pods of a PyTorchJob: one is SIGKILLed (137), the other is left with gloo's
    'Connection closed by peer' and exits 203, retryable too, where it exited 1 (which
    fails a PyTorchJob under restartPolicy: ExitCode)."""
    port = str(free_port())
    pods = [
        start(
            [sys.executable, SCRIPT, "peer"],
            env=clean_env(
                RANK=str(rank),
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                PET_NNODES="2",
            ),
        )
        for rank in (0, 1)
    ]
    printed = [finish(pod, TIMEOUT_S) for pod in pods]
    assert pods[1].returncode == -signal.SIGKILL
    assert pods[0].returncode == ExitCode.INFRASTRUCTURE, printed[0]
    assert documented()["INFRASTRUCTURE"] == ExitCode.INFRASTRUCTURE


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_a_launcher_that_never_meets_the_master_exits_203() -> None:
    """Node 1 of 2 whose node 0 never comes: the master is refused until --rdzv-timeout."""
    flags = f"--nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --master-port {free_port()} "
    done = launch(flags + "--rdzv-timeout 2", SCRIPT, "peer", merge=True, timeout_s=TIMEOUT_S)
    assert done.returncode == ExitCode.INFRASTRUCTURE, done.stdout
    assert "phalanx launch: error:" in done.stdout


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_a_preempted_run_saves_and_exits_143(tmp_path: Path) -> None:
    code, printed = _python("preempt", tmp_path)
    assert code == 128 + signal.SIGTERM == documented()["PREEMPTED"], printed
    assert "stopped by SIGTERM (received by rank 0) at step 2; saved checkpoint-2" in printed
    assert (tmp_path / "checkpoint-2" / "manifest.json").exists()


_RAISE_AFTER_INIT = """
import phalanx
from phalanx.errors import StoreLost
phalanx.init(backend="gloo")  # torch wraps the process's excepthook here
raise StoreLost("the store is gone — bring it back")
"""


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_an_error_after_init_keeps_its_one_line() -> None:
    """torch's init_process_group wraps the excepthook and buffers stderr while it runs;
    the one line of an error that exits 203 used to be lost in that buffer."""
    proc = start([sys.executable, "-c", _RAISE_AFTER_INIT])
    _out, err = finish(proc, TIMEOUT_S)
    assert proc.returncode == ExitCode.INFRASTRUCTURE, err
    assert "StoreLost: the store is gone — bring it back" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
