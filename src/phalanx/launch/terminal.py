"""Rank 0's progress bar on the launcher's terminal.

A progress bar (tqdm) draws only when its stream is a terminal, and redraws
its one line with carriage returns. Behind the launcher's pipes it would draw
nothing at all. So when the launcher's own stderr is a terminal, rank 0's
stderr is a pseudo-terminal of the same width (less the rank prefix): tqdm
sees a terminal and draws, and the launcher passes each redraw on as a
"bar" line that other output never tears: before any other line it clears
the bar, writes the line, and draws the bar again below it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import re
import shutil
import struct
import termios
from collections.abc import Callable, Iterator
from typing import TextIO

__all__ = ["BarSplitter", "open_bar_pty"]

# A redraw longer than this without a line end is not a bar: pass it on as a line.
_MAX_BAR_BYTES = 4096
_ENDINGS = re.compile(rb"\r\n|\n|\r")


def open_bar_pty(console: TextIO | None, prefix_width: int) -> tuple[int, int] | None:
    """(master, slave) fds of a pty as wide as `console` less the prefix; None when the
    console is not a terminal (then a bar would only pile up redraws in a log)."""
    try:
        if console is None or not console.isatty():
            return None
    except (AttributeError, ValueError):
        return None
    master, slave = pty.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.OPOST  # no "\n" -> "\r\n": lines arrive as the worker wrote them
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    size = shutil.get_terminal_size()
    winsize = struct.pack("HHHH", size.lines, max(20, size.columns - prefix_width), 0, 0)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, winsize)
    return master, slave


def read_chunks(master: int) -> Iterator[bytes]:
    """What the worker writes to the pty, until every writer has closed it.

    Linux reports a pty whose other side is closed with EIO rather than EOF.
    """
    with contextlib.closing(os.fdopen(master, "rb", buffering=0)) as stream:
        while True:
            try:
                chunk = stream.read(65536)
            except OSError:
                return
            if not chunk:
                return
            yield chunk


class BarSplitter:
    """Cuts a terminal byte stream into whole lines and progress-bar redraws.

    Text after a carriage return is the bar's new state and is shown at once,
    before its line ends; a line feed ends an ordinary line (a bar's last
    state, when tqdm closes it, becomes that line).
    """

    def __init__(self, line: Callable[[bytes], None], bar: Callable[[bytes], None]) -> None:
        self._line = line
        self._bar = bar
        self._pending = b""
        self._in_bar = False
        self._shown = b""

    def feed(self, chunk: bytes) -> None:
        data = self._pending + chunk
        # A trailing "\r" may be the first half of "\r\n": decide when the next byte comes.
        held = b"\r" if data.endswith(b"\r") else b""
        data = data[: len(data) - len(held)]
        start = 0
        for match in _ENDINGS.finditer(data):
            text = data[start : match.start()]
            if match.group() == b"\r":
                self._show_bar(text)
                self._in_bar = True
            else:
                self._line(text + b"\n")
                self._in_bar, self._shown = False, b""
            start = match.end()
        rest = data[start:]
        if self._in_bar:
            self._show_bar(rest)
        self._pending = rest + held
        if len(self._pending) > _MAX_BAR_BYTES:
            self.flush()

    def _show_bar(self, text: bytes) -> None:
        if text and text != self._shown:  # a redraw arrives again when its chunk grows
            self._bar(text)
            self._shown = text

    def flush(self) -> None:
        """The stream ended (or ran long without a line end): what is left is a line."""
        if self._pending:
            self._line(self._pending + b"\n")
        self._pending = b""
        self._in_bar = False
        self._shown = b""
