"""Join the job with phalanx.init(), say so in OUTDIR/ready_<rank> (with where this rank
stands), wait for OUTDIR/go, then all-reduce once and record the sum: a job that stays up
while a test looks at it from outside (which sockets listen, which ranks exist).
Usage: hold.py OUTDIR
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import phalanx

if __name__ == "__main__":
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    world = phalanx.init(backend="gloo", timeout=60)
    me = {"rank": world.rank, "node": world.node_rank, "world": world.world_size,
          "ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "pid": os.getpid()}  # fmt: skip
    tmp = out / f"ready_{world.rank}.tmp"
    tmp.write_text(json.dumps(me))
    os.replace(tmp, out / f"ready_{world.rank}")
    deadline = time.monotonic() + 60
    while not (out / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    total = torch.tensor([float(world.rank + 1)])
    dist.all_reduce(total)
    (out / f"sum_{world.rank}").write_text(str(total.item()))
    phalanx.shutdown()
