"""Real disks for failure tests: a tiny tmpfs to fill, a read-only one (fixtures for every
test through tests/conftest.py).

Mounting needs root (root ignores file modes, so a read-only directory must be
a read-only mount); without it the full-disk fixture skips and the read-only
one falls back to a directory without write permission.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def _mount_tmpfs(where: Path, options: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}) — needs root")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "size=4m")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False, timeout=30)


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "ro"
    if os.geteuid() == 0:
        _mount_tmpfs(where, "size=1m,ro")
        yield where
        subprocess.run(["umount", "-l", str(where)], check=False, timeout=30)
    else:
        where.mkdir()
        where.chmod(0o555)
        yield where
        where.chmod(0o755)


def fill(disk: Path) -> None:
    """Write zeros until the kernel says the disk is full."""
    with contextlib.suppress(OSError), (disk / "filler").open("wb") as file:
        while True:
            file.write(bytes(1 << 16))
            file.flush()


def own_disk(where: Path, size: str) -> None:
    """Mount a tmpfs of `size` at `where` that this process alone sees (a mount namespace of
    its own): another rank's disk at the same path, as on another node. Needs root."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS) failed — needs root")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True, timeout=30)
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True, timeout=30
    )
