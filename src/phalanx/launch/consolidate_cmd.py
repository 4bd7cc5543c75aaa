"""`phalanx consolidate CHECKPOINT_DIR OUT.pt`: the command-line face of train/consolidate.py.

torch is imported only when the command runs: the `phalanx` command itself
(and `phalanx launch`) must start without it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from phalanx.errors import PhalanxError

USAGE = "phalanx consolidate CHECKPOINT_DIR OUT.pt"


def consolidate_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="phalanx consolidate",
        description="Write any phalanx checkpoint (DDP or ZeRO 1-3, any world size) as one "
        'plain file: torch.save({"model": ..., "optimizer": ...}), whole tensors, loadable '
        "with torch.load(weights_only=True) into the plain model and optimizer.",
    )
    parser.add_argument("checkpoint", type=Path, help="a checkpoint-<step> directory")
    parser.add_argument("out", type=Path, help="the file to write")
    args = parser.parse_args(argv)
    from phalanx.train.consolidate import consolidate

    try:
        whole = consolidate(args.checkpoint, args.out)
    except PhalanxError as exc:
        print(f"phalanx consolidate: error: {exc}", file=sys.stderr, flush=True)
        return 1
    states = len(whole["optimizer"].get("state", {}))
    print(
        f"wrote {args.out}: model ({len(whole['model'])} tensors), optimizer "
        f"({states} parameters' state, {len(whole['optimizer']['param_groups'])} groups)"
    )
    return 0
