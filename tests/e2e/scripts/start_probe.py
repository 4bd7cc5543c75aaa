"""What a worker's interpreter looks like when it starts, for tests/e2e/test_forkserver.py.

Usage: start_probe.py OUTPUT_DIR [MODE]. Writes probe_<rank>.json: its argv, __name__,
__file__, sys.path[0], directory, session, standard input, environment, thread count and
random state, whether the warm server forked it, and whether torch was imported before the
script ran. MODE: `ok` (the default), `exit3` (exit code 3), `raise` (an uncaught
exception in a function of the script), `kill` (SIGKILL to itself) on rank 1.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
from pathlib import Path

warm = "torch" in sys.modules  # before this script imports it: the server had

import torch  # noqa: E402


def fail_deep() -> None:
    raise ValueError("rank 1 failed in its own code")


out = Path(sys.argv[1])
mode = sys.argv[2] if len(sys.argv) > 2 else "ok"
rank = int(os.environ["RANK"])
parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
probe = {
    "argv": [arg if arg != sys.argv[1] else "OUT" for arg in sys.argv],
    "name": __name__,
    "file": __file__,
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "session_leader": os.getsid(0) == os.getpid(),
    "stdin_empty": sys.stdin.read() == "",
    "rank": rank,
    "mark": os.environ.get("PROBE_MARK"),
    "threads": torch.get_num_threads(),
    "torch_rand": torch.rand(3).tolist(),  # torch seeds itself from the OS at import
    "py_random": random.random(),
    "warm": warm,
    "forked": b"phalanx.launch.warmserver" in parent,
}
(out / f"probe_{rank}.json").write_text(json.dumps(probe))
print(f"stdout of {rank}")
print(f"stderr of {rank}", file=sys.stderr)
if rank == 1 and mode == "exit3":
    sys.exit(3)
if rank == 1 and mode == "raise":
    fail_deep()
if rank == 1 and mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
