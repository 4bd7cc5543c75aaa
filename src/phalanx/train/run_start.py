"""Where a Trainer's `train()` starts: afresh, from a checkpoint, or (a replacement under
live recovery) from a live peer's state; and, as it ends, the best model loaded back.

Before the loop, in the order the ranks must go: the output dir (a barrier), the
seed, a fresh state and its checkpoint entries, the checkpoint (Ray's, when Ray
Train restored one: cluster.py), the report's opening (a barrier), the random
generators last of all (so nothing above shifts the dropout masks), then the
callbacks' on_train_begin.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from phalanx.diagnostics import timeline as timelines
from phalanx.train.checkpoint.outputdir import prepare_output_dir, restart_note
from phalanx.train.checkpoint.rng import seed_everything
from phalanx.train.cluster import ClusterReport, Resume
from phalanx.train.flow import metric_key
from phalanx.train.saving import CheckpointSaves
from phalanx.train.trainer_setup import TrainerSetup
from phalanx.train.trainer_state import ResumeWarning, TrainState, resume_warning


class RunStart:
    """A Trainer's starts: `begin` (or `join`, for a live replacement) before the loop,
    `load_best` after it. It works on the Trainer's own parts: its setup, the cluster's
    report of where to resume, and the saves (which learn the step output_dir holds)."""

    def __init__(self, setup: TrainerSetup, cluster: ClusterReport, saves: CheckpointSaves) -> None:
        self.setup = setup
        self.cluster = cluster
        self.saves = saves

    def begin(self, asked: Resume | None) -> tuple[str | None, bool]:
        """Everything before the loop: the checkpoint resumed from (None: afresh), and
        whether steps are left to train (False: already at max_steps, nothing opened)."""
        setup = self.setup
        resume = asked
        if resume is None:  # HF's field; "true" (any case) is True
            field = setup.args.resume_from_checkpoint
            resume = False if field is None else (True if field.lower() == "true" else field)
        restart = restart_note()
        if restart is not None:
            setup.report.say(f"{restart}: " + ("resuming…" if resume else "starting afresh"))
        with self.cluster.restored(asked, resume) as (resume, restored):
            prepare_output_dir(setup.world, setup.args, fresh=resume is False)
            seed_everything(setup.args.seed)
            setup.state = TrainState()
            setup.make_entries()
            resumed_from = None if resume is False else self._resume(resume, restored)
        state = setup.state
        if state.global_step >= setup.max_steps:
            setup.rng.restore()
            setup.report.say(f"already at max_steps ({setup.max_steps}) — nothing to do")
            return resumed_from, False
        keep_until = state.global_step if resumed_from is not None else 0
        with timelines.span_of(setup.timeline, "open run (barrier)"):
            setup.report.open(setup.max_steps, state.global_step, keep_until)
        setup.rng.restore()  # last, so nothing above can shift the dropout masks
        ours = resumed_from is not None and Path(resumed_from).parent == Path(setup.args.output_dir)
        self.saves.saved_step = state.global_step if ours else None  # no need to write it again
        setup.callbacks.control._new_training()
        setup.callbacks.fire("on_train_begin")
        setup.callbacks.agree()
        return resumed_from, True

    def join(self) -> None:
        """A replacement under live recovery: join, take a live peer's state, and go on where
        the others are (no output dir to prepare, no checkpoint to read, no barrier: the
        others are mid-run; the callbacks' on_train_begin was theirs)."""
        setup = self.setup
        assert setup.live is not None
        seed_everything(setup.args.seed)
        setup.state = TrainState()
        setup.make_entries()
        setup.live.join()
        self.saves.saved_step = None
        setup.callbacks.control._new_training()

    def load_best(self) -> None:
        """load_best_model_at_end: the model of the best evaluation's checkpoint, on every rank."""
        setup = self.setup
        best, state = setup.state.best_model_checkpoint, setup.state
        if not setup.args.load_best_model_at_end or best is None:
            return
        if state.best_global_step != state.global_step:  # else it is the model now
            model = setup.checkpoint_states()["model"]
            setup.checkpointer.load(Path(best), {"model": model})
        setup.report.say(
            f"loaded the best model: {Path(best).name} ({metric_key(setup.args)} "
            f"{state.best_metric:.6g})"
        )

    def _resume(self, resume_from: Resume, restored: Path | None = None) -> str | None:
        """`restored`: this node's copy of the checkpoint Ray restored (rank 0 chose its own)."""
        setup = self.setup
        path = setup.checkpointer.choose(resume_from)
        if path is None:
            setup.report.say(f"no checkpoint in {setup.args.output_dir} yet: starting at step 0")
            return None
        target = path if restored is None else restored
        setup.checkpointer.load(target, setup.checkpoint_states())
        warning = resume_warning(path.name, setup.counters, setup.position)
        if warning is not None and setup.world.is_main:
            warnings.warn(warning, ResumeWarning, stacklevel=3)
        state = setup.state
        sample = setup.position.consumed() * setup.world.world_size
        setup.report.say(
            f"resumed from {path.name} (step {state.global_step}, epoch {state.epoch}, "
            f"sample {sample} of the epoch)"
        )
        return str(path)
