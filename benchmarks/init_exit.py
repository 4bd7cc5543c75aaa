"""A script that joins the group and leaves (for startup.py --to exit): the launcher's cost
with nothing else in the way. Every rank meets once (a barrier), then the job ends."""

from __future__ import annotations

import torch.distributed as dist

import phalanx


def main() -> None:
    phalanx.init(backend="gloo")
    dist.barrier()
    phalanx.shutdown()


if __name__ == "__main__":
    main()
