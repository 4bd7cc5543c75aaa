"""One family of errors, so a user can catch everything phalanx raises on purpose.

Every error class lives here, below every layer: the launcher (which imports
no torch) raises some, and `World.barrier_or_raise` re-raises any of them by
name on the ranks that did not fail themselves, without importing train/.
Messages follow "what is wrong — what to do".
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ConfigurationError",
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
    "StoreTampered",
    "UnevenInputsError",
    "UsageError",
]


class PhalanxError(RuntimeError):
    """Base class of every error phalanx raises deliberately."""


class ConfigurationError(PhalanxError, ValueError):
    """A value the user passed (argument, environment variable) cannot work."""


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


class OffloadError(PhalanxError):
    """Offloaded state cannot be written: its directory is unwritable, or its disk is full.
    Raised on every rank of the step (each names the rank whose disk failed)."""


class RendezvousError(PhalanxError):
    """The ranks could not find each other (master unreachable, peers missing)."""


class MasterUnreachableError(PhalanxError):
    """A non-master node could not connect to the master's port within --rdzv-timeout."""


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


class NoQuorum(PhalanxError):
    """Under live recovery, too few members checked in to form the next group in time."""


class StoreTampered(PhalanxError):
    """Under live recovery, someone outside the run keeps overwriting a key of the protocol in
    the job's store, so the members cannot agree through it."""


class NotAMember(PeerLost):
    """Under live recovery, a rank of a newly formed group could not prove it belongs to the
    run (it does not hold the run's secret): the group is formed again without trusting it."""
