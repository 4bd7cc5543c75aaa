"""The connections of the gloo groups a live-recovery run has left behind, shut down.

A group whose generation ended is kept, never destroyed: one of its collectives may still
be blocked, and destroying the group would wait for it (runtime/live.py). Kept as they
were, its connections did harm: a pair left with a send queued when its generation
ended keeps its socket registered for writing, so the group's tcp loop thread wakes at
once, again and again (`epoll_wait` answering EPOLLOUT, seen with strace). That thread
took 80-100% of a core until its process ended, and every later step of a 3-rank
stage-3 run on 2 cores took up to 30% longer (docs/results/live_goodput_zero3_*.json).

So every gloo group of the run is made through `GroupSockets.made`, which notes the TCP
connections its construction opened; once the generation is over, each that is still
the same socket is shut down (not closed: gloo still owns the descriptor, so its number
cannot be reused under it). The pairs see the end of their connections, their loop
sleeps, and a collective still blocked on one fails and frees its thread, here and on
the peer. Listening sockets are left alone (gloo aborts the process if its accept
fails). Linux's /proc only; elsewhere nothing is noted and nothing changes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["GroupSockets", "socket_fds"]

T = TypeVar("T")
_FDS = Path("/proc/self/fd")


def socket_fds() -> dict[int, str]:
    """This process's socket descriptors, fd -> 'socket:[inode]' (the inode tells a
    descriptor number reused for another socket apart)."""
    found: dict[int, str] = {}
    with contextlib.suppress(OSError):
        for fd in _FDS.iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:"):
                    found[int(fd.name)] = target
    return found


class GroupSockets:
    """The connections of each generation's gloo groups; owned by the run's LiveGroup."""

    def __init__(self) -> None:
        self._by_generation: dict[int, dict[int, str]] = {}
        self._lock = threading.Lock()

    def made(self, generation: int, create: Callable[[], T]) -> T:
        """`create()` (a gloo group of `generation`), the sockets it opened noted. One at a
        time, so that two groups made at once never take each other's."""
        with self._lock:
            before = socket_fds()
            group = create()
            opened = {fd: name for fd, name in socket_fds().items() if before.get(fd) != name}
            self._by_generation.setdefault(generation, {}).update(opened)
        return group

    def end_before(self, generation: int) -> int:
        """Shut down the connections of every generation before `generation`; how many."""
        with self._lock:
            over = [g for g in self._by_generation if g < generation]
            noted = [item for g in over for item in self._by_generation.pop(g).items()]
        now = socket_fds()
        return sum(_shut_down(fd) for fd, name in noted if now.get(fd) == name)


def _shut_down(fd: int) -> bool:
    """Shut a connected TCP socket down both ways (a listening one is left alone); whether it
    is down now (one the peer ended first counts)."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    with sock:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return False
        try:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                return False
            sock.shutdown(socket.SHUT_RDWR)
        except OSError as exc:
            return exc.errno == errno.ENOTCONN
        return True
