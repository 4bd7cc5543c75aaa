"""A free TCP port for a master that picks its own: the launcher, the tests, the benchmarks.

No torch import here: the launcher uses it and must start fast without torch.
"""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port(avoid: int | None = None) -> int:
    """A TCP port nobody listens on now, different from `avoid`.

    Binding the wildcard address (as rank 0's TCP store will) proves the port is
    free on every interface. A restart avoids the previous port, whose sockets
    may still sit in TIME_WAIT.
    """
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        if port != avoid:
            return port
