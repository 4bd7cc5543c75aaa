"""What happens between two steps: Hugging Face's strategies for logging, evaluating and
saving, the callbacks' requests on top, and the best checkpoint so far.

Every input here is the same on every rank (the step, the epoch position, the
arguments, the control agreed between ranks, metrics reduced over ranks), so
every rank takes the same decisions: a save or an evaluation is collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from phalanx.errors import ConfigurationError
from phalanx.train.callbacks import TrainerControl
from phalanx.train.config.args import TrainingArguments
from phalanx.train.trainer_state import TrainState


@dataclass(frozen=True)
class Due:
    """What the arguments' strategies ask for after a step."""

    log: bool
    evaluate: bool
    save: bool


def due_after_step(
    args: TrainingArguments, step: int, max_steps: int, epoch_ended: bool, control: TrainerControl
) -> Due:
    """The strategies' decisions at `step`, or'ed with what the callbacks asked for."""
    log = (args.logging_strategy == "steps" and step % args.logging_steps == 0) or (
        args.logging_strategy == "epoch" and epoch_ended
    )
    evaluate = (args.eval_strategy == "steps" and step % args.eval_steps == 0) or (
        args.eval_strategy == "epoch" and epoch_ended
    )
    save = False
    if args.save_strategy == "steps" and args.save_steps:
        save = step % args.save_steps == 0 or step == max_steps
    elif args.save_strategy == "epoch":
        save = epoch_ended
    return Due(
        log=log or control.should_log,
        evaluate=evaluate or control.should_evaluate,
        save=save or control.should_save,
    )


def metric_key(args: TrainingArguments) -> str | None:
    name = args.metric_for_best_model
    if name is None:
        return None
    return name if name.startswith("eval_") else f"eval_{name}"


def record_evaluation(
    args: TrainingArguments, state: TrainState, metrics: dict[str, float]
) -> bool:
    """Note a new best metric_for_best_model in `state`; whether this evaluation is it."""
    key = metric_key(args)
    if key is None:
        return False
    if key not in metrics:
        raise ConfigurationError(
            f"metric_for_best_model={args.metric_for_best_model!r} looks for {key}, which the "
            f"evaluation did not report (it reported {sorted(metrics)}) — name one of those"
        )
    value = float(metrics[key])
    best = state.best_metric
    if best is not None and not (value > best if args.greater_is_better else value < best):
        return False
    state.best_metric, state.best_global_step = value, state.global_step
    return True


def record_save(state: TrainState, path: Path) -> None:
    """The checkpoint just written holds the best model when it is at the best step."""
    if state.best_global_step == state.global_step:
        state.best_model_checkpoint = str(path)
