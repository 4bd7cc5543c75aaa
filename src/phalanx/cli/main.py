"""The `phalanx` command (the console script and `python -m phalanx`): picks the subcommand.

Each subcommand's module imports no torch; `consolidate` imports it when it runs.
"""

from __future__ import annotations

import importlib.metadata
import platform
import re
import signal
import sys
from pathlib import Path

from phalanx.cli.bench import bench_main
from phalanx.cli.consolidate_cmd import consolidate_main
from phalanx.cli.launch_cmd import USAGE_EXIT, launch_main
from phalanx.cli.plan_cmd import plan_main
from phalanx.cli.suggest import nearest

COMMANDS = ("launch", "consolidate", "bench", "plan")
TOP_USAGE = """usage: phalanx <command> [args]  |  phalanx --version

commands:
  launch       start one worker process per device: phalanx launch --nproc-per-node 4 train.py
  consolidate  any checkpoint as one plain file: phalanx consolidate runs/a/checkpoint-200 out.pt
               or in Hugging Face's format: ... --format hf runs/a/checkpoint-200 out_dir/
  bench        measure a script at several world sizes: phalanx bench --nproc 1,2 train.py
  plan         which ZeRO stage, offload and micro-batch fit a memory budget:
               phalanx plan models.py:build --input 1024 --global-batch 64 --world 2 --budget 8GB

run 'phalanx launch --help' for its flags"""


def main(argv: list[str] | None = None) -> int:
    """The `phalanx` command: dispatches to its subcommands."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(TOP_USAGE, file=sys.stdout if args else sys.stderr)
        return 0 if args else USAGE_EXIT
    if args[0] in ("--version", "-V"):
        print(version_line())
        return 0
    if args[0] == "launch":
        try:
            return launch_main(args[1:])
        except KeyboardInterrupt:  # Ctrl-C before any worker started: nothing to stop
            return 128 + signal.SIGINT
    if args[0] == "consolidate":
        return consolidate_main(args[1:])
    if args[0] == "bench":
        return bench_main(args[1:])
    if args[0] == "plan":
        return plan_main(args[1:])
    guess = nearest(args[0], COMMANDS)
    hint = f" (did you mean {guess!r}?)" if guess else ""
    print(
        f"phalanx: error: unknown command {args[0]!r}{hint} — the commands are 'launch', "
        "'consolidate', 'bench' and 'plan', e.g. phalanx launch --nproc-per-node 2 train.py",
        file=sys.stderr,
    )
    return USAGE_EXIT


def version_line() -> str:
    """phalanx's version and what it runs on, for a bug report, without importing torch
    (the command starts in a fraction of a second): phalanx's from its __init__.py, the one
    place it is written; torch's from its installed metadata."""
    source = (Path(__file__).resolve().parents[1] / "__init__.py").read_text()
    found = re.search(r'^__version__ = "([^"]+)"', source, flags=re.MULTILINE)
    try:
        torch = f"torch {importlib.metadata.version('torch')}"
    except importlib.metadata.PackageNotFoundError:
        torch = "torch not installed"
    mine = found.group(1) if found else "unknown"
    return f"phalanx {mine} ({torch}, Python {platform.python_version()})"
