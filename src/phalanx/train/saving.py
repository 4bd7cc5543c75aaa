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
return), a stop's save, `save_async=False`, a sharded entry that cannot hand
its state over, and a run with a callback of its own on `on_save`: Hugging
Face's Trainer calls it once the checkpoint is on disk, with
`state.global_step` the step saved and the model as saved, and callbacks rely
on both (to upload `checkpoint-<step>`, to snapshot the model).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phalanx.errors import PhalanxError
from phalanx.offload import Streamer
from phalanx.train.callbacks import Callbacks
from phalanx.train.checkpoint import hf_save
from phalanx.train.checkpoint.checkpointer import Checkpointer
from phalanx.train.checkpoint.directory import PREFIX
from phalanx.train.checkpoint.stateful import Entry
from phalanx.train.checkpoint.writes import Saved, Staged
from phalanx.train.config.args import TrainingArguments
from phalanx.train.logging.report import RunReport, human_size
from phalanx.train.nonfinite import first_nonfinite_in, local_of, nonfinite_error


class CheckpointSaves:
    """The Trainer's saves: the one in flight, its collection, and who hears of each.

    It holds what every save goes through (the checkpointer and its writer thread, the
    report, the callbacks' on_save, `sealed`: the cluster's hook); what a save holds (the
    entries, the notes) the Trainer hands to `save` at each step.
    """

    def __init__(
        self,
        args: TrainingArguments,
        model: nn.Module,
        tied: dict[str, str],
        checkpointer: Checkpointer,
        report: RunReport,
        callbacks: Callbacks,
        sealed: Callable[[Path], None],
    ) -> None:
        self.args = args
        self.model = model
        """The unwrapped model: its config.json goes beside the entries, for export."""
        self.tied = tied
        """The model's tied weights (hf_save.tied_copies), found before sharding."""
        self.checkpointer = checkpointer
        self.report = report
        self.callbacks = callbacks
        self.sealed = sealed
        """Called once a checkpoint is sealed on every rank (ClusterReport.checkpoint_sealed)."""
        self.saved_step: int | None = None
        """The step output_dir holds a checkpoint of, written or resumed by this Trainer."""

    def in_background(self, states: dict[str, Entry]) -> bool:
        """Whether the loop's saves go to the background (the same on every rank): not for a
        callback's on_save. Under live recovery too: a write in flight when its generation
        ends fails at once (background.py), and the loop settles it before it recovers."""
        return (
            self.args.save_async
            and not self.callbacks.listen_to("on_save")
            and self.checkpointer.can_write_in_background(states)
        )

    def save(
        self,
        states: dict[str, Entry],
        step: int,
        best: str | None,
        background: bool,
        streamer: Streamer | None = None,
    ) -> Path:
        """Write checkpoint-<step> now, or stage it and hand it to the writer thread (the
        save in flight, if any, must have been collected); `best`: the best checkpoint so
        far, which save_total_limit must keep for load_best_model_at_end; `streamer`: the
        offloaded optimizer's, whose files a background save writes from, uncopied."""
        args = self.args
        notes = {"args.json": json.dumps(args.to_dict(), indent=1).encode()}
        notes.update(hf_save.checkpoint_notes(self.model, self.tied))  # config.json, for export
        derived = hf_save.derived_weights(args, self.tied)
        self.checkpointer.protect = Path(best) if args.load_best_model_at_end and best else None
        if background:
            timeout, validate = args.ddp_timeout, partial(_nonfinite_model, step)
            hold = streamer.hold_for_save() if streamer is not None else None
            self.checkpointer.start_background(
                states, step, notes, derived, timeout, validate, hold
            )
        else:
            self._report(self.checkpointer.save(states, step, notes, derived))
        self.saved_step = step
        return Path(args.output_dir) / f"{PREFIX}{step}"

    def vote(self) -> bool | None:
        """This rank's say in the boundary vote: None when no save is in flight, else
        whether its part is written."""
        writer = self.checkpointer.background
        return writer.done() if writer.in_flight else None

    def collect(self, next_step: int | None = None) -> None:
        """Every rank together: wait for the save in flight, if one is, and report it (or
        raise its error, on every rank). `next_step`: the save that had to wait for it."""
        writer = self.checkpointer.background
        if not writer.in_flight:
            return
        writing, still_writing = writer.step, not writer.done()
        saved, waited = writer.collect()
        self._report(saved)
        if next_step is not None and still_writing:
            self.report.say(
                f"{PREFIX}{next_step} waited {waited:.2f} s for {PREFIX}{writing} to finish "
                "writing (one save in flight at a time)"
            )

    def settle(self) -> None:
        """An error is leaving train(): let the save in flight finish (its checkpoint is good
        to resume from), say how it ended, and raise nothing more."""
        writer = self.checkpointer.background
        if not writer.in_flight:
            return
        try:
            saved, _ = writer.collect()
        except Exception as exc:
            self.report.say(f"the save in flight did not complete: {exc}")
            return
        self.report.say(_saved_line(saved))

    def _report(self, saved: Saved) -> None:
        self.callbacks.fire("on_save")
        self.report.say(_saved_line(saved))
        self.sealed(saved.path)  # sealed: Ray Train gets it (cluster.py)


def _nonfinite_model(
    step: int, staged: Staged, of_step: Callable[[torch.Tensor], torch.Tensor]
) -> PhalanxError | None:
    """The copy's model (rank 0's whole one, or this rank's shards; `of_step`: each one's
    values of the step) holds a NaN or an inf: checkpoint-<step> must not be written over
    good ones."""
    part = staged.replicated.get("model", staged.sharded.get("model"))
    if part is None:
        return None
    name = first_nonfinite_in((n, of_step(local_of(t))) for n, t in _named_tensors(part))
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
