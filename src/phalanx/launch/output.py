"""Worker output: every line prefixed with its rank, never mixed with another line.

One thread per pipe reads whole lines and writes each one with a single
locked write, so N workers printing at once still give N intact lines. The
same lock covers the launcher's own messages and both of its streams, which
matters when stdout and stderr are the same terminal or file.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from pathlib import Path
from typing import IO, TextIO

# A line longer than this is passed on in pieces; it bounds a pump's memory when a
# worker writes megabytes without a newline.
_MAX_LINE_BYTES = 1 << 20
STDERR_TAIL_LINES = 20


class OutputSink:
    """The launcher's stdout and stderr, shared by every pump and by the agent's messages."""

    def __init__(self, stdout: TextIO, stderr: TextIO) -> None:
        self._streams = {False: stdout, True: stderr}
        self._lock = threading.Lock()

    def worker_line(
        self, prefix: bytes, line: bytes, *, to_stderr: bool, log: IO[bytes] | None
    ) -> None:
        """Write one line with its rank prefix, and unprefixed to the rank's log file."""
        with self._lock:
            self._write(to_stderr, prefix + line)
            if log is not None:
                # A full disk loses log lines, never the job: the pump must keep reading.
                with contextlib.suppress(OSError, ValueError):
                    log.write(line)
                    log.flush()

    def message(self, text: str) -> None:
        """A line from the launcher itself, on stderr, marked `[phalanx]`."""
        with self._lock:
            for line in text.splitlines() or [""]:
                self._write(True, f"[phalanx] {line}\n".encode())

    def _write(self, to_stderr: bool, data: bytes) -> None:
        """Write bytes through the binary layer when there is one (undecodable output passes
        through untouched), else as text.

        A reader that went away (`phalanx launch ... | head`) must not stop the
        pumps: a pump that stops reading fills the pipe and blocks its worker
        forever. So a broken stream is dropped and the lines are discarded.
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
        except (OSError, ValueError):  # BrokenPipeError, or a closed file
            self._streams.pop(to_stderr, None)


class RankOutput:
    """Pumps one worker's stdout and stderr until both pipes close."""

    def __init__(
        self,
        rank: int,
        stdout: IO[bytes],
        stderr: IO[bytes],
        sink: OutputSink,
        log_path: Path | None,
        log_header: str | None = None,
    ) -> None:
        self.rank = rank
        self._prefix = f"[rank {rank}] ".encode()
        self._sink = sink
        self._tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._log = _open_log(log_path, log_header)
        self._threads = [
            threading.Thread(target=self._pump, args=(stdout, False), daemon=True),
            threading.Thread(target=self._pump, args=(stderr, True), daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _pump(self, pipe: IO[bytes], is_stderr: bool) -> None:
        with pipe:
            for raw in iter(lambda: pipe.readline(_MAX_LINE_BYTES), b""):
                # A last line without a newline is still a line: end it so the next
                # line written to the terminal does not run into it.
                line = raw if raw.endswith(b"\n") else raw + b"\n"
                if is_stderr:
                    self._tail.append(line.decode(errors="replace").rstrip("\r\n"))
                self._sink.worker_line(self._prefix, line, to_stderr=is_stderr, log=self._log)

    def join(self, timeout_s: float) -> None:
        """Wait for both pipes to reach EOF. A grandchild that escaped the worker's process
        group can hold a pipe open forever, so this gives up after `timeout_s`."""
        for thread in self._threads:
            thread.join(timeout_s)
        if self._log is not None and not any(t.is_alive() for t in self._threads):
            self._log.close()

    def stderr_tail(self) -> list[str]:
        """The last lines the worker wrote to stderr: where a Python traceback ends up."""
        return list(self._tail)


def _open_log(path: Path | None, header: str | None) -> IO[bytes] | None:
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    # The first attempt starts a fresh file; restarts append after a header line.
    log = path.open("ab" if header else "wb")
    if header:
        log.write(f"{header}\n".encode())
        log.flush()
    return log
