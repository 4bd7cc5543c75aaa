"""HSDP against flat fully_shard across two hosts joined by a 1 Gbit/s link.

Two network namespaces ("hosts") joined by a veth pair whose ends each send at
`--link-gbit` (1 by default: two machines on Gigabit Ethernet); two ranks per
host under `phalanx launch --nnodes 2`. In one job, two copies of a GPT (the
same seed, the same batches) take turns, round by round in a balanced order:

- `flat`: `fully_shard` over a 1-D mesh of the 4 ranks: every gather and
  reduce-scatter spans both hosts;
- `hsdp`: a 2-D mesh (replicate over the hosts, shard within each): gathers and
  reduce-scatters stay inside a host, and only the reduced shards cross the
  link, in one all-reduce per unit.

Reported: the bytes that crossed the link per step in each direction (the veth
device's own counters, read by host 0 around each variant's steps: headers,
acknowledgements and the barriers included), the median step time, both as
HSDP ÷ flat, and the largest difference between the two models' parameters
after training (they must be equal).

    sudo python benchmarks/hsdp_link.py                # ~5 minutes on 2 cores
    sudo python benchmarks/hsdp_link.py --tiny --rounds 2   # seconds: checks it runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "hsdp_link.json"
DEVICE_ENV = "PHALANX_BENCH_LINK_DEVICE"
VARIANTS = ("flat", "hsdp")


def build(mesh: Any, tiny: bool) -> tuple[Any, Any]:
    import models
    import torch

    import phalanx

    torch.manual_seed(0)
    if tiny:
        net = models.GPT(vocab=64, seq_len=16, d_model=32, n_head=2, n_layer=2)
    else:
        net = models.GPT(vocab=2048, seq_len=64, d_model=256, n_head=4, n_layer=6)
    for block in net.blocks:
        phalanx.fully_shard(block, mesh=mesh)
    phalanx.fully_shard(net, mesh=mesh)
    return net, torch.optim.Adam(net.parameters(), lr=1e-3)


def link_bytes() -> tuple[int, int]:
    """(sent, received) bytes of this host's end of the link so far."""
    stats = Path("/sys/class/net") / os.environ[DEVICE_ENV] / "statistics"
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def worker(args: argparse.Namespace) -> None:
    import interleave
    import models
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import phalanx

    torch.set_num_threads(1)
    world = phalanx.init(backend="gloo")
    assert world.world_size == 4, "two hosts of two ranks"
    meshes = {
        "flat": init_device_mesh("cpu", (4,)),
        "hsdp": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
    }
    variants = {name: build(mesh, args.tiny) for name, mesh in meshes.items()}
    vocab, seq = (64, 16) if args.tiny else (2048, 64)
    sent = {v: [0, 0] for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    steps_done = {v: 0 for v in VARIANTS}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name in interleave.balanced_order(r, VARIANTS):
            model, opt = variants[name]
            dist.barrier()
            before = link_bytes()
            for _ in range(args.per_round):
                g = torch.Generator().manual_seed(steps_done[name] * 10 + world.rank)
                tokens = torch.randint(0, vocab, (4, seq + 1), generator=g)
                start = time.perf_counter()
                models.token_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
                opt.step()
                opt.zero_grad()
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                steps_done[name] += 1
                if r:
                    times[name].append(float(elapsed))
            dist.barrier()
            after = link_bytes()
            if r:
                sent[name][0] += after[0] - before[0]
                sent[name][1] += after[1] - before[1]
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    states = {name: get_model_state_dict(m, options=full) for name, (m, _) in variants.items()}
    if world.rank == 0:
        flat: dict[str, Any] = states["flat"]  # full_state_dict: plain CPU tensors
        hsdp: dict[str, Any] = states["hsdp"]
        gap = max(float((flat[k] - hsdp[k]).abs().max()) for k in flat)
        steps = len(times["flat"])
        result = {
            "link_gbit": args.link_gbit,
            "steps_per_variant": steps,
            "bytes_per_step": {v: [b / steps for b in sent[v]] for v in VARIANTS},
            "step_s_median": {v: statistics.median(times[v]) for v in VARIANTS},
            "param_gap": gap,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    phalanx.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-gbit", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per-round", type=int, default=2)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from shaped_link import two_hosts

    flags = [f"--{k.replace('_', '-')}={v}" for k, v in
             (("link_gbit", args.link_gbit), ("rounds", args.rounds),
              ("per_round", args.per_round), ("out", args.out))]  # fmt: skip
    flags += ["--tiny"] if args.tiny else []
    with two_hosts(args.link_gbit) as hosts:
        procs = []
        for node, (ns, dev) in enumerate(zip(hosts.namespaces, hosts.devices)):
            path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
            env = {**os.environ, DEVICE_ENV: dev, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
            cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "phalanx", "launch",
                   "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
                   "--master-addr", hosts.addresses[0], "--master-port", "29581",
                   str(Path(__file__).resolve()), "--worker", *flags]  # fmt: skip
            procs.append(subprocess.Popen(cmd, env=env))
        codes = [p.wait(timeout=3600) for p in procs]
    if any(codes):
        print(f"the job failed (exit codes {codes})", file=sys.stderr)
        return 1
    result = json.loads(args.out.read_text())
    flat, hsdp = result["bytes_per_step"]["flat"], result["bytes_per_step"]["hsdp"]
    times = result["step_s_median"]
    print(
        f"per step, host 0 -> host 1: flat {flat[0] / 1e6:.1f} MB, HSDP {hsdp[0] / 1e6:.1f} MB "
        f"(HSDP ÷ flat {hsdp[0] / flat[0]:.3f}); host 1 -> host 0: flat {flat[1] / 1e6:.1f} MB, "
        f"HSDP {hsdp[1] / 1e6:.1f} MB ({hsdp[1] / flat[1]:.3f}); step: flat "
        f"{times['flat']:.3f} s, HSDP {times['hsdp']:.3f} s (HSDP ÷ flat "
        f"{times['hsdp'] / times['flat']:.3f}); parameters differ by {result['param_gap']:.2e}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
