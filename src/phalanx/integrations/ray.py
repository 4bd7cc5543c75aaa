"""phalanx under Ray Train: what you may call by hand (docs/ray.md).

The Trainer needs none of it: under `ray.train.torch.TorchTrainer` it reports each
checkpoint it seals and resumes from `ray.train.get_checkpoint()` by itself
(phalanx/train/cluster.py). This module is for the rest:

- a loop of your own, with phalanx's DDP: `restored()` for the checkpoint Ray kept,
  `report(metrics, checkpoint_dir)` once your rank 0 has written one;
- the driver, after `trainer.fit()`: `model_state_dict(result.checkpoint)`, the model
  of a phalanx checkpoint as one plain state dict whatever the zero_stage (stage 3's
  DCP shards gathered), to evaluate, compare or export it without a process group.

`ray` is imported by the functions that need it, when they run.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from phalanx.errors import ConfigurationError
from phalanx.runtime import init
from phalanx.train.raytrain import RaySession, ray_session

__all__ = ["in_ray_train", "model_state_dict", "report", "restored"]


def _session() -> RaySession:
    session = ray_session(init())
    if session is None:
        raise ConfigurationError(
            "this process is not a Ray Train worker — call it inside the function given to "
            "ray.train.torch.TorchTrainer (pip install phalanx[ray])"
        )
    return session


def in_ray_train() -> bool:
    """Whether this process runs a Ray Train worker's function (joins its group if need be)."""
    return ray_session(init()) is not None


@contextlib.contextmanager
def restored() -> Iterator[Path | None]:
    """The checkpoint Ray restored for this attempt, as a directory of this node, or None
    (the first attempt); it stays there for the block."""
    with _session().restored() as directory:
        yield directory


def report(metrics: Mapping[str, float | str], checkpoint_dir: str | Path | None = None) -> None:
    """Every rank, together: report `metrics`, and rank 0's `checkpoint_dir` (complete, on a
    file system the others' parts are in too) as this step's checkpoint."""
    session = _session()
    directory = None if checkpoint_dir is None else Path(checkpoint_dir)
    step = metrics.get("step", -1)
    session.report(metrics, int(step) if isinstance(step, (int, float)) else -1, directory)


def model_state_dict(checkpoint: Any) -> dict[str, Any]:
    """The model of a phalanx checkpoint that Ray holds (`result.checkpoint`, a
    `ray.train.Checkpoint`) or of a checkpoint directory, as one plain state dict: whole
    tensors in the plain model's keys, read on the driver without a process group."""
    from phalanx.train.checkpoint.consolidate import consolidate

    if isinstance(checkpoint, (str, Path)):
        directory: contextlib.AbstractContextManager[str] = contextlib.nullcontext(str(checkpoint))
    else:
        directory = checkpoint.as_directory()
    with directory as path, tempfile.TemporaryDirectory() as scratch:
        whole = consolidate(Path(path), Path(scratch) / "whole.pt")
    return dict(whole["model"])
