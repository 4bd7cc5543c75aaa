"""`phalanx launch`: start one worker process per device and supervise them.

The launcher is a plain process supervisor. It imports no torch, so it starts
in milliseconds and can never hold a GPU that a worker needs; the workers
rendezvous among themselves through torch.distributed's TCP store, using the
MASTER_ADDR/MASTER_PORT the launcher puts in their environment.

Modules (tests/unit/test_layers.py holds this list to the folder):
- the input: `config` (the validated `LaunchConfig`; the command line that
  builds it is phalanx.cli's), `devices` (GPUs, cores);
- one node's run: `agent` (meet, spawn, watch, stop, restart), `meeting`
  (this node's side of the rendezvous), `rendezvous` (finding the store,
  node ranks), `rollcall` (no worker starts before every node is here; a wait
  for another host says whom it waits for), `storehost` (hosting the store),
  `etcdmeet` (--rdzv-backend etcd: the store in etcd, hosted by no launcher);
- the workers: `workers` (one attempt's processes), `workerenv` (their
  environment), `forkstart` (--start-method forkserver: the launcher's side of
  a warm server that forks them) and `warmserver` (that server: a process of
  its own, the one module here that imports torch, by name, in its own
  interpreter), `lifeline` (stops them if the launcher dies unseen),
  `procgroup` (signals to process groups), `exitwatch` (a worker hung in
  its exit: shown and killed), `live` (--live-recovery: a lost
  worker reported and replaced, a stalled one fenced, the others left running),
  `livenodes` (--live-recovery across hosts: a lost node noticed, its rank
  taken by a new host);
- what a user sees: `output` (rank-prefixed lines), `routing` (where each
  stream goes), `terminal` (rank 0's bar), `summary` (who failed, how).
"""

from __future__ import annotations

__all__: list[str] = []
