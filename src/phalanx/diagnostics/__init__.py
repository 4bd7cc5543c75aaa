"""Diagnostics: what a rank records about itself so a failure can be explained.

Keep this file free of imports: `phalanx launch`, which must never import
torch, imports `phalanx.diagnostics.progress` to read the ranks' records.
"""

from __future__ import annotations

__all__: list[str] = []
