"""Write this worker's launcher-given environment to OUTDIR/env_<rank>_<restart>.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from _common import rank, write_atomically

NAMES = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PHALANX_RESTART_COUNT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "OMP_NUM_THREADS",
    "PYTHONUNBUFFERED",
    "GLOO_SOCKET_IFNAME",
    "CUDA_VISIBLE_DEVICES",
    "ROLE_NAME",
]

if __name__ == "__main__":
    out = Path(sys.argv[1])
    values: dict[str, object] = {name: os.environ.get(name) for name in NAMES}
    values["argv"] = sys.argv[2:]
    values["pid"] = os.getpid()
    restart = os.environ["PHALANX_RESTART_COUNT"]
    write_atomically(out / f"env_{rank()}_{restart}.json", json.dumps(values))
    print(f"env written by rank {rank()}")
