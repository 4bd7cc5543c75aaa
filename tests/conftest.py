"""What every test starts from."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from tests.disks import read_only_dir, small_disk

__all__ = ["no_group_left_behind", "read_only_dir", "small_disk"]  # fixtures for every test


@pytest.fixture(autouse=True)
def no_group_left_behind() -> Iterator[None]:
    """Each test starts as a fresh process does: with no default process group.

    A Trainer made in pytest's own process joins a one-rank group and keeps it
    until `close()` or exit, as it would in a user's script; left in place, the
    next test would find that group and describe it instead of building its own.
    """
    yield
    dist = sys.modules.get("torch.distributed")  # never import torch for launcher-only tests
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
