"""The command line of `phalanx launch`: torchrun's flags, with both of its spellings.

Every flag also answers to its underscore twin (`--nproc_per_node`), as in
torchrun, so existing launch commands need only the program name changed.
And, as in torchrun, each of torchrun's flags left off the command line is read
from `PET_<FLAG>` (PET_NNODES, PET_NODE_RANK, ...): Kubeflow's Trainer and
PyTorchJob give each pod its part of the job that way (docs/clusters.md).
What each flag does, and which are refused and why: docs/launch.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, NoReturn

from phalanx.cli.rdzvflags import DEFAULT_C10D_PORT
from phalanx.cli.suggest import nearest
from phalanx.errors import UsageError
from phalanx.launch.config import (
    DEFAULT_EXIT_TIMEOUT_S,
    DEFAULT_GRACE_S,
    DEFAULT_MULTINODE_PORT,
    DEFAULT_RDZV_TIMEOUT_S,
)

__all__ = ["TORCHRUN_ENV", "build_parser", "environment_defaults"]

Add = Callable[..., None]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message + self._did_you_mean(message))

    def _did_you_mean(self, message: str) -> str:
        """' (did you mean --nproc-per-node?)' after a mistyped flag, else nothing."""
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return ""
        flags = [w.split("=")[0] for w in message[len(prefix) :].split() if w.startswith("-")]
        guesses = [g for g in (nearest(f, self._option_string_actions) for f in flags) if g]
        return f" (did you mean {' and '.join(guesses)}?)" if guesses else ""


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


def _topology(add: Add) -> None:
    add(
        "--nproc-per-node --num-processes",
        "workers on this node: a number, auto (the GPUs, else 1), gpu or cpu; default 1",
        dest="nproc_per_node",
        default="1",
        metavar="NPROC",
    )
    add("--nnodes", "nodes in the job; default 1", default="1", metavar="N")
    add(
        "--node-rank",
        "this node's index, from 0 (c10d: assigned when not given)",
        type=int,
        metavar="R",
    )
    add(
        "--master-addr",
        "address of node 0, whose launcher hosts the store; needed with --nnodes > 1",
        metavar="HOST",
    )
    add(
        "--master-port",
        "the store's port; unset or 0: a free one on a single node, "
        f"{DEFAULT_MULTINODE_PORT} across nodes",
        type=int,
        metavar="PORT",
    )
    add(
        "--local-addr",
        "this node's own address (its store, interface and identity)",
        metavar="ADDR",
    )
    add("--standalone", "one node on 127.0.0.1 with a free port", action="store_true")


def _rendezvous(add: Add) -> None:
    add(
        "--rdzv-backend",
        "static (node ranks given with --node-rank) or c10d (assigned at rendezvous)",
        default="static",
        metavar="NAME",
    )
    add(
        "--rdzv-endpoint",
        "HOST[:PORT] of the store: static, the same as --master-addr/"
        "--master-port; c10d, the host whose launcher hosts it (port "
        f"{DEFAULT_C10D_PORT} by default)",
        metavar="HOST:PORT",
    )
    add(
        "--rdzv-id --run-id",
        "job id, given to workers as TORCHELASTIC_RUN_ID",
        dest="run_id",
        metavar="ID",
    )
    add(
        "--rdzv-conf",
        "KEY=VALUE,... : timeout (as --rdzv-timeout), join_timeout, read_timeout, "
        "connect_timeout, is_host",
        metavar="CONF",
    )
    add(
        "--rdzv-timeout",
        "seconds a node other than the store's host waits for the store, and every "
        f"launcher for the other nodes; default {DEFAULT_RDZV_TIMEOUT_S:g}",
        type=float,
        default=DEFAULT_RDZV_TIMEOUT_S,
        metavar="S",
    )


def _processes(add: Add) -> None:
    add(
        "--max-restarts",
        "restart the whole worker group up to K times after a failure",
        type=int,
        default=0,
        metavar="K",
    )
    add(
        "--monitor-interval",
        "seconds between checks of the workers; default 0.1",
        type=float,
        default=0.1,
        metavar="S",
    )
    add(
        "--shutdown-timeout",
        f"seconds between SIGTERM and SIGKILL when stopping workers; default {DEFAULT_GRACE_S:g}",
        type=float,
        default=DEFAULT_GRACE_S,
        metavar="S",
    )
    add(
        "--exit-timeout",
        "seconds a worker may take to exit once its script has ended; past them it is "
        f"shown (its stacks) and killed as hung; default {DEFAULT_EXIT_TIMEOUT_S:g}",
        type=float,
        default=DEFAULT_EXIT_TIMEOUT_S,
        metavar="S",
    )
    add(
        "--signals-to-handle",
        "signals that stop the job; default SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        metavar="SIGS",
    )
    add("--role", "ROLE_NAME of the workers; default 'default'", default="default", metavar="ROLE")
    add("-m --module", "run the target as a module, like python -m", action="store_true")
    add("--no-python", "run the target as an executable, not through python", action="store_true")
    add("--run-path", "run the script with runpy.run_path in the worker", action="store_true")
    add(
        "--virtual-local-rank",
        "LOCAL_RANK=0 everywhere, each worker seeing only its GPU",
        action="store_true",
    )
    add(
        "--start-method",
        "forkserver: fork the workers from a warm server that has imported torch; "
        "spawn (default), fork: fresh interpreters",
        choices=("spawn", "fork", "forkserver"),
        default="spawn",
    )


def _live_recovery(add: Add) -> None:
    add(
        "--live-recovery",
        "when a worker dies or stalls, the others go on without a restart and a replacement "
        "joins (--max-restarts of them); docs/reliability.md",
        action="store_true",
    )
    add(
        "--live-stall-timeout",
        "with --live-recovery: seconds without a worker's heartbeat before it is fenced off "
        "(killed and replaced); default 5",
        type=float,
        default=5.0,
        metavar="S",
    )
    add(
        "--live-min-members",
        "with --live-recovery: the fewest workers the run goes on with; default 1",
        type=int,
        default=1,
        metavar="N",
    )
    add(
        "--run-secret-file",
        "with --live-recovery: a file (mode 600) holding the run's secret, the same on every "
        "node; it signs what the workers write in the job's store (default: "
        "$PHALANX_RUN_SECRET, or a fresh one on a single node)",
        metavar="FILE",
    )
    add(
        "--live-quorum-timeout",
        "with --live-recovery: seconds survivors wait for --live-min-members before they "
        "stop; default 60",
        type=float,
        default=60.0,
        metavar="S",
    )


def _output(add: Add) -> None:
    add("--log-dir", "also write each rank's output to DIR/rank_<rank>.log", metavar="DIR")
    add(
        "-r --redirects",
        "streams to log files only: 1 stdout, 2 stderr, 3 both; or 0:1,1:2",
        metavar="STD",
    )
    add("-t --tee", "streams to log files and the console (as --redirects)", metavar="STD")
    add(
        "--local-ranks-filter",
        "show only these local ranks' output on the console, e.g. 0",
        metavar="RANKS",
    )
    add(
        "--duplicate-stdout-filters",
        "copy stdout lines containing any of these to a file",
        metavar="WORDS",
    )
    add(
        "--duplicate-stderr-filters",
        "copy stderr lines containing any of these to a file",
        metavar="WORDS",
    )


def _refused(add: Add) -> None:
    """Flags whose meaning is torch code in the launcher: parsed, to refuse them by name."""
    add(
        "--logs-specs",
        "only torchrun's default: phalanx writes its log layout itself",
        metavar="NAME",
    )
    add(
        "--event-log-handler",
        "only 'null': phalanx reports through its own messages",
        default="null",
        metavar="NAME",
    )
    add(
        "--numa-binding",
        "refused: see docs/launch.md",
        choices=("node", "socket", "exclusive", "core-complex"),
    )


# torchrun's flags that it reads from PET_<its dest> when they are not given (torch's
# argparse_util `env` / `check_env` actions), by phalanx's dest: (torchrun's dest, switch).
_VALUE_FLAGS = [
    "nnodes",
    "nproc_per_node",
    "node_rank",
    "master_addr",
    "master_port",
    "local_addr",
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_conf",
    "max_restarts",
    "monitor_interval",
    "start_method",
    "event_log_handler",
    "role",
    "log_dir",
    "redirects",
    "tee",
    "local_ranks_filter",
    "duplicate_stdout_filters",
    "duplicate_stderr_filters",
    "signals_to_handle",
    "shutdown_timeout",
]
_SWITCHES = ["standalone", "module", "no_python", "run_path", "virtual_local_rank"]
TORCHRUN_ENV: dict[str, tuple[str, bool]] = {
    **{dest: (dest, False) for dest in _VALUE_FLAGS},
    "run_id": ("rdzv_id", False),  # phalanx's dest for --rdzv-id
    **{dest: (dest, True) for dest in _SWITCHES},
}


def environment_defaults(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> list[str]:
    """Make each PET_<FLAG> in `environ` its flag's default, as torchrun does (a flag on the
    command line still wins); the ones taken, as 'PET_NNODES=2'."""
    taken, defaults = [], {}
    for dest, (torchrun_dest, switch) in TORCHRUN_ENV.items():
        variable = f"PET_{torchrun_dest.upper()}"
        raw = environ.get(variable, "")
        if not raw:  # torchrun's test too: an empty variable is no value
            continue
        defaults[dest] = _switch(variable, raw) if switch else _checked(parser, dest, variable, raw)
        taken.append(f"{variable}={raw}")
    parser.set_defaults(**defaults)
    return taken


def _switch(variable: str, raw: str) -> bool:
    """check_env's reading: an integer, true when not 0."""
    try:
        return bool(int(raw))
    except ValueError:
        raise UsageError(f"{variable}={raw!r} is not 0 or 1 — fix or unset it") from None


def _checked(parser: argparse.ArgumentParser, dest: str, variable: str, raw: str) -> Any:
    """`raw` as its flag's type, or one line naming the variable (argparse would name the
    flag, which is not on the command line)."""
    action = next(a for a in parser._actions if a.dest == dest and a.help != argparse.SUPPRESS)
    try:
        value = action.type(raw) if callable(action.type) else raw
    except ValueError:
        flag = action.option_strings[0]
        raise UsageError(f"{variable}={raw!r} is not a valid {flag} — fix or unset it") from None
    if action.choices is not None and value not in action.choices:
        raise UsageError(f"{variable}={raw!r} is not one of {list(action.choices)} — fix it")
    return value


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
    for group in (_topology, _rendezvous, _processes, _live_recovery, _output, _refused):
        group(add)
    parser.add_argument("script", help="the training script (or module, or executable)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="passed to the script")
    return parser
