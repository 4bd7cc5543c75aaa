"""What a run can tell about itself: replica checks, progress records, timelines.

Keep this file free of imports: `phalanx launch`, which must never import
torch, imports `phalanx.diagnostics.progress` to read the ranks' records.
"""
