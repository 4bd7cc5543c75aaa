"""`phalanx launch [flags] script.py [args]`: torchrun's flags, one clear line per mistake.

Both spellings of every flag work (`--nproc-per-node`, `--nproc_per_node`),
as in torchrun, so existing launch commands need only the program name changed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from phalanx.cli.launch_flags import build_parser, environment_defaults
from phalanx.cli.rdzvflags import store_site
from phalanx.errors import ConfigurationError, PhalanxError, UsageError
from phalanx.ground.netif import is_local_address
from phalanx.ground.runauth import SECRET_ENV, new_secret, read_secret_file
from phalanx.launch.agent import Agent
from phalanx.launch.config import (
    LaunchConfig,
    LiveOptions,
    parse_nnodes,
    parse_nproc,
    parse_signals,
)
from phalanx.launch.devices import cpu_count, gpu_count
from phalanx.launch.output import OutputSink
from phalanx.launch.routing import (
    ERR,
    OUT,
    OutputRouting,
    parse_filters,
    parse_ranks,
    parse_std,
)

USAGE_EXIT = 2


def config_from_args(ns: argparse.Namespace) -> LaunchConfig:
    """Turn parsed flags into a validated config; every mistake is a ConfigurationError."""
    _refuse_what_needs_torch(ns)
    nnodes = parse_nnodes(ns.nnodes)
    site = store_site(ns, nnodes)
    nproc = parse_nproc(ns.nproc_per_node)
    return LaunchConfig(
        command=_command(ns),
        use_python=not ns.no_python,
        run_path=ns.run_path,
        start_method=ns.start_method,
        nproc_per_node=nproc,
        nnodes=nnodes,
        node_rank=site.node_rank,
        master_addr=site.master_addr,
        master_port=site.master_port,
        max_restarts=ns.max_restarts,
        live=_live(ns, nnodes),
        log_dir=ns.log_dir,
        routing=_routing(ns),
        rdzv_timeout_s=site.rdzv_timeout_s,
        rdzv=site.rdzv,
        local_addr=ns.local_addr,
        grace_s=ns.shutdown_timeout,
        monitor_interval_s=ns.monitor_interval,
        exit_timeout_s=ns.exit_timeout,
        # torchrun's default id; the same on every node, as a job id should be.
        run_id=ns.run_id or (uuid.uuid4().hex[:12] if nnodes == 1 else "none"),
        role=ns.role,
        handled_signals=parse_signals(ns.signals_to_handle),
        virtual_local_rank=ns.virtual_local_rank,
        notes=site.notes + _more_workers_than_cores(nproc, gpu_count(), cpu_count()),
    )


def _more_workers_than_cores(nproc: int, gpus: int, cores: int) -> tuple[str, ...]:
    """A warning (the job still runs) when CPU workers outnumber the cores they may run on:
    they take turns on them, and their collectives wait for whichever is descheduled, so
    a step takes longer than with one worker per core. A test may want that; a run for
    speed does not. With a GPU visible the workers compute there: no warning."""
    if gpus or nproc <= cores:
        return ()
    return (
        f"warning: --nproc-per-node {nproc} starts more workers than the {cores} cores this "
        f"launcher may use, and no GPU is visible: they will share the cores — fine for a "
        f"test; for speed, --nproc-per-node {cores} or fewer",
    )


def _refuse_what_needs_torch(ns: argparse.Namespace) -> None:
    """The torchrun flags whose meaning is torch code running inside the launcher, and a
    --local-addr that is not this host's."""
    if ns.logs_specs not in (None, "default"):
        raise ConfigurationError(
            f"--logs-specs {ns.logs_specs} loads a torch LogsSpecs plugin into the launcher, "
            "which imports no torch — drop it: phalanx writes torchrun's log layout itself "
            "(--log-dir with -r/-t)"
        )
    if ns.event_log_handler != "null":
        raise ConfigurationError(
            f"--event-log-handler {ns.event_log_handler} is torch's elastic event API, which "
            "the launcher (no torch) does not run — drop it; the launcher's own [phalanx] "
            "lines report each start, failure and restart"
        )
    if ns.numa_binding is not None:
        raise ConfigurationError(
            "--numa-binding needs each GPU's NUMA node in CUDA's device order, which the "
            "launcher cannot read without torch — bind inside a wrapper instead, e.g. "
            "--no-python numactl --cpunodebind=N python train.py"
        )
    if ns.local_addr is not None and not is_local_address(ns.local_addr):
        raise ConfigurationError(
            f"--local-addr {ns.local_addr} is not an address of this host — pass one of its "
            "own addresses (ip -brief addr lists them)"
        )


def _routing(ns: argparse.Namespace) -> OutputRouting:
    filters = {
        stream: parse_filters(text)
        for stream, text in (
            (OUT, ns.duplicate_stdout_filters),
            (ERR, ns.duplicate_stderr_filters),
        )
        if text
    }
    return OutputRouting(
        redirects=parse_std("--redirects", ns.redirects) if ns.redirects else 0,
        tee=parse_std("--tee", ns.tee) if ns.tee else 0,
        local_ranks_filter=parse_ranks(ns.local_ranks_filter) if ns.local_ranks_filter else None,
        duplicate_filters={k: v for k, v in filters.items() if v},
    )


def _command(ns: argparse.Namespace) -> list[str]:
    if ns.module and (ns.no_python or ns.run_path):
        other = "--run-path" if ns.run_path else "--no-python"
        raise ConfigurationError(f"-m and {other} exclude each other — pick one")
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
    """`phalanx launch`: 0 on success, the failed worker's status, 2 for bad flags, 203 when
    the other nodes or the store could not be reached (errors.ExitCode)."""
    try:
        parser = build_parser()
        taken = environment_defaults(parser, os.environ)  # torchrun's PET_* variables
        ns = parser.parse_args(list(argv))
        config = config_from_args(ns)
        if taken:
            config = replace(config, notes=(*config.notes, _environment_note(taken)))
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
    except PhalanxError as exc:  # the master unreachable, a node missing: exit_code 203
        print(f"phalanx launch: error: {exc}", file=sys.stderr, flush=True)
        return int(exc.exit_code)


def _environment_note(taken: list[str]) -> str:
    return (
        f"read from the environment, as torchrun does: {', '.join(taken)} (a flag on the "
        "command line wins over its PET_ variable)"
    )


def _usage_error(message: str) -> int:
    print(f"phalanx launch: error: {message}", file=sys.stderr, flush=True)
    return USAGE_EXIT


def _live(ns: argparse.Namespace, nnodes: int) -> LiveOptions | None:
    if not ns.live_recovery:
        return None
    return LiveOptions(
        stall_s=ns.live_stall_timeout,
        min_members=ns.live_min_members,
        quorum_timeout_s=ns.live_quorum_timeout,
        secret=_run_secret(ns, nnodes),
    )


def _run_secret(ns: argparse.Namespace, nnodes: int) -> str:
    """The secret that signs the live protocol's store values: --run-secret-file, else
    PHALANX_RUN_SECRET, else (one node) a fresh one; it never travels through the store."""
    if ns.run_secret_file:
        return read_secret_file(ns.run_secret_file)
    given = os.environ.get(SECRET_ENV, "")
    if given:
        return given
    if nnodes > 1:
        raise ConfigurationError(
            "--live-recovery over several nodes needs the run's secret, the same on every "
            f"node — pass --run-secret-file FILE (chmod 600), or set {SECRET_ENV} on each "
            "(make one with: openssl rand -hex 32; docs/launch.md, 'Multi-node')"
        )
    return new_secret()
