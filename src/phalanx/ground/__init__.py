"""The torch-free ground floor: what the launcher and the workers both need.

Nothing here imports torch or any other phalanx package, so `phalanx launch`
(which must start in milliseconds and never hold a GPU) can import it; see
docs/architecture.md's layer table.
"""
