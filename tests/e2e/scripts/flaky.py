"""Rank 1 fails on restarts below SUCCEED_AT; every attempt records what it was given."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from _common import rank, write_atomically

if __name__ == "__main__":
    out, succeed_at = Path(sys.argv[1]), int(sys.argv[2])
    restart = int(os.environ["PHALANX_RESTART_COUNT"])
    seen = {k: os.environ[k] for k in ("MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")}
    write_atomically(out / f"attempt_{rank()}_{restart}.json", json.dumps(seen))
    if rank() == 1 and restart < succeed_at:
        # Not before rank 0 has recorded this attempt: the launcher stops it when we fail.
        deadline = time.monotonic() + 30
        while not (out / f"attempt_0_{restart}.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        print(f"rank 1 fails on restart {restart}", file=sys.stderr)
        sys.exit(1)
