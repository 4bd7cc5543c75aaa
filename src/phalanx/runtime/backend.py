"""Which backend a job uses, and which device each rank then drives.

The two choices go together: nccl drives CUDA GPUs, xccl Intel GPUs, and
every other backend (gloo) the CPU. Validating a backend here, before any
group exists, turns a typo or "nccl on a CPU machine" into one clear error
instead of a failure deep inside the rendezvous.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from phalanx.errors import ConfigurationError

__all__ = ["backend_names", "claim_device", "current_device", "resolve_backend", "select_device"]


def _backend_available(name: str) -> bool:
    """Built into this torch, or registered by a plugin (the package needs torch >= 2.3)."""
    return bool(dist.is_backend_available(name))


def _available_backends() -> list[str]:
    """What to suggest: the usable backends, less torch's placeholders for tests."""
    hidden = ("undefined", "fake")
    return [b for b in dist.Backend.backend_list if b not in hidden and _backend_available(b)]


def backend_names(backend: str) -> list[str]:
    """The backend names in "gloo" or in torch's per-device form "cpu:gloo,cuda:nccl"."""
    return [part.split(":")[-1].strip() for part in backend.split(",") if part.strip()]


def resolve_backend(backend: str | None, cuda_available: bool | None = None) -> str:
    """The backend to use: nccl on a machine with GPUs, gloo otherwise, or `backend` checked."""
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if backend is None:
        return "nccl" if cuda and _backend_available("nccl") else "gloo"
    chosen = backend.strip().lower()
    names = backend_names(chosen)
    if not names:
        raise ConfigurationError(
            f"backend={backend!r} is empty — pass one of {_available_backends()} or None"
        )
    for name in names:
        if name == "nccl" and not cuda:
            raise ConfigurationError(
                "backend 'nccl' needs NVIDIA GPUs, but torch sees none on this machine — "
                "use backend='gloo' for CPU training (or leave backend unset to pick it)"
            )
        if name not in dist.Backend.backend_list:
            raise ConfigurationError(
                f"backend {name!r} is not one torch.distributed knows — "
                f"use one of {_available_backends()}"
            )
        if not _backend_available(name):
            raise ConfigurationError(
                f"backend {name!r} is not available in this torch build — "
                f"use one of {_available_backends()}"
            )
    return chosen


def _accelerator(backend: str) -> str | None:
    """The device type `backend` drives ("cuda", "xpu"), or None when it runs on the CPU."""
    names = backend_names(backend)
    if "nccl" in names:
        return "cuda"
    if "xccl" in names and hasattr(torch, "xpu"):
        return "xpu"
    return None


def select_device(backend: str, local_rank: int) -> torch.device:
    """The device a rank should claim: accelerator number `local_rank`, or the CPU."""
    kind = _accelerator(backend)
    if kind is None:
        return torch.device("cpu")
    if kind == "cuda":
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            raise ConfigurationError(
                f"local rank {local_rank} has no GPU: only {visible} visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}) — "
                f"start at most {visible} processes per node (--nproc-per-node {visible})"
            )
    return torch.device(kind, local_rank)


def claim_device(device: torch.device) -> None:
    """Make `device` current, so collectives and `.cuda()` land on this rank's own GPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "xpu":
        torch.xpu.set_device(device)


def current_device(backend: str) -> torch.device:
    """The device this rank's collectives run on: the current accelerator, else the CPU.

    Read from torch's state rather than chosen again, so describing a group the
    user built by hand never fails and matches what `init` claimed itself.
    """
    kind = _accelerator(backend)
    if kind is None or not getattr(torch, kind).is_available():
        return torch.device("cpu")
    return torch.device(kind, getattr(torch, kind).current_device())
