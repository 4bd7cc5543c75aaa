"""The torch-free ground floor: what the launcher and the workers both need.

Nothing here imports torch or a phalanx package above it (only phalanx.errors,
the other half of the ground row), so `phalanx launch`, which must start in
milliseconds and never hold a GPU, can import it; docs/architecture.md's layer
table, held by tests/unit/test_layers.py.

Modules: `jobenv` (the launcher's, torchrun's, srun's and mpirun's
environment), `netif` (which interface gloo and the store use), `ports`
(binding and free ports), `storeclient` (a TCPStore client in plain
sockets), `progress_record` (each rank's record of where it stands, read
after a stall), `parent_launch` (what the parent process, e.g. accelerate, asked for),
`store_keys` (every key phalanx writes in the job's store, and live recovery's
environment), `safe_files` (files made and read where others may write: random
names, no link followed),
`etcd` (an etcd v3 client over its HTTP gateway: the job's store under
--rdzv-backend etcd).
"""
