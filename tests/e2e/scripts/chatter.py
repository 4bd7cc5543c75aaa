"""Print many long lines to stdout and stderr from two threads at once, then a line with no
newline: the launcher must keep every line whole and prefixed with the right rank."""

from __future__ import annotations

import sys
import threading

from _common import rank

LINES = int(sys.argv[1])
WIDTH = int(sys.argv[2])


def chatter(stream: object, tag: str) -> None:
    body = chr(ord("a") + rank()) * WIDTH
    for i in range(LINES):
        # Two writes per line, so a pump that forwarded partial reads would split lines.
        stream.write(f"{tag} r{rank()} {i} {body[: WIDTH // 2]}")  # type: ignore[attr-defined]
        stream.write(f"{body[WIDTH // 2 :]}\n")  # type: ignore[attr-defined]


if __name__ == "__main__":
    threads = [
        threading.Thread(target=chatter, args=(sys.stdout, "out")),
        threading.Thread(target=chatter, args=(sys.stderr, "err")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sys.stdout.write(f"partial r{rank()} no newline")
