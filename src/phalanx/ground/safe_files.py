"""Files made and read in folders that others may write, without following a planted link.

A temporary name that can be guessed (`.out.pt.tmp-<pid>`, `metrics.jsonl.partial`)
lets anyone who can write the folder plant a symbolic link under it first: the
write then lands in the link's target, and the rename that follows puts the link
itself in the output's place. So every name phalanx makes for a file or folder it
is about to fill comes from here: random (48 bits, never reused), in the folder of
what it will become (the rename stays on one file system), created with
`O_CREAT|O_EXCL|O_NOFOLLOW` (a folder with `mkdir`, which follows no link either),
so a planted name is never written through: it is skipped for another.

Reading where others may write: `open_regular` refuses a link and anything but a
regular file before it can block (a FIFO blocks `open()` until a writer comes,
forever); `regular_inside` checks every step of a path below a folder the same way.

Failures are `OSError`s whose text says what was found ("is a symbolic link, which
phalanx does not follow"): callers already turn an `OSError` into their one line.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path
from typing import IO

__all__ = [
    "LINK_REFUSED",
    "create_dir",
    "create_file",
    "open_append",
    "open_new",
    "open_regular",
    "random_name",
    "regular_inside",
]

LINK_REFUSED = "is a symbolic link, which phalanx does not follow"
_NOT_REGULAR = "is not a regular file (a FIFO, a device or a folder), which phalanx does not read"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_ATTEMPTS = 100
"""Names tried before giving up: a collision of 48 random bits is a planted name or a bug."""


def random_name(stem: str, suffix: str = ".tmp") -> str:
    """`<stem>.<12 hex digits><suffix>`: what nobody can plant in advance."""
    return f"{stem}.{secrets.token_hex(6)}{suffix}"


def _refused(exc: OSError, path: Path) -> OSError:
    """ELOOP from O_NOFOLLOW as what it means; anything else as it was."""
    if exc.errno == errno.ELOOP:
        return OSError(errno.ELOOP, LINK_REFUSED, str(path))
    return exc


def open_new(path: Path, mode: int = 0o666) -> IO[bytes]:
    """`path`, which must not exist yet (not even as a link), opened for writing."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    try:
        fd = os.open(path, flags, mode)
    except OSError as exc:
        raise _refused(exc, path) from None
    return os.fdopen(fd, "wb")


def create_file(directory: Path, stem: str, suffix: str = ".tmp") -> tuple[Path, IO[bytes]]:
    """A new file under a random name in `directory`, open for writing."""
    for _ in range(_ATTEMPTS):
        path = directory / random_name(stem, suffix)
        try:
            return path, open_new(path)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free random name (planted names?)", str(directory))


def create_dir(directory: Path, stem: str, suffix: str = ".tmp") -> Path:
    """A new, empty folder under a random name in `directory` (the umask's permissions,
    as any folder the run makes)."""
    for _ in range(_ATTEMPTS):
        path = directory / random_name(stem, suffix)
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(errno.EEXIST, "no free random name (planted names?)", str(directory))


def open_append(path: Path) -> IO[str]:
    """`path` opened to append text, created if missing; a link there is refused."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | _NOFOLLOW | _CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        raise _refused(exc, path) from None
    return os.fdopen(fd, "a", encoding="utf-8", newline="")


def open_regular(path: Path) -> IO[bytes]:
    """`path` opened for reading if it is a regular file; never blocks, never follows a link
    at its last step."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
    except OSError as exc:
        raise _refused(exc, path) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, _NOT_REGULAR, str(path))
        if _NONBLOCK:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def regular_inside(root: Path, name: str) -> os.stat_result:
    """The stat of `root/name` if every step below `root` is a real folder (no link) and
    the last a regular file; otherwise OSError saying which step is what.

    `name` is relative and may not climb out (`..`, absolute): that is refused too.
    """
    parts = Path(name).parts
    if not parts or Path(name).is_absolute() or ".." in parts:
        raise OSError(errno.EINVAL, "lies outside its folder", str(root / name))
    path = root
    for i, part in enumerate(parts):
        path = path / part
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            raise OSError(errno.ELOOP, LINK_REFUSED, str(path))
        last = i == len(parts) - 1
        if last and not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, _NOT_REGULAR, str(path))
        if not last and not stat.S_ISDIR(info.st_mode):
            raise OSError(errno.ENOTDIR, "is not a folder", str(path))
    return info
