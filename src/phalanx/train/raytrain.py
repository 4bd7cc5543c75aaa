"""Ray Train's side of a Trainer run, with no line of Ray in the user's function.

Ray Train's `TorchTrainer` runs the user's function in a thread of a long-lived
worker actor, with torchrun's variables set and the process group made
(ground/jobenv.py names that launcher "ray"). There, the Trainer:

- resumes from `ray.train.get_checkpoint()`, what Ray kept of the last checkpoint
  reported, when `resume_from_checkpoint` is True or unset: a restart under
  `FailureConfig` then goes on where the run was, on whatever node it lands;
- reports every completed checkpoint, after its atomic rename, with its metrics
  (`ray.train.report`): from every rank, since Ray Train's report is a barrier that
  every worker calls as often as the others, and with the checkpoint directory from
  rank 0 alone, the rank that writes and seals it (the other ranks' DCP shards are
  in the same directory, which needs a file system every rank sees, as DCP does);
- reports the run's last metrics at the end of `train()` when its last step was not
  saved, so `result.metrics` holds the loss the run ended with.

`ray` is imported here only, and only under that launcher: it is an extra
(`pip install phalanx[ray]`), never a dependency.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from phalanx.runtime import World


class RaySession:
    """The Ray Train worker session this rank runs in: what it restored, what it reports."""

    def __init__(self, world: World, train: ModuleType) -> None:
        self.world = world
        self._train = train
        self.reported_step: int | None = None
        """The step of the last report (every rank's the same)."""

    @contextlib.contextmanager
    def restored(self) -> Iterator[Path | None]:
        """The checkpoint Ray restored for this attempt, as a directory of this node (a copy
        when Ray's storage is remote, made for the duration of the block), or None."""
        checkpoint = self._train.get_checkpoint()
        if checkpoint is None:
            yield None
            return
        with checkpoint.as_directory() as directory:
            yield Path(directory)

    def report(
        self, metrics: Mapping[str, float | str], step: int, checkpoint: Path | None
    ) -> None:
        """Every rank together: `metrics`, and rank 0's `checkpoint` (already sealed), to Ray.

        The checkpoint keeps its name in Ray's storage (checkpoint-<step>), and phalanx's
        own copy stays where it is: rotation (save_total_limit) owns it.
        """
        given = None
        if checkpoint is not None and self.world.is_main:
            given = self._train.Checkpoint.from_directory(str(checkpoint))
        options: dict[str, Any] = {}
        if given is not None:
            options["checkpoint_dir_name"] = checkpoint.name if checkpoint else None
            if "delete_local_checkpoint_after_upload" in _parameters(self._train.report):
                options["delete_local_checkpoint_after_upload"] = False
        self._train.report(dict(metrics), checkpoint=given, **options)
        self.reported_step = step


def _parameters(function: Any) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(function).parameters
    except (TypeError, ValueError):
        return {}


def ray_session(world: World) -> RaySession | None:
    """This rank's Ray Train session, or None when Ray Train did not start it."""
    if world.launcher != "ray":
        return None
    try:
        import ray.train
    except ImportError:  # a Ray worker without Ray Train: nothing to report to
        return None
    try:
        ray.train.get_context()  # raises outside a Train worker (a plain Ray task or actor)
    except Exception:
        return None
    return RaySession(world, ray.train)
