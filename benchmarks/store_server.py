"""The launcher's store (pure Python, ground/storeserver.py) against torch's own TCPStore
server: microseconds per request seen by torch's C++ client, with several clients at once.

Each round starts one server of each kind, in an order that alternates, and runs the
same clients against it: each client process does `--requests` set/get/add triples
on its own keys and one shared counter. The job's store serves rendezvous, gloo's
connection setup and live recovery's keys: a few thousand requests per run, so what
matters is that no client waits noticeably longer on ours.

    python benchmarks/store_server.py --rounds 5 --out docs/results/store_server.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from interleave import balanced_order

_CLIENT = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), None, False, timeout=timedelta(seconds=60))
n = int(sys.argv[2]); me = sys.argv[3]
start = time.perf_counter()
for i in range(n):
    store.set(f"{me}/{i % 64}", b"x" * 100)
    store.get(f"{me}/{i % 64}")
    store.add("shared", 1)
print((time.perf_counter() - start) / (3 * n) * 1e6)
"""


def _clients(port: int, clients: int, requests: int) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CLIENT, str(port), str(requests), f"c{i}"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(clients)
    ]
    return [float(p.communicate(timeout=600)[0]) for p in procs]


def _ours(clients: int, requests: int) -> list[float]:
    from phalanx.ground.storeserver import StoreServer

    listener = socket.create_server(("127.0.0.1", 0))
    server = StoreServer(listener)
    server.serve()
    try:
        return _clients(int(listener.getsockname()[1]), clients, requests)
    finally:
        server.stop()
        listener.close()


def _torchs(clients: int, requests: int) -> list[float]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=60),
                          wait_for_workers=False)  # fmt: skip
    try:
        return _clients(int(store.port), clients, requests)
    finally:
        del store


def measure(rounds: int, clients: int, requests: int) -> dict[str, Any]:
    servers = {"phalanx": _ours, "torch": _torchs}
    runs: dict[str, list[float]] = {name: [] for name in servers}
    for i in range(rounds):
        for name in balanced_order(i, list(servers)):
            runs[name].append(statistics.median(servers[name](clients, requests)))
    med = {name: statistics.median(us) for name, us in runs.items()}
    result = {
        "clients": clients,
        "requests_per_client": 3 * requests,
        "rounds": rounds,
        "machine": f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end",
        "date": time.strftime("%Y-%m-%d"),
        "median_us_per_request": med,
        "ratio": med["phalanx"] / med["torch"],
        "runs_us": runs,
    }
    print(
        f"{clients} clients, {3 * requests} requests each, median of {rounds} rounds: "
        f"phalanx {med['phalanx']:.0f} us, torch {med['torch']:.0f} us per request "
        f"(phalanx ÷ torch {result['ratio']:.2f})",
        flush=True,
    )
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = parser.parse_args()
    result = measure(args.rounds, args.clients, args.requests)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
