"""The per-rank progress record: what a writer publishes is what a reader (the launcher,
another process) reads, never half an update."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from phalanx.ground import progress_record as progress
from phalanx.ground.progress_record import read_record, record_path

REPO = Path(__file__).resolve().parents[2]


def test_a_record_reads_back_what_was_published(tmp_path: Path) -> None:
    rec = progress._Recorder(3, tmp_path)
    rec.set_step(7)
    rec.collective("ddp all_reduce bucket", 2, 5)
    pos = read_record(record_path(tmp_path, 3))
    assert pos is not None
    assert (pos.rank, pos.pid, pos.step, pos.iteration, pos.collectives) == (
        3,
        os.getpid(),
        7,
        5,
        1,
    )
    assert pos.label == "ddp all_reduce bucket 2"
    assert pos.where() == (
        "in step 7; last collective entered: #1 (ddp all_reduce bucket 2, iteration 5)"
    )
    assert abs(pos.updated - time.time()) < 60


def test_no_step_and_no_collective_yet(tmp_path: Path) -> None:
    progress._Recorder(0, tmp_path)
    pos = read_record(record_path(tmp_path, 0))
    assert pos is not None and pos.where() == "no collective entered yet"


def test_a_half_written_record_is_never_returned(tmp_path: Path) -> None:
    rec = progress._Recorder(1, tmp_path)
    rec.collective("x", -1, 1)
    path = record_path(tmp_path, 1)
    data = bytearray(path.read_bytes())
    data[progress._SEQ_OFFSET] |= 1  # an odd sequence number: an update under way
    path.write_bytes(bytes(data))
    assert read_record(path) is None
    assert read_record(tmp_path / "missing") is None
    (tmp_path / "junk").write_bytes(b"\0" * 200)
    assert read_record(tmp_path / "junk") is None


def test_the_dump_signal_writes_every_threads_stack(tmp_path: Path) -> None:
    """In a fresh process (the arming is process-wide): start() under a launcher arms the
    signal recorded in the file, and the stack file then names the sleeping function."""
    code = (
        "import os, sys, time\n"
        f"os.environ['PHALANX_PROGRESS_DIR'] = {str(tmp_path)!r}\n"
        "from phalanx.ground import progress_record as progress\n"
        "progress.start(0, 2, 60)\n"
        "def sleeping_here():\n"
        "    print('ready', flush=True); time.sleep(30)\n"
        "sleeping_here()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        pos = read_record(record_path(tmp_path, 0))
        assert pos is not None and pos.dump_signal not in (0, signal.SIGUSR1)
        os.kill(proc.pid, pos.dump_signal)
        stacks = tmp_path / "rank_0.stacks"
        deadline = time.monotonic() + 10
        while "sleeping_here" not in stacks.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "sleeping_here" in stacks.read_text()
        assert proc.poll() is None  # dumping does not stop the process
    finally:
        proc.kill()
        proc.communicate()


def test_a_dump_asked_after_the_handler_is_gone_does_not_kill(tmp_path: Path) -> None:
    """The interpreter's finalization unregisters faulthandler's handler: a launcher that
    asks a slow teardown for its stacks then must not kill it by the signal (it once did,
    and the launcher reported that rank killed by signal 38, the first to fail). Here the
    handler is unregistered as finalization would, and the process signals itself."""
    code = (
        "import faulthandler, os\n"
        f"os.environ['PHALANX_PROGRESS_DIR'] = {str(tmp_path)!r}\n"
        "from phalanx.ground import progress_record as progress\n"
        "from pathlib import Path\n"
        "from phalanx.ground.progress_record import read_record, record_path\n"
        "progress.start(0, 2, 60)\n"
        f"signum = read_record(record_path(Path({str(tmp_path)!r}), 0)).dump_signal\n"
        "faulthandler.unregister(signum)\n"
        "os.kill(os.getpid(), signum)\n"
        "print('alive', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and done.stdout == "alive\n", (done.returncode, done.stderr)


def test_the_record_says_when_the_exit_began_after_the_scripts_threads(tmp_path: Path) -> None:
    """`exiting` is 0 while the script runs, and is set as the first exit handler runs:
    after a non-daemon thread the script left running has ended, before the handlers
    registered earlier (one of which hangs here, and sees it set)."""
    script = (
        "import atexit, sys, threading, time\n"
        "from pathlib import Path\n"
        "from phalanx.ground import progress_record as p\n"
        "d = Path(sys.argv[1])\n"
        "def seen(): print('exiting' if p.read_record(p.record_path(d, 0)).exiting else 'no')\n"
        "atexit.register(seen)\n"
        "p.start(0, 1, 60.0)\n"
        "import os\n"
        "child = os.fork()\n"  # a forked child's exit (a DataLoader worker's) is not ours
        "if child == 0:\n    p._recorder.exiting(); os._exit(0)\n"
        "os.waitpid(child, 0)\n"
        "assert p.read_record(p.record_path(d, 0)).exiting == 0.0\n"
        "threading.Thread(target=time.sleep, args=(0.5,)).start()\n"
        "t0 = time.time(); print(t0, flush=True)\n"
    )
    env = {**os.environ, "PHALANX_PROGRESS_DIR": str(tmp_path), "PYTHONPATH": str(REPO / "src")}
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, text=True,
                         capture_output=True, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stderr
    began, seen = run.stdout.split()
    pos = read_record(record_path(tmp_path, 0))
    assert pos is not None and seen == "exiting"
    assert pos.exiting - float(began) >= 0.4  # after the thread's 0.5 s sleep
