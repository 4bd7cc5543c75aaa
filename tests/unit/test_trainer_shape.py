"""The Trainer is one class that owns its parts (issue 37): its setup, saves and cluster
report are objects it holds, not base classes it inherits from."""

from __future__ import annotations

from phalanx.train import Trainer


def test_the_trainer_inherits_no_phalanx_class() -> None:
    inherited = [c for c in Trainer.__mro__[1:] if c.__module__.startswith("phalanx")]
    assert inherited == [], f"Trainer inherits {inherited}: compose them instead"
