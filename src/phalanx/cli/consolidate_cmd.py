"""`phalanx consolidate CHECKPOINT_DIR OUT.pt`: the face of train/checkpoint/consolidate.py.

`--format hf OUT_DIR` writes the model in Hugging Face's format instead
(train/checkpoint/hf_export.py). torch is imported only when the command runs: the
`phalanx` command itself (and `phalanx launch`) must start without it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from phalanx.errors import PhalanxError

USAGE = "phalanx consolidate CHECKPOINT_DIR OUT.pt  (or --format hf CHECKPOINT_DIR OUT_DIR/)"
# huggingface_hub's default (hf_export.DEFAULT_MAX_SHARD_SIZE), repeated here so that --help
# needs no torch.
_MAX_SHARD_SIZE = "5GB"


def consolidate_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="phalanx consolidate",
        description="Write any phalanx checkpoint (DDP or ZeRO 1-3, any world size) as one "
        'plain file: torch.save({"model": ..., "optimizer": ...}), whole tensors, loadable '
        "with torch.load(weights_only=True) into the plain model and optimizer; or, with "
        "--format hf, its model as a directory from_pretrained reads (model.safetensors, "
        "sharded with an index over --max-shard-size; config.json and generation_config.json "
        "for a transformers model).",
    )
    parser.add_argument("checkpoint", type=Path, help="a checkpoint-<step> directory")
    parser.add_argument("out", type=Path, help="the file (pt) or directory (hf) to write")
    parser.add_argument(
        "--format",
        choices=("pt", "hf"),
        default="pt",
        help="pt: one torch.save file of model and optimizer (the default); hf: the model "
        "in Hugging Face's format (needs pip install 'phalanx[hf]')",
    )
    parser.add_argument(
        "--max-shard-size",
        default=_MAX_SHARD_SIZE,
        help='--format hf: the largest weight file, in bytes or as "5GB", "500MB" '
        f"(default {_MAX_SHARD_SIZE})",
    )
    args = parser.parse_args(argv)
    try:
        if args.format == "hf":
            return _hf(args.checkpoint, args.out, args.max_shard_size)
        return _pt(args.checkpoint, args.out)
    except PhalanxError as exc:
        print(f"phalanx consolidate: error: {exc}", file=sys.stderr, flush=True)
        return 1


def _pt(checkpoint: Path, out: Path) -> int:
    from phalanx.train.checkpoint.consolidate import consolidate

    whole = consolidate(checkpoint, out)
    states = len(whole["optimizer"].get("state", {}))
    print(
        f"wrote {out}: model ({len(whole['model'])} tensors), optimizer "
        f"({states} parameters' state, {len(whole['optimizer']['param_groups'])} groups)"
    )
    return 0


def _hf(checkpoint: Path, out: Path, max_shard_size: str) -> int:
    from phalanx.train.checkpoint.consolidate import consolidate_hf

    size: int | str = int(max_shard_size) if max_shard_size.isdigit() else max_shard_size
    written = consolidate_hf(checkpoint, out, size)
    tied = f", {len(written.tied_left_out)} tied copies left out" if written.tied_left_out else ""
    files = f"{len(written.files)} weight files" if len(written.files) > 1 else written.files[0]
    print(f"wrote {out}: {files} ({written.tensors} tensors{tied})")
    return 0
