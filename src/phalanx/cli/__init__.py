"""The `phalanx` command: `launch`, `consolidate` and `bench`.

Imports no torch at import time: `phalanx launch` starts the launcher
(phalanx.launch), `consolidate` imports the checkpoint readers only when it
runs, and `bench` runs its jobs under `phalanx launch`.
"""
