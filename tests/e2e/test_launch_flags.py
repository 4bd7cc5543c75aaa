"""torchrun's flags under `phalanx launch`, each against torchrun's behaviour where it has one.

docs/launch.md holds the table of every torchrun flag; each honoured flag has a
test here (or in test_launch.py, or tests/faults), each refused one a test of its
one-line refusal. The workers import no torch; torchrun itself runs once, for the
output flags, whose file layout and console lines must match it exactly.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import time
from pathlib import Path

import pytest

from phalanx.ground.ports import free_port
from tests.launchkit import (
    LAUNCH,
    SCRIPTS,
    TORCHRUN,
    clean_env,
    finish,
    is_running,
    launch,
    read_envs,
    start,
    wait_for,
)

STREAMS = SCRIPTS / "streams.py"
ENV_DUMP = SCRIPTS / "env_dump.py"


# --- rendezvous ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "flags",
    [
        # The tutorials' command line: on one node, c10d with an endpoint is --standalone.
        "--nnodes=1 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=localhost:0",
        "--nnodes=1 --nproc_per_node=2 --rdzv_backend=c10d --rdzv_endpoint=localhost:0",
        "--standalone --nproc-per-node 2",
    ],
)
def test_single_node_rendezvous_forms(tmp_path: Path, flags: str) -> None:
    result = launch(f"{flags} --rdzv-id tutorial", ENV_DUMP, tmp_path)
    assert result.returncode == 0, result.stderr
    envs = read_envs(tmp_path, range(2))
    assert [e["MASTER_ADDR"] for e in envs] == ["127.0.0.1"] * 2
    assert int(str(envs[0]["MASTER_PORT"])) > 0 and envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
    assert [e["TORCHELASTIC_RUN_ID"] for e in envs] == ["tutorial"] * 2


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_static_endpoint_names_the_port(tmp_path: Path) -> None:
    port = free_port()
    result = launch(f"--nproc-per-node 2 --rdzv-endpoint 127.0.0.1:{port}", ENV_DUMP, tmp_path)
    assert result.returncode == 0, result.stderr
    assert [e["MASTER_PORT"] for e in read_envs(tmp_path, range(2))] == [str(port)] * 2


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_c10d_assigns_node_ranks_in_join_order(tmp_path: Path) -> None:
    """Two launchers on this host: the first binds the endpoint and is node 0, the second
    finds the port taken, joins as a client (as torchrun's agent does) and is node 1."""
    port = free_port()
    flags = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "join"]  # fmt: skip
    host = start([*LAUNCH, *flags, ENV_DUMP, tmp_path])
    _wait_until_listening(port)
    joiner = start([*LAUNCH, *flags, ENV_DUMP, tmp_path])
    _, joiner_err = finish(joiner, timeout_s=60)
    _, host_err = finish(host, timeout_s=60)
    assert (host.returncode, joiner.returncode) == (0, 0), host_err + joiner_err
    assert "hosting at 127.0.0.1" in host_err
    assert "rendezvous 'join': this is node 1 of 2" in joiner_err
    envs = read_envs(tmp_path, range(4))
    assert [e["GROUP_RANK"] for e in envs] == ["0", "0", "1", "1"]
    assert {e["MASTER_PORT"] for e in envs} == {str(port)}


