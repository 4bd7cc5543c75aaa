"""Peak host memory of `phalanx consolidate --format hf`: one weight file at a time, not the model.

A plain model of `--layers` 2500x2500 Linears (25 MB each in fp32; 12 of them:
300 MB) is saved as a checkpoint both ways the Trainer saves a model: one
`model.pt` (stages 0-2) and a DCP `model/` directory (stage 3). Each is then
exported with `--max-shard-size` (default 105MB: 3 weight files of four layers) by the command
a user runs, each run a fresh process reporting its own peak RSS; beside them,
the plain `phalanx consolidate OUT.pt`, which reads the model whole. Each
child resets the kernel's peak-RSS mark after its imports and reports the
peak above its RSS at that point: the export's own memory. The variants run
interleaved, `--rounds` times.

    python benchmarks/hf_export_memory.py                 # ~1 minute on 2 cores
    python benchmarks/hf_export_memory.py --layers 4      # a quick look
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "docs" / "results" / "hf_export_memory.json"

# A child: after its imports, reset the kernel's peak-RSS mark (VmHWM, by writing 5 to
# /proc/self/clear_refs), run the consolidate command's main in-process, then print its
# RSS before and its peak during the run (MB): the export's own memory, imports apart.
CHILD = """
import sys
from phalanx.cli.consolidate_cmd import consolidate_main
import phalanx.train.checkpoint.consolidate, safetensors.torch, huggingface_hub
import torch.distributed.checkpoint.state_dict_loader

def status(key):
    line = next(x for x in open("/proc/self/status") if x.startswith(key + ":"))
    return int(line.split()[1]) / 1024

with open("/proc/self/clear_refs", "w") as marks:
    marks.write("5")
before = status("VmRSS")
code = consolidate_main(sys.argv[1:])
print("RSS_MB", before, status("VmHWM"), flush=True)
sys.exit(code)
"""


def make_checkpoints(root: Path, layers: int, width: int) -> tuple[Path, Path, int]:
    """checkpoint-1 with a model.pt, and checkpoint-2 with a DCP model/; the model's bytes."""
    import torch
    import torch.distributed.checkpoint as dcp

    from phalanx.train.checkpoint.directory import begin, seal, write_checkpoint, write_file

    torch.manual_seed(0)
    state = {}
    for i in range(layers):
        state[f"body.{i}.weight"] = torch.randn(width, width)
        state[f"body.{i}.bias"] = torch.randn(width)
    size = sum(t.numel() * t.element_size() for t in state.values())
    optimizer: dict[str, Any] = {"state": {}, "param_groups": []}  # the plain consolidate needs one
    pt = write_checkpoint(root / "pt", 1, {"model.pt": state, "optimizer.pt": optimizer})
    staging = begin(root / "dcp", 2)
    dcp.save({"model": state}, checkpoint_id=str(staging / "model"))
    written = {"optimizer.pt": write_file(staging, "optimizer.pt", optimizer)}
    entries: dict[str, Any] = {"model": "sharded", "optimizer": "replicated"}
    sharded = seal(staging, 2, entries, written)
    return pt, sharded, size


def run_child(argv: list[str]) -> float:
    """The export's peak RSS above the process's RSS before it began (MB)."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *argv],
        capture_output=True,
        text=True,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        cwd=REPO,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{argv}: {done.stderr[-2000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("RSS_MB"))
    before, peak = (float(v) for v in line.split()[1:])
    return peak - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=2500)
    parser.add_argument("--max-shard-size", default="105MB")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hf-export-mem-") as scratch:
        root = Path(scratch)
        pt, sharded, size = make_checkpoints(root, args.layers, args.width)
        shards = ["--max-shard-size", args.max_shard_size]
        variants: dict[str, list[str]] = {
            "hf export of model.pt (stages 0-2)": ["--format", "hf", str(pt), "OUT", *shards],
            "hf export of DCP model/ (stage 3)": ["--format", "hf", str(sharded), "OUT", *shards],
            "plain consolidate of DCP model/ to OUT.pt (reads it whole)": [str(sharded), "OUT"],
        }
        peaks: dict[str, list[float]] = {name: [] for name in variants}
        files = 0
        for _ in range(args.rounds):
            for name, argv in variants.items():
                out = root / "out"
                if out.is_dir():
                    shutil.rmtree(out)
                out.unlink(missing_ok=True)
                peaks[name].append(run_child([str(out) if a == "OUT" else a for a in argv]))
                if out.is_dir():
                    files = max(files, len(list(out.glob("*.safetensors"))))
    report: dict[str, Any] = {
        "date": "2026-12-03",
        "what": "peak RSS of one export above the process's RSS before it (MB), fresh processes",
        "model_mb": round(size / 1e6, 1),
        "max_shard_size": args.max_shard_size,
        "weight_files": files,
        "peak_above_start_mb": {name: [round(v, 1) for v in vs] for name, vs in peaks.items()},
    }
    print(json.dumps(report, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
