"""One family of errors, so a user can catch everything phalanx raises on purpose.

Every error class lives here, below every layer: the launcher (which imports
no torch) raises some, and `World.barrier_or_raise` re-raises any of them by
name on the ranks that did not fail themselves, without importing train/.
Messages follow "what is wrong — what to do".

Each class also says how a process it ends should exit (`exit_code`), so that a
scheduler can tell what is worth retrying (docs/clusters.md, "Exit codes"): a
configuration error fails the same way again (2: do not retry), a failure of
the machinery around the run (peers, the network, the store) may not (203:
retry). `ExitCode` names the whole contract.
"""

from __future__ import annotations

import enum
from typing import ClassVar

__all__ = [
    "CallbackError",
    "CheckpointError",
    "ConfigurationError",
    "ExitCode",
    "MasterUnreachableError",
    "NoQuorum",
    "NonFiniteError",
    "NotAMember",
    "NotSupportedError",
    "OffloadError",
    "OutputError",
    "PeerLost",
    "PhalanxError",
    "PortTakenError",
    "ReducerError",
    "RendezvousError",
    "ReplicaDivergenceError",
    "StoreLost",
    "StoreTampered",
    "UnevenInputsError",
    "UsageError",
]


class ExitCode(enum.IntEnum):
    """How a phalanx process ends, for a scheduler to act on (docs/clusters.md, "Exit codes").

    Kubeflow's `restartPolicy: ExitCode` restarts a pod that exited 128-255 and fails
    the job on 1-127 (training-operator's IsRetryableExitCode), so the codes worth a
    retry sit at 128 and above, and the others below.
    """

    OK = 0
    FAILED = 1
    """Any other failure: an uncaught exception of the script (Python's own 1); not retried,
    since a bug or a diverged model fails the same way again."""
    CONFIGURATION = 2
    """A ConfigurationError (and `phalanx launch`'s bad flags, as argparse): the job's own
    arguments or environment cannot work; a retry fails the same way."""
    PREEMPTED = 143
    """Stopped by SIGTERM after saving (128 + 15, what a shell gives; SIGINT: 130): retry,
    and the run resumes from that checkpoint."""
    INFRASTRUCTURE = 203
    """The machinery around the run failed: a peer died or hung, the network or the store
    went away, the master could not be reached. 128 + 75, sysexits' EX_TEMPFAIL ("try
    again later") lifted above every signal's 128 + N (N <= 64): retry."""


class PhalanxError(RuntimeError):
    """Base class of every error phalanx raises deliberately."""

    exit_code: ClassVar[int] = ExitCode.FAILED
    """The status a process that this error ends exits with (runtime/errorhook.py)."""


class ConfigurationError(PhalanxError, ValueError):
    """A value the user passed (argument, environment variable) cannot work."""

    exit_code = ExitCode.CONFIGURATION


class UsageError(ConfigurationError):
    """`phalanx launch`'s command line is malformed: argparse's complaint, said in one line."""


class PortTakenError(ConfigurationError):
    """The store's port is already taken on this host (another job, or another launcher)."""


class ReducerError(PhalanxError):
    """The gradient reducer saw a state that would give wrong gradients or a hang."""


class UnevenInputsError(ReducerError):
    """Under `Join(throw_on_early_termination=True)`, a rank ran out of batches: raised on
    every rank at the same iteration (torch raises a RuntimeError there)."""


class NotSupportedError(PhalanxError, NotImplementedError):
    """A torch feature phalanx does not provide on purpose: the message says why, and what
    to use instead (never silently ignored)."""

    exit_code = ExitCode.CONFIGURATION


class OffloadError(PhalanxError):
    """Offloaded state cannot be written: its directory is unwritable, or its disk is full.
    Raised on every rank of the step (each names the rank whose disk failed)."""


class RendezvousError(PhalanxError):
    """The ranks could not find each other (master unreachable, peers missing)."""

    exit_code = ExitCode.INFRASTRUCTURE


class MasterUnreachableError(PhalanxError):
    """A non-master node could not connect to the master's port within --rdzv-timeout."""

    exit_code = ExitCode.INFRASTRUCTURE


class CallbackError(PhalanxError):
    """A Trainer callback raised on some rank; every rank raises this at the same point."""


class ReplicaDivergenceError(PhalanxError):
    """The replicas of the model are not identical across ranks (`check_replicas`)."""


class CheckpointError(PhalanxError):
    """A checkpoint is missing, torn or corrupt, or cannot be written."""


class OutputError(PhalanxError):
    """A file the Trainer writes (metrics, output_dir itself) cannot be written: full disk,
    read-only file system, no permission."""


class NonFiniteError(PhalanxError):
    """A gradient or a parameter became NaN or infinite: training would only spread it (the
    all-reduce hands one rank's NaN to every replica), and a checkpoint would keep it."""


TRACEBACK_ENV = "PHALANX_TRACEBACK"
"""Set to 1: an uncaught PhalanxError prints its whole traceback (phalanx/runtime/errorhook.py)."""
TRACEBACK_FILE_ENV = "PHALANX_TRACEBACK_FILE"
"""Where an uncaught PhalanxError's traceback is written; `phalanx launch --log-dir` sets it."""


class PeerLost(PhalanxError):
    """Under live recovery, a peer died, stalled or is joining while a collective was in
    flight: the step is abandoned on every member and the group is formed again."""

    exit_code = ExitCode.INFRASTRUCTURE


class NoQuorum(PhalanxError):
    """Under live recovery, too few members checked in to form the next group in time."""

    exit_code = ExitCode.INFRASTRUCTURE


class StoreLost(PhalanxError):
    """The job's replicated store (etcd) answers no more: a majority of its members is gone,
    so nothing can be agreed through it. Every rank and every launcher stops in one line,
    after a checkpoint where the ranks can still save one together."""

    exit_code = ExitCode.INFRASTRUCTURE


class StoreTampered(PhalanxError):
    """Under live recovery, someone outside the run keeps overwriting a key of the protocol in
    the job's store, so the members cannot agree through it."""


class NotAMember(PeerLost):
    """Under live recovery, a rank of a newly formed group could not prove it belongs to the
    run (it does not hold the run's secret): the group is formed again without trusting it."""
