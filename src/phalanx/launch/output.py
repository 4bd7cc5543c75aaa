"""Worker output: every line prefixed with its rank, never mixed with another line.

One thread per pipe reads whole lines and writes each one with a single
locked write, so N workers printing at once still give N intact lines. The
same lock covers the launcher's own messages and both of its streams, which
matters when stdout and stderr are the same terminal or file. Rank 0's
progress bar, when there is one (`terminal`), is redrawn below whatever else
is printed, never torn by it.
"""

from __future__ import annotations

import collections
import contextlib
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TextIO

from phalanx.launch.terminal import BarSplitter, read_chunks

# A line longer than this is passed on in pieces; it bounds a pump's memory when a
# worker writes megabytes without a newline.
_MAX_LINE_BYTES = 1 << 20
STDERR_TAIL_LINES = 20
_CLEAR_LINE = b"\r\x1b[K"
# torch's excepthook tags each traceback line `[rank<N>]: ` with the rank in torch's group,
# which is not always the launcher's (a live-recovery replacement starts as rank 0 of its
# own group): any such tag goes, the launcher's `[rank R] ` already says who wrote it.
_TORCH_TAG = re.compile(rb"\[rank\d+\]: ?")


class OutputSink:
    """The launcher's stdout and stderr, shared by every pump and by the agent's messages."""

    def __init__(self, stdout: TextIO, stderr: TextIO) -> None:
        self._streams = {False: stdout, True: stderr}
        self._lock = threading.Lock()
        self._bar: bytes | None = None  # the progress bar drawn on stderr's last line

    @property
    def stderr(self) -> TextIO | None:
        """The launcher's stderr; None once it broke (a closed pipe, a hung-up terminal)."""
        return self._streams.get(True)

    def worker_line(
        self, prefix: bytes, line: bytes, target: StreamTarget, *, to_stderr: bool, owns_bar: bool
    ) -> None:
        """Write one line with its rank prefix where `target` says, unprefixed to its files.

        A line from the stream that draws the bar replaces the bar (it is the
        bar's last state, or text printed over it); anyone else's line goes
        above the bar, which is drawn again below it.
        """
        with self._lock:
            if target.console:
                self._write_line(to_stderr, prefix + line, keep_bar=not owns_bar)
            for log in target.files:
                # A full disk loses log lines, never the job: the pump must keep reading.
                with contextlib.suppress(OSError, ValueError):
                    log.write(line)
                    log.flush()
            if target.filtered is not None and any(n in line for n in target.needles):
                with contextlib.suppress(OSError, ValueError):
                    target.filtered.write(prefix + line)
                    target.filtered.flush()

    def bar(self, prefix: bytes, text: bytes) -> None:
        """Draw rank 0's progress bar in its new state on stderr's last line."""
        with self._lock:
            self._bar = prefix + text
            self._write(True, _CLEAR_LINE + self._bar)

    def message(self, text: str) -> None:
        """A line from the launcher itself, on stderr, marked `[phalanx]`."""
        with self._lock:
            for line in text.splitlines() or [""]:
                self._write_line(True, f"[phalanx] {line}\n".encode(), keep_bar=True)

    def _write_line(self, to_stderr: bool, data: bytes, *, keep_bar: bool) -> None:
        if self._bar is None:
            self._write(to_stderr, data)
            return
        self._write(True, _CLEAR_LINE)
        self._write(to_stderr, data)
        if keep_bar:
            self._write(True, self._bar)
        else:
            self._bar = None

    def _write(self, to_stderr: bool, data: bytes) -> None:
        """Write bytes through the binary layer when there is one (undecodable output passes
        through untouched), else as text.

        A reader that went away (`phalanx launch ... | head`, a dropped ssh
        session) must not stop the pumps: a pump that stops reading fills the
        pipe and blocks its worker forever. So a broken stream is dropped and
        the lines are discarded.
        """
        stream = self._streams.get(to_stderr)
        if stream is None:
            return
        try:
            buffer = getattr(stream, "buffer", None)
            if buffer is not None:
                stream.flush()
                buffer.write(data)
                buffer.flush()
            else:
                stream.write(data.decode(errors="replace"))
                stream.flush()
        except (OSError, ValueError):  # BrokenPipeError, EIO of a hung-up tty, a closed file
            self._streams.pop(to_stderr, None)


