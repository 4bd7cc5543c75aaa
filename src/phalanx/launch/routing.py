"""Where each worker's stdout and stderr go: torchrun's -r, -t, --local-ranks-filter and
--duplicate-*-filters, with torchrun's spellings and torchrun's log layout.

`-r 3` (or `-r 0:1,1:2`, per local rank) sends a stream to a log file only,
`-t` to the file and the console; the files are where torchrun writes them,
`<log dir>/<run id>_<random>/attempt_<n>/<local rank>/{stdout,stderr}.log`,
so tools that read torchrun's logs find ours. Bits: 1 stdout, 2 stderr, 3 both.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from phalanx.errors import ConfigurationError

__all__ = ["ERR", "OUT", "OutputRouting", "parse_filters", "parse_ranks", "parse_std"]

OUT, ERR = 1, 2
StdSpec = int | Mapping[int, int]


def parse_std(flag: str, value: str) -> StdSpec:
    """torchrun's stream spec: `3` for every local rank, or `0:1,1:2` per local rank."""
    text = value.strip()
    try:
        if ":" not in text:
            return _std_bits(int(text))
        pairs = (item.split(":") for item in text.split(","))
        return {int(rank): _std_bits(int(bits)) for rank, bits in pairs}
    except ValueError:
        raise ConfigurationError(
            f"{flag} {value!r} is not a stream spec — use 0 (none), 1 (stdout), 2 (stderr), "
            "3 (both), or per local rank like 0:1,1:2"
        ) from None


def _std_bits(bits: int) -> int:
    if not 0 <= bits <= 3:
        raise ValueError(bits)
    return bits


def parse_ranks(value: str) -> frozenset[int]:
    """--local-ranks-filter 0,1,2."""
    try:
        return frozenset(int(item) for item in value.split(","))
    except ValueError:
        raise ConfigurationError(
            f"--local-ranks-filter {value!r} is not a list of local ranks — e.g. 0,1,2"
        ) from None


def parse_filters(value: str) -> tuple[str, ...]:
    """--duplicate-stdout-filters 'apple,orange'; a doubled comma is a literal comma."""
    pieces = value.replace(",,", "\0").split(",")
    return tuple(p.replace("\0", ",") for p in pieces if p)


def _bits(spec: StdSpec, local_rank: int) -> int:
    return spec if isinstance(spec, int) else spec.get(local_rank, 0)


@dataclass(frozen=True)
class OutputRouting:
    """The output flags, asked per local rank and stream (OUT or ERR)."""

    redirects: StdSpec = 0
    tee: StdSpec = 0
    local_ranks_filter: frozenset[int] | None = None
    duplicate_filters: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    """Stream -> substrings: lines containing any are copied to filtered_<stream>.log."""

    def to_file(self, local_rank: int, stream: int) -> bool:
        """The stream is written to torchrun's per-stream log file (-r or -t)."""
        return bool((_bits(self.redirects, local_rank) | _bits(self.tee, local_rank)) & stream)

    def to_console(self, local_rank: int, stream: int) -> bool:
        """Shown on the console: not filtered out, and teed if it is redirected."""
        if self.local_ranks_filter is not None and local_rank not in self.local_ranks_filter:
            return False
        return not (_bits(self.redirects, local_rank) & stream) or bool(
            _bits(self.tee, local_rank) & stream
        )

    @property
    def writes_files(self) -> bool:
        """Anything goes to torchrun's log layout, which then has to be made."""
        return bool(self.redirects or self.tee or self.duplicate_filters)


class LogLayout:
    """torchrun's log directories for this run, one `attempt_<n>` per attempt."""

    def __init__(self, log_dir: str | None, run_id: str) -> None:
        base = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="phalanx_logs_"))
        base.mkdir(parents=True, exist_ok=True)
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"{run_id}_", dir=base))

    def attempt_dir(self, attempt: int, nproc: int) -> Path:
        """A fresh attempt directory with one subdirectory per local rank, as torchrun's."""
        path = self.run_dir / f"attempt_{attempt}"
        shutil.rmtree(path, ignore_errors=True)
        for local_rank in range(nproc):
            (path / str(local_rank)).mkdir(parents=True)
        return path
