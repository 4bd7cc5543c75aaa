"""`phalanx launch` as a user runs it: real launcher processes, real workers, real signals.

The worker scripts in tests/e2e/scripts import no torch, so each launch costs
a few interpreter start-ups and the whole file stays fast.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.launch import devices
from tests.launchkit import (
    LAUNCH,
    REPO,
    SCRIPTS,
    TIMEOUT_S,
    clean_env,
    is_running,
    launch,
    pids_of,
    read_envs,
    wait_for,
)

_env = clean_env


# --- environment -------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_every_rank_gets_torchrun_environment(tmp_path: Path) -> None:
    result = launch("--nproc-per-node 3", SCRIPTS / "env_dump.py", tmp_path, "--lr", "0.1")
    assert result.returncode == 0, result.stderr
    envs = read_envs(tmp_path, range(3))
    threads = str(max(1, devices.cpu_count() // 3))
    for rank, env in enumerate(envs):
        assert env["argv"] == ["--lr", "0.1"]
        assert [env[k] for k in ("RANK", "LOCAL_RANK", "ROLE_RANK")] == [str(rank)] * 3
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "3"
        assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == ("0", "1")
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["PHALANX_RESTART_COUNT"] == env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the launcher hosts the store
        assert env["OMP_NUM_THREADS"] == threads
        assert env["PYTHONUNBUFFERED"] == "1"
        assert env["GLOO_SOCKET_IFNAME"] is None  # one node: loopback is right
    for key in ("MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        assert len({env[key] for env in envs}) == 1, key
    assert 0 < int(str(envs[0]["MASTER_PORT"])) < 65536
    lines = sorted(line for line in result.stdout.splitlines())
    assert lines == [f"[rank {r}] env written by rank {r}" for r in range(3)]


@pytest.mark.timeout(60)
def test_user_settings_are_kept(tmp_path: Path) -> None:
    env = _env(OMP_NUM_THREADS="7")
    # torchrun's underscore spellings and accelerate's --num-processes work too.
    result = launch("--num_processes 2 --master_port 29999", SCRIPTS / "env_dump.py", tmp_path,
                    env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr
    envs = read_envs(tmp_path, range(2))
    assert [e["OMP_NUM_THREADS"] for e in envs] == ["7", "7"]
    assert [e["MASTER_PORT"] for e in envs] == ["29999", "29999"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("user_ifname", [None, "eth7"])
def test_second_node_ranks_and_interface(
    tmp_path: Path, master_store: int, user_ifname: str | None
) -> None:
    flags = f"--nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --master-port {master_store}"
    result = launch(f"{flags} --nproc-per-node 2 --rdzv-timeout 20", SCRIPTS / "env_dump.py",
                    tmp_path, env=_env(GLOO_SOCKET_IFNAME=user_ifname))  # fmt: skip
    assert result.returncode == 0, result.stderr
    for local_rank, env in enumerate(read_envs(tmp_path, [2, 3])):
        assert env["RANK"] == str(2 + local_rank)
        assert env["LOCAL_RANK"] == str(local_rank)
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == ("4", "2", "1")
        assert env["MASTER_PORT"] == str(master_store)
        # A master on loopback has no interface to pin; a user's choice passes untouched.
        assert env["GLOO_SOCKET_IFNAME"] == user_ifname


@pytest.mark.timeout(60)
def test_unreachable_master_fails_with_a_clear_message(tmp_path: Path) -> None:
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        flags = f"--nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --master-port {port}"
        result = launch(f"{flags} --rdzv-timeout 1", SCRIPTS / "env_dump.py", tmp_path)
    assert result.returncode == 203  # infrastructure (docs/clusters.md)
    assert f"cannot reach the master at 127.0.0.1:{port} after 1s (" in result.stderr
    assert "— check --master-addr" in result.stderr
    assert list(tmp_path.iterdir()) == []  # no worker was started


# --- output ------------------------------------------------------------------------------

LINE = re.compile(r"\[rank (\d)\] (out|err) r(\d) (\d+) ([a-z]+)")


@pytest.mark.timeout(60)
def test_lines_are_prefixed_and_never_mixed(tmp_path: Path) -> None:
    lines_per_stream, width = 300, 3000
    # stdout and stderr into one pipe: lines of both streams of all ranks compete.
    result = launch("--nproc-per-node 3", SCRIPTS / "chatter.py", lines_per_stream, width,
                    merge=True)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:]
    counts: dict[tuple[int, str], int] = {}
    partial = set()
    for line in result.stdout.splitlines():
        if line.startswith("[phalanx] "):
            continue
        if m := re.fullmatch(r"\[rank (\d)\] partial r(\d) no newline", line):
            assert m[1] == m[2]
            partial.add(int(m[1]))
            continue
        m = LINE.fullmatch(line)
        assert m, f"mangled line: {line[:200]!r}"
        rank = int(m[1])
        assert m[3] == m[1] and m[5] == chr(ord("a") + rank) * width, f"mixed: {line[:200]!r}"
        counts[rank, m[2]] = counts.get((rank, m[2]), 0) + 1
    assert counts == {(r, s): lines_per_stream for r in range(3) for s in ("out", "err")}
    assert partial == {0, 1, 2}  # a last line without newline is still printed, whole


@pytest.mark.timeout(60)
def test_log_dir_gets_one_file_per_rank(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    result = launch(f"--log-dir {logs} --nproc-per-node 2", SCRIPTS / "chatter.py", 4, 10)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in logs.iterdir()) == ["rank_0.log", "rank_1.log"]
    for rank in (0, 1):
        lines = (logs / f"rank_{rank}.log").read_text().splitlines()
        body = chr(ord("a") + rank) * 10
        expected = {f"{s} r{rank} {i} {body}" for s in ("out", "err") for i in range(4)}
        assert set(lines) == expected | {f"partial r{rank} no newline"}
        assert len(lines) == 9  # unprefixed, stdout and stderr, nothing from the other rank


# --- failures ----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_failed_worker_stops_everyone(tmp_path: Path) -> None:
    # Ranks 0 and 2 sleep 60 s with a grandchild each; rank 1 fails once they are asleep.
    result = launch("--nproc-per-node 3", SCRIPTS / "fail_fast.py", tmp_path, 1, "exit")
    assert result.returncode == 3, result.stderr
    summary = result.stderr[result.stderr.index("FAILED") :]
    assert "rank 1 (local rank 1 on node 0" in summary and "exit code 3" in summary
    assert "Traceback (most recent call last)" in summary
    assert "ValueError: boom from rank 1" in summary
    sleepers = pids_of(tmp_path, [0, 2])
    assert len(sleepers) == 4
    assert [p for p in sleepers if is_running(p)] == []


@pytest.mark.timeout(60)
def test_worker_killed_by_signal(tmp_path: Path) -> None:
    result = launch("--nproc-per-node 2", SCRIPTS / "fail_fast.py", tmp_path, 0, "sigkill")
    assert result.returncode == 128 + signal.SIGKILL
    assert "rank 0 (local rank 0 on node 0" in result.stderr
    assert "killed by SIGKILL" in result.stderr
    assert [p for p in pids_of(tmp_path, [1]) if is_running(p)] == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_launcher_reaches_workers(tmp_path: Path, signum: signal.Signals) -> None:
    launcher = subprocess.Popen(
        [*LAUNCH, "--nproc-per-node", "2", str(SCRIPTS / "trap_signals.py"), str(tmp_path)],
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for([tmp_path / f"ready_{r}" for r in range(2)])
        launcher.send_signal(signum)
        _, err = launcher.communicate(timeout=TIMEOUT_S)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 128 + signum, err
    assert [(tmp_path / f"got_{r}").read_text() for r in range(2)] == [signum.name] * 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("max_restarts", "code", "method"), [(2, 0, "spawn"), (1, 1, "spawn"), (2, 0, "forkserver")]
)
def test_restarts(tmp_path: Path, max_restarts: int, code: int, method: str) -> None:
    # Rank 1 fails on restarts 0 and 1 and succeeds on restart 2; forkserver: every attempt's
    # workers forked from the one warm server, each with its attempt's environment.
    flags = f"--max-restarts {max_restarts} --nproc-per-node 2 --start-method {method}"
    result = launch(flags, SCRIPTS / "flaky.py", tmp_path, 2)
    assert result.returncode == code, result.stderr
    attempts = range(max_restarts + 1)
    seen = [json.loads((tmp_path / f"attempt_0_{n}.json").read_text()) for n in attempts]
    assert [s["TORCHELASTIC_RESTART_COUNT"] for s in seen] == [str(n) for n in attempts]
    # One port for the whole run: the launcher holds it, and serves each attempt a fresh store.
    assert len({s["MASTER_PORT"] for s in seen}) == 1
    assert not (tmp_path / f"attempt_0_{max_restarts + 1}.json").exists()


# --- forms of the command ----------------------------------------------------------------


def _console_script() -> list[str]:
    script = Path(sys.executable).with_name("phalanx")
    if not script.exists():
        pytest.skip("the phalanx console script is not installed next to this python")
    return [str(script), "launch"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("form", ["module", "python -m phalanx", "console script"])
def test_command_forms(tmp_path: Path, form: str) -> None:
    if form == "module":  # -m runs a module found from the working directory, like python -m
        result = launch("--nproc-per-node 2 -m env_dump", tmp_path, cwd=SCRIPTS)
    elif form == "console script":
        prefix = _console_script()
        result = launch("--nproc-per-node 2", SCRIPTS / "env_dump.py", tmp_path, prefix=prefix)
    else:
        result = launch("--nproc-per-node 2", SCRIPTS / "env_dump.py", tmp_path)
    assert result.returncode == 0, result.stderr
    assert [e["RANK"] for e in read_envs(tmp_path, range(2))] == ["0", "1"]


@pytest.mark.timeout(60)
def test_nproc_auto_counts_gpus(tmp_path: Path) -> None:
    (tmp_path / "hidden").mkdir()
    no_gpus = _env(CUDA_VISIBLE_DEVICES="")
    hidden = launch("--nproc-per-node auto", SCRIPTS / "env_dump.py", tmp_path / "hidden",
                    env=no_gpus)  # fmt: skip
    assert hidden.returncode == 0, hidden.stderr
    assert read_envs(tmp_path / "hidden", [0])[0]["LOCAL_WORLD_SIZE"] == "1"  # no GPU: 1 worker
    if devices.NVIDIA_PROC_GPUS.exists() or devices.physical_gpu_count() > 0:
        pytest.skip("this machine has GPUs; the no-GPU answer was checked above")
    plain = launch("--nproc-per-node auto", SCRIPTS / "env_dump.py", tmp_path)
    assert plain.returncode == 0, plain.stderr
    assert read_envs(tmp_path, [0])[0]["LOCAL_WORLD_SIZE"] == "1"


def test_gpu_count_reads_driver_and_visible_devices(tmp_path: Path) -> None:
    for gpu in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0"):
        (tmp_path / gpu).mkdir()
    assert devices.gpu_count({}, proc_dir=tmp_path) == 3
    assert devices.gpu_count({"CUDA_VISIBLE_DEVICES": "1,2"}, proc_dir=tmp_path) == 2
    assert devices.gpu_count({"CUDA_VISIBLE_DEVICES": "0,-1,2"}, proc_dir=tmp_path) == 1
    assert devices.gpu_count({"CUDA_VISIBLE_DEVICES": ""}, proc_dir=tmp_path) == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        ("--nproc-per-node two SCRIPT OUT", "--nproc-per-node 'two' is not a number"),
        ("--bogus SCRIPT OUT", "unrecognized arguments: --bogus"),
        ("--node-rank x SCRIPT OUT", "invalid int value: 'x'"),
        ("--nnodes 2 SCRIPT OUT", "--nnodes 2 needs --master-addr"),
        ("--nnodes 2 --node-rank 2 --master-addr h SCRIPT OUT", "--node-rank 2 is outside 0..1"),
        ("--nproc-per-node 0 SCRIPT OUT", "--nproc-per-node must be at least 1"),
        ("--standalone --nnodes 2 SCRIPT OUT", "--standalone is for one node"),
        ("--rdzv-backend etcd SCRIPT OUT", "--rdzv-backend etcd needs --rdzv-endpoint"),
        ("--rdzv-backend etcd-v2 SCRIPT OUT", "--rdzv-backend etcd-v2 is not one phalanx speaks"),
        ("no_such_script.py OUT", "script 'no_such_script.py' not found"),
        ("", "the following arguments are required: script"),
    ],
)
def test_bad_flags_give_one_clear_line(tmp_path: Path, args: str, complaint: str) -> None:
    result = launch(
        args.replace("SCRIPT", str(SCRIPTS / "env_dump.py")).replace("OUT", str(tmp_path))
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("phalanx launch: error: ") and complaint in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_launcher_imports_no_torch(tmp_path: Path) -> None:
    # Import every launcher module, then run a whole launch in the same interpreter.
    probe = (
        "import pkgutil, sys, phalanx.launch, phalanx.__main__\n"
        "for m in pkgutil.iter_modules(phalanx.launch.__path__):\n"
        "    __import__('phalanx.launch.' + m.name)\n"
        "from phalanx.cli.main import main\n"
        f"code = main(['launch', {str(SCRIPTS / 'env_dump.py')!r}, {str(tmp_path)!r}])\n"
        "assert code == 0, code\n"
        "torch = sorted(m for m in sys.modules if m.split('.')[0] == 'torch')\n"
        "assert not torch, torch\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=_env(), text=True,
                            capture_output=True, timeout=TIMEOUT_S)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "env_0_0.json").exists()


@pytest.mark.timeout(60)
def test_two_nodes_given_the_same_node_rank_are_told(tmp_path: Path, master_store: int) -> None:
    flags = f"--nnodes 3 --node-rank 1 --master-addr 127.0.0.1 --master-port {master_store}"
    (tmp_path / "a").mkdir()
    first = launch(flags, SCRIPTS / "env_dump.py", tmp_path / "a")
    assert first.returncode == 0, first.stderr
    second = launch(flags, SCRIPTS / "env_dump.py", tmp_path / "b")
    assert second.returncode == 2
    assert "--node-rank 1 is already taken by another node's launcher" in second.stderr
    assert not (tmp_path / "b").exists()
