"""`phalanx launch`: start one worker process per device and supervise them.

The launcher is a plain process supervisor. It imports no torch, so it starts
in milliseconds and can never hold a GPU that a worker needs; the workers
rendezvous among themselves through torch.distributed's TCP store, using the
MASTER_ADDR/MASTER_PORT the launcher puts in their environment.

Modules: `cli` parses flags, `config` validates them, `devices` counts GPUs,
`workerenv` builds each worker's environment, `rendezvous` handles the
multi-node checks, `output` pumps worker output, `procgroup` signals process
groups, `agent` spawns, supervises, fails fast and restarts.
"""

from __future__ import annotations

__all__: list[str] = []