def _wait_until_listening(port: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listens on port {port}")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_rdzv_conf_join_timeout_bounds_the_wait_for_nodes(tmp_path: Path) -> None:
    flags = (
        f"--nnodes 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{free_port()} "
        "--rdzv-conf join_timeout=3,last_call_timeout=5"
    )
    started = time.monotonic()
    result = launch(flags, ENV_DUMP, tmp_path, timeout_s=80)
    assert result.returncode == 203
    assert "only 1 of 2 nodes joined rendezvous 'none' within 3s" in result.stderr
    assert "--rdzv-conf last_call_timeout has no effect" in result.stderr
    assert time.monotonic() - started < 60
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_rdzv_conf_timeout_bounds_the_wait_for_the_master(tmp_path: Path) -> None:
    flags = f"--nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --master-port {free_port()}"
    result = launch(f"{flags} --rdzv-conf timeout=1", ENV_DUMP, tmp_path)
    assert result.returncode == 203
    assert "after 1s (connection refused)" in result.stderr.lower()


# --- output: the torchrun comparison -------------------------------------------------------


def _run_dir_files(log_dir: Path) -> dict[str, str]:
    """The files under torchrun's `<run id>_<random>` directory, by relative path."""
    (run_dir,) = [p for p in log_dir.iterdir() if p.is_dir()]
    return {str(p.relative_to(run_dir)): p.read_text() for p in run_dir.rglob("*") if p.is_file()}


def _console(text: str) -> set[str]:
    """Worker lines on a console, without the launcher's prefix ([rank 1] or [trainer1]:)."""
    found = set()
    for line in text.splitlines():
        match = re.fullmatch(r"\[(?:rank |trainer)(\d)\]:? ?((?:out|err) r\d .*)", line)
        if match:
            found.add(f"{match[1]}|{match[2]}")
    return found


@pytest.mark.slow  # make test-slow: over a minute on a loaded 2-core machine
@pytest.mark.timeout(240)
def test_output_flags_match_torchrun(tmp_path: Path) -> None:
    """--role, --log-dir, -r, -t, --local-ranks-filter and --run-path, side by side."""
    flags = "--nproc-per-node 2 --role trainer -r 0:1 -t 1:3 --local-ranks-filter 1 --run-path"
    ours = launch(f"{flags} --log-dir {tmp_path / 'ours'}", STREAMS, "x")
    theirs = launch(f"{flags} --log-dir {tmp_path / 'theirs'}", STREAMS, "x", prefix=TORCHRUN,
                    timeout_s=200)  # fmt: skip
    assert (ours.returncode, theirs.returncode) == (0, 0), ours.stderr + theirs.stderr
    files = _run_dir_files(tmp_path / "ours")
    assert files == _run_dir_files(tmp_path / "theirs")
    assert sorted(files) == ["attempt_0/0/stdout.log", "attempt_0/1/stderr.log",
                             "attempt_0/1/stdout.log"]  # fmt: skip
    assert files["attempt_0/0/stdout.log"] == (
        "out r0 role=trainer name=__main__ argv0=streams.py args=['x'] apple\n"
    )
    assert (
        _console(ours.stdout)
        == _console(theirs.stdout)
        == {"1|out r1 role=trainer name=__main__ argv0=streams.py args=['x'] apple"}
    )
    assert _console(ours.stderr) == _console(theirs.stderr) == {"1|err r1 pie, served"}


@pytest.mark.timeout(60)
def test_redirect_without_log_dir_uses_a_temporary_one(tmp_path: Path) -> None:
    result = launch("--nproc-per-node 2 -r 3", STREAMS, "y")
    assert result.returncode == 0, result.stderr
    assert _console(result.stdout + result.stderr) == set()  # everything went to the files
    run_dir = Path(re.search(r"per-stream logs \(-r/-t\) in (\S+)", result.stderr)[1])  # type: ignore[index]
    assert (run_dir / "attempt_0" / "1" / "stderr.log").read_text() == "err r1 pie, served\n"


@pytest.mark.timeout(60)
def test_duplicate_filters_copy_matching_lines(tmp_path: Path) -> None:
    flags = (
        f"--nproc-per-node 2 --log-dir {tmp_path} --duplicate-stdout-filters apple,orange "
        "--duplicate-stderr-filters pie,,"
    )
    result = launch(flags, STREAMS, "z")
    assert result.returncode == 0, result.stderr
    (attempt,) = tmp_path.glob("*/attempt_0")
    out_lines = (attempt / "filtered_stdout.log").read_text().splitlines()
    assert sorted(out_lines) == [
        f"[rank {r}] out r{r} role=default name=__main__ argv0=streams.py args=['z'] apple"
        for r in range(2)
    ]
    # ",," is a literal comma: "pie," matches "pie, served".
    assert sorted((attempt / "filtered_stderr.log").read_text().splitlines()) == [
        "[rank 0] err r0 pie, served",
        "[rank 1] err r1 pie, served",
    ]
    assert len(_console(result.stdout + result.stderr)) == 4  # still shown on the console


# --- workers' environment and signals ------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("visible", "expected"), [(None, ["0", "1"]), ("3,5", ["3", "5"])])
def test_virtual_local_rank(tmp_path: Path, visible: str | None, expected: list[str]) -> None:
    env = clean_env(CUDA_VISIBLE_DEVICES=visible)
    result = launch("--nproc-per-node 2 --virtual-local-rank", SCRIPTS / "env_dump.py",
                    tmp_path, env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr
    envs = [json.loads((tmp_path / f"env_{r}_0.json").read_text()) for r in range(2)]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0"]
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == expected


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_start_method_is_accepted(tmp_path: Path, method: str) -> None:
    result = launch(f"--nproc-per-node 2 --start-method {method}", ENV_DUMP, tmp_path)
    assert result.returncode == 0, result.stderr
    assert len(read_envs(tmp_path, range(2))) == 2


@pytest.mark.timeout(60)
def test_signals_to_handle(tmp_path: Path) -> None:
    """SIGUSR1 (SLURM's warning before a time limit) stops the job when it is listed, and
    reaches the workers as itself."""
    argv = [*LAUNCH, "--nproc-per-node", "2", "--signals-to-handle", "SIGTERM,SIGUSR1",
            SCRIPTS / "trap_signals.py", tmp_path]  # fmt: skip
    launcher = start(argv)
    wait_for([tmp_path / f"ready_{r}" for r in range(2)])
    launcher.send_signal(signal.SIGUSR1)
    finish(launcher)
    assert launcher.returncode == 128 + signal.SIGUSR1
    assert [(tmp_path / f"got_{r}").read_text() for r in range(2)] == ["SIGUSR1"] * 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("grace", [0.5, 3.0])
def test_shutdown_timeout_is_the_grace_before_sigkill(tmp_path: Path, grace: float) -> None:
    argv = [*LAUNCH, "--nproc-per-node", "2", "--shutdown-timeout", grace,
            SCRIPTS / "ignore_term.py", tmp_path]  # fmt: skip
    launcher = start(argv)
    wait_for([tmp_path / f"ready_{r}" for r in range(2)])
    pids = [int((tmp_path / f"ready_{r}").read_text()) for r in range(2)]
    sent = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    finish(launcher)
    took = time.monotonic() - sent
    assert launcher.returncode == 128 + signal.SIGTERM
    assert grace <= took < grace + 2.5, took
    assert not any(is_running(p) for p in pids)


# --- flags refused, each with its reason ---------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        ("--logs-specs mylogs", "--logs-specs mylogs loads a torch LogsSpecs plugin"),
        ("--event-log-handler console", "is torch's elastic event API"),
        ("--numa-binding node", "--numa-binding needs each GPU's NUMA node"),
        ("--local-addr 203.0.113.7", "--local-addr 203.0.113.7 is not an address of this host"),
        ("--rdzv-conf jion_timeout=5", "--rdzv-conf 'jion_timeout=5' is not a known KEY=VALUE"),
        ("--rdzv-conf join_timeout=soon", "join_timeout='soon' is not a positive number"),
        ("--signals-to-handle SIGKILL", "'SIGKILL' is not a signal the launcher can catch"),
        ("-r 7", "--redirects '7' is not a stream spec"),
        ("--local-ranks-filter one", "--local-ranks-filter 'one' is not a list of local ranks"),
        ("--start-method thread", "invalid choice: 'thread'"),
        ("--run-path -m", "-m and --run-path exclude each other"),
    ],
)
def test_refused_flags_say_why_in_one_line(tmp_path: Path, flags: str, complaint: str) -> None:
    result = launch(flags, ENV_DUMP, tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert complaint in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_accepted_defaults_of_refused_flags(tmp_path: Path) -> None:
    result = launch("--logs-specs default --event-log-handler null --local-addr 127.0.0.1",
                    ENV_DUMP, tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_monitor_interval_is_how_often_workers_are_checked(tmp_path: Path) -> None:
    # The workers are done at once; the launcher only sees it at its next check.
    started = time.monotonic()
    result = launch("--nproc-per-node 2 --monitor-interval 3", ENV_DUMP, tmp_path)
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started >= 3
    refused = launch("--monitor-interval 0", ENV_DUMP, tmp_path)
    assert refused.returncode == 2 and "--monitor-interval must be positive" in refused.stderr


@pytest.mark.timeout(60)
def test_live_recovery_across_nodes_needs_the_run_secret(tmp_path: Path) -> None:
    """Several nodes share a secret only by being given it: without one, or with one others
    can read, the launcher stops in one line before it dials anything."""
    flags = (
        f"--nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --master-port {free_port()} "
        "--nproc-per-node 1 --live-recovery"
    )
    script = ENV_DUMP
    env = clean_env(PHALANX_RUN_SECRET=None)
    missing = launch(flags, script, env=env)
    assert missing.returncode != 0
    assert missing.stderr.strip().splitlines() == [
        "phalanx launch: error: --live-recovery over several nodes needs the run's secret, the "
        "same on every node — pass --run-secret-file FILE (chmod 600), or set "
        "PHALANX_RUN_SECRET on each (make one with: openssl rand -hex 32; docs/launch.md, "
        "'Multi-node')"
    ], missing.stderr
    secret = tmp_path / "run.secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    secret.chmod(0o644)
    readable = launch(f"{flags} --run-secret-file {secret}", script, env=env)
    assert readable.returncode != 0
    assert f"--run-secret-file {secret} can be read by others (mode 644)" in readable.stderr
    assert len(readable.stderr.strip().splitlines()) == 1, readable.stderr
