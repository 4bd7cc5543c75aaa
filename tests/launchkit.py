"""What the launcher tests share: running `phalanx launch` (or torchrun) as a user does,
and checking from outside which processes are still alive."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "e2e" / "scripts"
FAULT_SCRIPTS = REPO / "tests" / "faults" / "scripts"
LAUNCH = [sys.executable, "-m", "phalanx", "launch"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TIMEOUT_S = 30


def clean_env(**changes: str | None) -> dict[str, str]:
    """Our environment without interface choices and thread counts, plus `changes`."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    env.pop("OMP_NUM_THREADS", None)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def launch(
    flags: str,
    *args: object,
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
    merge: bool = False,
    prefix: Sequence[str] = LAUNCH,
    timeout_s: float = TIMEOUT_S,
) -> subprocess.CompletedProcess[str]:
    """`phalanx launch FLAGS ARGS...` to completion; a hang fails the test after `timeout_s`."""
    argv = [*prefix, *flags.split(), *map(str, args)]
    return subprocess.run(
        argv, cwd=cwd, env=env or clean_env(), text=True, timeout=timeout_s,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge else subprocess.PIPE,
    )  # fmt: skip


def secret_file(path: Path) -> Path:
    """A run's secret in `path` (0600), as `phalanx launch --run-secret-file` reads it; made
    once, so every host of a test's run shares it."""
    from phalanx.ground.runauth import new_secret

    if not path.exists():
        path.write_text(new_secret())
        path.chmod(0o600)
    return path


def start(argv: Sequence[object], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """A launcher (or anything) running in the background, its output captured."""
    return subprocess.Popen(
        [str(a) for a in argv], cwd=REPO, env=env or clean_env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def finish(proc: subprocess.Popen[str], timeout_s: float = TIMEOUT_S) -> tuple[str, str]:
    """Wait for `proc`; kill it (and fail) if it outlives `timeout_s`."""
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{proc.args!r} hung\nstdout:\n{out}\nstderr:\n{err}") from None


def read_envs(out: Path, ranks: Sequence[int], restart: int = 0) -> list[dict[str, object]]:
    return [json.loads((out / f"env_{r}_{restart}.json").read_text()) for r in ranks]


def is_running(pid: int) -> bool:
    """Alive and not a zombie (orphans whose reaper never reaps stay zombies forever)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def wait_for(paths: Sequence[Path], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"never appeared: {[str(p) for p in paths]}"
        time.sleep(0.05)


def wait_until_gone(pids: Sequence[int], timeout_s: float) -> list[int]:
    """The pids still running after `timeout_s` (polled: returns as soon as none is)."""
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if is_running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def pids_of(out: Path, ranks: Sequence[int]) -> list[int]:
    """What fail_fast.py's sleepers wrote: each worker's pid and its grandchild's."""
    return [int(pid) for r in ranks for pid in (out / f"pids_{r}").read_text().split()]


def marked_processes(mark: str) -> list[int]:
    """Live processes whose environment holds PHALANX_TEST_MARK=`mark`: a launcher started
    with it, and everything it spawned, however deep (children inherit the environment)."""
    needle = f"PHALANX_TEST_MARK={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0") and is_running(int(entry.name)):
            found.append(int(entry.name))
    return found


def listening_addresses(port: int, netns: str | None = None) -> set[str]:
    """The local addresses something listens on at TCP `port`, from `ss -ltn` (inside
    network namespace `netns` when given): e.g. {"127.0.0.1"}, or {"*"} for every interface."""
    argv = ["ss", "-ltnH"]
    if netns is not None:
        argv = ["ip", "netns", "exec", netns, *argv]
    listing = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=True)
    found = set()
    for line in listing.stdout.splitlines():
        fields = line.split()
        if len(fields) >= 4:
            addr, _, local_port = fields[3].rpartition(":")
            if local_port == str(port):
                found.add(addr.strip("[]"))
    return found
