"""Capture and restore every random generator a training step draws from.

Exact resume needs each rank's dropout masks (torch CPU and CUDA), and any
Python or NumPy randomness in the user's code, to continue where they were.
The states are stored as tensors and plain numbers only, so a checkpoint
loads with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """The same seed on every rank: replicas start alike, as in a one-process run."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too


def capture_rng_state() -> dict[str, Any]:
    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {
            "version": int(version),
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": [],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    internal = tuple(int(v) for v in py["internal"].tolist())
    random.setstate((py["version"], internal, py["gauss_next"]))
    npy = state["numpy"]
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["name"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    _restore_cuda(state["cuda"])


def _restore_cuda(states: list[torch.Tensor]) -> None:
    if not states:
        return
    if not torch.cuda.is_available() or torch.cuda.device_count() != len(states):
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        warnings.warn(
            f"the checkpoint holds CUDA generator states for {len(states)} devices but this "
            f"process sees {visible}; CUDA randomness (dropout on GPU) will not continue "
            "exactly — resume on the same devices for an exact resume",
            UserWarning,
            stacklevel=3,
        )
        return
    torch.cuda.set_rng_state_all(states)
