"""The Trainer's checkpoints: written there and then, or in the background while it trains.

A save the loop makes (save_steps, save_strategy) goes to the background when
`save_async` is on and it is safe: every rank copies its state to host memory at
the step boundary and the checkpointer's writer thread writes it
(checkpoint/background.py). The save is *collected* — its `Saved` reported, its
error raised, `on_save` fired — at a step boundary every rank agrees on: the
loop's stop vote carries "my part is written" (stopping.py), so every rank
collects at the same step; or where the loop must wait for it: before the next
save (at most one in flight; the wait is said), before a stop's save, at the end
of train().

Written there and then instead: `Trainer.save_checkpoint()` (complete on
return), a stop's save, `save_async=False`, live recovery (its group changes
under a writer), a sharded entry that cannot hand its state over, and a run
with a callback of its own on `on_save`: Hugging Face's Trainer calls it once
the checkpoint is on disk, with `state.global_step` the step saved and the
model as saved, and callbacks rely on both (to upload `checkpoint-<step>`, to
snapshot the model).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch

from phalanx.diagnostics import timeline as timelines
from phalanx.errors import ConfigurationError, PhalanxError
from phalanx.train.checkpoint import hf_save
from phalanx.train.checkpoint.directory import PREFIX
from phalanx.train.checkpoint.writes import Saved, Staged
from phalanx.train.cluster import ClusterRun
from phalanx.train.flow import record_save
from phalanx.train.logging.report import human_size
from phalanx.train.nonfinite import check_parameters, first_nonfinite_in, nonfinite_error


class CheckpointSaves(ClusterRun):
    """Saving for the Trainer (its loop is trainer.py's)."""

    def save_checkpoint(self) -> Path:
        """Write output_dir/checkpoint-<step>/ now (every rank must call it); it is complete
        when this returns (a save in flight is completed first)."""
        return self._save(background=False)

    def _saves_in_background(self) -> bool:
        """Whether the loop's saves go to the background (the same on every rank)."""
        return (
            self.args.save_async
            and self._live is None
            and not self._callbacks.listen_to("on_save")
            and self._checkpointer.can_write_in_background(self.checkpoint_states())
        )

    def _save(self, background: bool) -> Path:
        """Save at this step: stage and hand to the writer thread, or write now."""
        self._check_open()
        if self.sampler is None and self.stream is None:
            raise ConfigurationError("save_checkpoint() needs a train_dataset — pass one")
        step = self.state.global_step
        self._collect_save(next_step=step)
        if not background:  # a background save checks its copy, on the writer (off the loop)
            check_parameters(self.model, self.world, step)  # never a NaN checkpoint
        self._sync_loss()
        notes = {"args.json": json.dumps(self.args.to_dict(), indent=1).encode()}
        notes.update(hf_save.checkpoint_notes(self.model, self._tied))  # config.json, for export
        derived = hf_save.derived_weights(self.args, self._tied)
        best = self.state.best_model_checkpoint
        self._checkpointer.protect = (
            Path(best) if self.args.load_best_model_at_end and best else None
        )
        states = self.checkpoint_states()
        saved: Saved | None = None
        with timelines.span_of(self.timeline, "checkpoint save"):
            if background:
                timeout, validate = self.args.ddp_timeout, partial(_nonfinite_model, step)
                self._checkpointer.start_background(states, step, notes, derived, timeout, validate)
            else:
                saved = self._checkpointer.save(states, step, notes, derived)
        self._saved_step = step
        path = Path(self.args.output_dir) / f"{PREFIX}{step}"
        record_save(self.state, path)
        if saved is not None:
            self._report_save(saved)
        return path

    def _save_vote(self) -> bool | None:
        """This rank's say in the boundary vote: None when no save is in flight, else
        whether its part is written."""
        writer = self._checkpointer.background
        return writer.done() if writer.in_flight else None

    def _collect_save(self, next_step: int | None = None) -> None:
        """Every rank together: wait for the save in flight, if one is, and report it (or
        raise its error, on every rank). `next_step`: the save that had to wait for it."""
        writer = self._checkpointer.background
        if not writer.in_flight:
            return
        writing, still_writing = writer.step, not writer.done()
        saved, waited = writer.collect()
        self._report_save(saved)
        if next_step is not None and still_writing:
            self._report.say(
                f"{PREFIX}{next_step} waited {waited:.2f} s for {PREFIX}{writing} to finish "
                "writing (one save in flight at a time)"
            )

    def _settle_save(self) -> None:
        """An error is leaving train(): let the save in flight finish (its checkpoint is good
        to resume from), say how it ended, and raise nothing more."""
        writer = self._checkpointer.background
        if not writer.in_flight:
            return
        try:
            saved, _ = writer.collect()
        except Exception as exc:
            self._report.say(f"the save in flight did not complete: {exc}")
            return
        self._report.say(_saved_line(saved))

    def _report_save(self, saved: Saved) -> None:
        self._callbacks.fire("on_save")
        self._report.say(_saved_line(saved))
        self._checkpoint_done(saved.path)  # sealed: Ray Train gets it (cluster.py)

    def _sync_loss(self) -> dict[str, float]:
        """Collective: fold this call's step losses into state.loss_sum; the call's summary."""
        if self._runlog is None:
            return {}
        self.state.loss_sum, summary = self._runlog.settle_loss(self.counted_steps())
        return summary


def _nonfinite_model(step: int, staged: Staged) -> PhalanxError | None:
    """The copy's model (rank 0's whole one, or this rank's shards) holds a NaN or an inf:
    checkpoint-<step> must not be written over good ones."""
    part = staged.replicated.get("model", staged.sharded.get("model"))
    name = None if part is None else first_nonfinite_in(_named_tensors(part))
    return None if name is None else nonfinite_error(name, step)


def _named_tensors(state: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a nested state, named by its keys joined with dots."""
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, Mapping):
        for key, value in state.items():
            yield from _named_tensors(value, f"{prefix}.{key}" if prefix else str(key))


def _saved_line(saved: Saved) -> str:
    size = human_size(saved.bytes)
    if saved.blocked_s >= saved.seconds:
        return f"saved {saved.path.name} ({size}, {saved.seconds:.2f} s)"
    return (
        f"saved {saved.path.name} ({size}, {saved.seconds:.2f} s, of which the loop "
        f"waited {saved.blocked_s:.2f} s)"
    )
