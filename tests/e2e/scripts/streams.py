"""One line to stdout and one to stderr naming this worker, its role and how it was run
(the launcher's output flags are compared with torchrun's on these lines)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def rank() -> str:
    # Not _common's: with --run-path the script's directory is not on sys.path (as in torchrun).
    return os.environ["RANK"]


if __name__ == "__main__":
    role = os.environ.get("ROLE_NAME")
    how = f"name={__name__} argv0={Path(sys.argv[0]).name} args={sys.argv[1:]}"
    print(f"out r{rank()} role={role} {how} apple")
    print(f"err r{rank()} pie, served", file=sys.stderr)
