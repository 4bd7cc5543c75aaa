"""`phalanx launch [flags] script.py [args]`: torchrun's flags, one clear line per mistake.

Both spellings of every flag work (`--nproc-per-node`, `--nproc_per_node`),
as in torchrun, so existing launch commands need only the program name changed.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

from phalanx.errors import ConfigurationError, PhalanxError, UsageError
from phalanx.launch.agent import Agent
from phalanx.launch.config import (
    DEFAULT_MULTINODE_PORT,
    DEFAULT_RDZV_TIMEOUT_S,
    LaunchConfig,
    parse_nnodes,
    parse_nproc,
)
from phalanx.launch.consolidate_cmd import consolidate_main
from phalanx.launch.output import OutputSink

USAGE_EXIT = 2
TOP_USAGE = """usage: phalanx <command> [args]

commands:
  launch       start one worker process per device: phalanx launch --nproc-per-node 4 train.py
  consolidate  any checkpoint as one plain file: phalanx consolidate runs/a/checkpoint-200 out.pt

run 'phalanx launch --help' for its flags"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _flag(parser: argparse.ArgumentParser, names: str, help: str, **kwargs: Any) -> None:
    """Add a flag under its names, and torchrun's underscored twins as hidden aliases.

    The aliases default to SUPPRESS so they never overwrite the main flag's default.
    """
    spellings = names.split()
    parser.add_argument(*spellings, help=help, **kwargs)
    twins = ["--" + n[2:].replace("-", "_") for n in spellings if n.startswith("--")]
    hidden = {**kwargs, "help": argparse.SUPPRESS, "default": argparse.SUPPRESS}
    hidden.pop("metavar", None)
    for twin in twins:
        if twin not in spellings:
            parser.add_argument(twin, **hidden)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="phalanx launch",
        usage="phalanx launch [flags] script.py [script args]  |  phalanx launch [flags] -m "
        "module [args]",
        description="Start NPROC workers on this node, each with torchrun's environment "
        "(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...); stop them all when one fails. "
        "Every flag also accepts torchrun's underscore spelling (--nproc_per_node).",
        allow_abbrev=False,
    )
    add = partial(_flag, parser)
    add(
        "--nproc-per-node --num-processes",
        "workers on this node: a number, auto (the GPUs, else 1), gpu or cpu; default 1",
        dest="nproc_per_node",
        default="1",
        metavar="NPROC",
    )
    add("--nnodes", "nodes in the job; default 1", default="1", metavar="N")
    add("--node-rank", "this node's index, from 0", type=int, default=0, metavar="R")
    add(
        "--master-addr",
        "address of node 0, where rank 0 listens; needed with --nnodes > 1",
        metavar="HOST",
    )
    add(
        "--master-port",
        "rank 0's port; unset or 0: a free one on a single node, "
        f"{DEFAULT_MULTINODE_PORT} across nodes",
        type=int,
        metavar="PORT",
    )
    add(
        "--max-restarts",
        "restart the whole worker group up to K times after a failure",
        type=int,
        default=0,
        metavar="K",
    )
    add("--log-dir", "also write each rank's output to DIR/rank_<rank>.log", metavar="DIR")
    add("--standalone", "one node on 127.0.0.1 with a free port", action="store_true")
    add(
        "--rdzv-timeout",
        "seconds a node other than 0 waits for the master to be reachable; "
        f"default {DEFAULT_RDZV_TIMEOUT_S:g}",
        type=float,
        default=DEFAULT_RDZV_TIMEOUT_S,
        metavar="S",
    )
    add(
        "--rdzv-id --run-id",
        "job id, given to workers as TORCHELASTIC_RUN_ID",
        dest="run_id",
        metavar="ID",
    )
    add(
        "--rdzv-backend",
        "only static (fixed node ranks) is supported",
        default="static",
        metavar="NAME",
    )
    add(
        "--rdzv-endpoint",
        "HOST[:PORT], the same as --master-addr HOST --master-port PORT",
        metavar="HOST:PORT",
    )
    add(
        "--monitor-interval",
        "seconds between checks of the workers; default 0.1",
        type=float,
        default=0.1,
        metavar="S",
    )
    add("-m --module", "run the target as a module, like python -m", action="store_true")
    add("--no-python", "run the target as an executable, not through python", action="store_true")
    parser.add_argument("script", help="the training script (or module, or executable)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="passed to the script")
    return parser


def config_from_args(ns: argparse.Namespace) -> LaunchConfig:
    """Turn parsed flags into a validated config; every mistake is a ConfigurationError."""
    nnodes = parse_nnodes(ns.nnodes)
    master_addr, master_port = _master(ns, nnodes)
    return LaunchConfig(
        command=_command(ns),
        use_python=not ns.no_python,
        nproc_per_node=parse_nproc(ns.nproc_per_node),
        nnodes=nnodes,
        node_rank=ns.node_rank,
        master_addr=master_addr,
        master_port=master_port,
        max_restarts=ns.max_restarts,
        log_dir=ns.log_dir,
        rdzv_timeout_s=ns.rdzv_timeout,
        monitor_interval_s=ns.monitor_interval,
        **({"run_id": ns.run_id} if ns.run_id else {}),
    )


def _master(ns: argparse.Namespace, nnodes: int) -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT; port 0 means the agent picks a free one per attempt."""
    if ns.rdzv_backend != "static":
        raise ConfigurationError(
            f"--rdzv-backend {ns.rdzv_backend} assigns node ranks at run time, which phalanx "
            "does not do — give each node --node-rank, plus --master-addr and --master-port"
        )
    addr, port = ns.master_addr, ns.master_port
    if ns.rdzv_endpoint:
        host, endpoint_port = _split_endpoint(ns.rdzv_endpoint)
        addr = addr or host
        port = endpoint_port if port is None else port
    if ns.standalone:
        if nnodes != 1:
            raise ConfigurationError("--standalone is for one node — drop it or --nnodes")
        return "127.0.0.1", 0
    if nnodes == 1:
        return addr or "127.0.0.1", port or 0
    if not addr:
        raise ConfigurationError(
            f"--nnodes {nnodes} needs --master-addr — pass node 0's address on every node"
        )
    return addr, DEFAULT_MULTINODE_PORT if port is None else port


def _split_endpoint(endpoint: str) -> tuple[str, int | None]:
    host, colon, port = endpoint.rpartition(":")
    if not colon:
        return endpoint, None
    if not port.isdigit():
        raise ConfigurationError(
            f"--rdzv-endpoint {endpoint!r} is not HOST[:PORT] — e.g. 10.0.0.1:29500"
        )
    return host, int(port)


def _command(ns: argparse.Namespace) -> list[str]:
    if ns.module and ns.no_python:
        raise ConfigurationError("-m and --no-python exclude each other — pick one")
    if ns.module:
        return ["-m", ns.script, *ns.script_args]
    if ns.no_python:
        if shutil.which(ns.script) is None:
            raise ConfigurationError(f"{ns.script!r} is not an executable — check the path")
        return [ns.script, *ns.script_args]
    if not Path(ns.script).is_file():
        raise ConfigurationError(
            f"script {ns.script!r} not found — check the path, or use -m for a module"
        )
    return [ns.script, *ns.script_args]


def launch_main(argv: Sequence[str]) -> int:
    """`phalanx launch`: 0 on success, the failed worker's status, 2 for bad flags."""
    try:
        ns = build_parser().parse_args(list(argv))
        config = config_from_args(ns)
    except UsageError as exc:
        return _usage_error(f"{exc} — run 'phalanx launch --help' for the flags")
    except ConfigurationError as exc:
        return _usage_error(str(exc))
    except SystemExit as exc:  # --help printed its text
        return int(exc.code or 0)
    try:
        return Agent(config, OutputSink(sys.stdout, sys.stderr)).run()
    except ConfigurationError as exc:
        return _usage_error(str(exc))
    except PhalanxError as exc:
        print(f"phalanx launch: error: {exc}", file=sys.stderr, flush=True)
        return 1


def _usage_error(message: str) -> int:
    print(f"phalanx launch: error: {message}", file=sys.stderr, flush=True)
    return USAGE_EXIT


def main(argv: list[str] | None = None) -> int:
    """The `phalanx` command: dispatches to its subcommands."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(TOP_USAGE, file=sys.stdout if args else sys.stderr)
        return 0 if args else USAGE_EXIT
    if args[0] == "launch":
        try:
            return launch_main(args[1:])
        except KeyboardInterrupt:  # Ctrl-C before any worker started: nothing to stop
            return 128 + signal.SIGINT
    if args[0] == "consolidate":
        return consolidate_main(args[1:])
    print(
        f"phalanx: error: unknown command {args[0]!r} — the commands are 'launch' and "
        "'consolidate', e.g. phalanx launch --nproc-per-node 2 train.py",
        file=sys.stderr,
    )
    return USAGE_EXIT