@dataclass
class StreamTarget:
    """Where one of a worker's streams goes besides the rank's stderr tail."""

    console: bool = True
    files: list[IO[bytes]] = field(default_factory=list)
    """Unprefixed copies: the rank's combined log, torchrun's per-stream log."""
    filtered: IO[bytes] | None = None
    """--duplicate-*-filters: lines containing any of `needles` also go here, prefixed."""
    needles: tuple[bytes, ...] = ()


class RankOutput:
    """Pumps one worker's stdout and stderr until both close.

    `stderr` is a pipe, or the master fd of rank 0's progress-bar pty.
    """

    def __init__(
        self,
        rank: int,
        stdout: IO[bytes],
        stderr: IO[bytes] | int,
        sink: OutputSink,
        targets: tuple[StreamTarget, StreamTarget],
        owned_files: list[IO[bytes]],
    ) -> None:
        self.rank = rank
        self._prefix = f"[rank {rank}] ".encode()
        self._sink = sink
        self._targets = targets
        self._owned = owned_files
        self._tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._threads = [
            threading.Thread(target=self._pump, args=(_lines(stdout), False), daemon=True),
            threading.Thread(target=self._pump_stderr, args=(stderr,), daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _deliver(self, raw: bytes, is_stderr: bool, owns_bar: bool = False) -> None:
        # A last line without a newline is still a line: end it so the next
        # line written to the terminal does not run into it.
        line = raw if raw.endswith(b"\n") else raw + b"\n"
        if line.startswith(b"[rank") and (tag := _TORCH_TAG.match(line)) is not None:
            line = line[tag.end() :]
        if is_stderr:
            self._tail.append(line.decode(errors="replace").rstrip("\r\n"))
        target = self._targets[is_stderr]
        self._sink.worker_line(self._prefix, line, target, to_stderr=is_stderr, owns_bar=owns_bar)

    def _pump(self, lines: Iterator[bytes], is_stderr: bool) -> None:
        for raw in lines:
            self._deliver(raw, is_stderr)

    def _pump_stderr(self, stderr: IO[bytes] | int) -> None:
        if not isinstance(stderr, int):
            self._pump(_lines(stderr), True)
            return
        console = self._targets[True].console
        splitter = BarSplitter(
            line=lambda raw: self._deliver(raw, True, owns_bar=console),
            bar=(lambda text: self._sink.bar(self._prefix, text)) if console else lambda _: None,
        )
        for chunk in read_chunks(stderr):
            splitter.feed(chunk)
        splitter.flush()

    def join(self, timeout_s: float) -> None:
        """Wait for both streams to end. A grandchild that escaped the worker's process
        group can hold a pipe open forever, so this gives up after `timeout_s`."""
        for thread in self._threads:
            thread.join(timeout_s)
        if not any(t.is_alive() for t in self._threads):
            for log in self._owned:
                log.close()

    def stderr_tail(self) -> list[str]:
        """The last lines the worker wrote to stderr: where a Python traceback ends up."""
        return list(self._tail)


def _lines(pipe: IO[bytes]) -> Iterator[bytes]:
    with pipe:
        yield from iter(lambda: pipe.readline(_MAX_LINE_BYTES), b"")


def open_log(path: Path, header: str | None) -> IO[bytes]:
    """A rank's log: the first attempt starts a fresh file; restarts append after `header`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    log = path.open("ab" if header else "wb")
    if header:
        log.write(f"{header}\n".encode())
        log.flush()
    return log
