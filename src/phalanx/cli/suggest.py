"""Did-you-mean for the command line: the nearest known word to a mistyped one."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["nearest"]

# difflib's ratio from which a word counts as a typo of another: 'lauch' -> 'launch' is
# 0.91, '--nproc-per-nod' -> '--nproc-per-node' 0.97; 'train.py' -> 'launch' 0.29.
_CUTOFF = 0.75


def nearest(word: str, known: Iterable[str]) -> str | None:
    """The known word `word` is most likely a typo of, or None when none is close."""
    found = difflib.get_close_matches(word, list(known), n=1, cutoff=_CUTOFF)
    return found[0] if found else None
