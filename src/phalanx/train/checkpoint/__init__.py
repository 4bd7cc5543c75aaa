"""Checkpoints: the atomic directory, the ranks' save and load, the
entries' protocol, and reading a checkpoint back out (consolidate, Hugging
Face's format)."""
