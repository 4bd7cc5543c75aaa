"""Fixtures every test directory may use."""

from tests.disks import read_only_dir, small_disk

__all__ = ["read_only_dir", "small_disk"]
