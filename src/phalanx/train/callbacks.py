"""Callbacks with Hugging Face's events, arguments and control object, on every rank.

A callback is any object with some of `TrainerCallback`'s methods (so
transformers' own callbacks, `EarlyStoppingCallback` included, run as they
are). Each is called as `on_<event>(args, state, control, **kwargs)` with the
kwargs Hugging Face passes (model, optimizer, lr_scheduler, train_dataloader,
and metrics or logs); a returned `TrainerControl` replaces the control.

What differs from a one-process loop, and why: every rank runs every
callback, and the ranks must then take the same decisions, or their
collectives no longer pair up (one rank saving while another trains on
hangs both). So what the callbacks ask for (`control.should_*`) is agreed
between steps: a flag any rank set holds on every rank. An exception in a
callback is held too, and the ranks stop together at the next agreement,
each raising one line that names the callback, the event and the rank,
instead of one rank dying while the others wait out the timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from phalanx.errors import CallbackError
from phalanx.runtime import World
from phalanx.runtime.agree import raise_on_every_rank

EVENTS = (
    "on_init_end",
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_step_begin",
    "on_step_end",
    "on_evaluate",
    "on_log",
    "on_save",
)
_FLAGS = (
    "should_training_stop",
    "should_epoch_stop",
    "should_save",
    "should_evaluate",
    "should_log",
)


@dataclass
class TrainerControl:
    """What the callbacks ask the loop to do (Hugging Face's fields and meanings)."""

    should_training_stop: bool = False
    """Stop training after this step (never set back)."""
    should_epoch_stop: bool = False
    """End this epoch after this step (set back at the next epoch)."""
    should_save: bool = False
    """Save a checkpoint at this step (set back at the next step)."""
    should_evaluate: bool = False
    """Evaluate at this step (set back at the next step)."""
    should_log: bool = False
    """Log at this step (set back at the next step)."""

    def _new_training(self) -> None:
        self.should_training_stop = False

    def _new_epoch(self) -> None:
        self.should_epoch_stop = False

    def _new_step(self) -> None:
        self.should_save = self.should_evaluate = self.should_log = False


@dataclass
class CallbackState:
    """The loop's state as Hugging Face's `TrainerState` names it, for callbacks to read."""

    epoch: float | None = None
    global_step: int = 0
    max_steps: int = 0
    num_train_epochs: float = 0.0
    logging_steps: int = 0
    eval_steps: int = 0
    save_steps: int = 0
    train_batch_size: int = 0
    log_history: list[dict[str, float]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None
    total_flos: float = 0.0
    rank: int = 0
    """phalanx's: this process's rank (callbacks run on every rank)."""
    world_size: int = 1


class TrainerCallback:
    """A base with every event as a no-op: override the ones you need."""

    def on_init_end(
        self, args: Any, state: CallbackState, control: TrainerControl, **kw: Any
    ) -> Any:
        return None

    def on_train_begin(
        self, args: Any, state: CallbackState, control: TrainerControl, **kw: Any
    ) -> Any:
        return None

    def on_train_end(
        self, args: Any, state: CallbackState, control: TrainerControl, **kw: Any
    ) -> Any:
        return None

    def on_epoch_begin(
        self, args: Any, state: CallbackState, control: TrainerControl, **kw: Any
    ) -> Any:
        return None

    def on_epoch_end(
        self, args: Any, state: CallbackState, control: TrainerControl, **kw: Any
    ) -> Any:
        return None

    def on_step_begin(
        self, args: Any, state: CallbackState, control: TrainerControl, **kw: Any
    ) -> Any:
        return None

    def on_step_end(
        self, args: Any, state: CallbackState, control: TrainerControl, **kw: Any
    ) -> Any:
        return None

    def on_evaluate(
        self, args: Any, state: CallbackState, control: TrainerControl, **kw: Any
    ) -> Any:
        return None

    def on_log(self, args: Any, state: CallbackState, control: TrainerControl, **kw: Any) -> Any:
        return None

    def on_save(self, args: Any, state: CallbackState, control: TrainerControl, **kw: Any) -> Any:
        return None


class EarlyStoppingCallback(TrainerCallback):
    """Stop once metric_for_best_model has not improved for `early_stopping_patience`
    evaluations in a row (by more than `early_stopping_threshold`): Hugging Face's."""

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float = 0.0):
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = early_stopping_threshold
        self.early_stopping_patience_counter = 0

    def on_train_begin(
        self, args: Any, state: CallbackState, control: TrainerControl, **kw: Any
    ) -> Any:
        if args.metric_for_best_model is None or args.eval_strategy == "no":
            raise CallbackError(
                "EarlyStoppingCallback needs evaluations ranked by a metric — set "
                'eval_strategy="steps" or "epoch" and metric_for_best_model (e.g. "loss")'
            )

    def on_evaluate(
        self,
        args: Any,
        state: CallbackState,
        control: TrainerControl,
        metrics: dict[str, float] | None = None,
        **kw: Any,
    ) -> Any:
        name = args.metric_for_best_model
        key = name if name.startswith("eval_") else f"eval_{name}"
        value = (metrics or {}).get(key)
        if value is None:
            raise CallbackError(
                f"EarlyStoppingCallback watches {key}, which the evaluation did not report "
                f"(it reported {sorted(metrics or {})}) — set metric_for_best_model to one of them"
            )
        best = state.best_metric
        better = best is None or (
            (value > best if args.greater_is_better else value < best)
            and abs(value - best) > self.early_stopping_threshold
        )
        self.early_stopping_patience_counter = (
            0 if better else self.early_stopping_patience_counter + 1
        )
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            control.should_training_stop = True


class Callbacks:
    """The run's callbacks, the control they share, and the ranks' agreement on both."""

    def __init__(self, callbacks: Iterable[Any] | None, args: Any, world: World) -> None:
        self.callbacks = [c() if isinstance(c, type) else c for c in callbacks or ()]
        self.args = args
        self.world = world
        self.state = CallbackState(
            is_local_process_zero=world.local_rank == 0,
            is_world_process_zero=world.is_main,
            rank=world.rank,
            world_size=world.world_size,
        )
        self.control = TrainerControl()
        self.objects: dict[str, Any] = {}
        """What each event gets as keyword arguments besides its own (model, optimizer, ...)."""
        self.source: Callable[[], dict[str, Any]] = dict
        """The loop's view of its state, copied into `state` before each event."""
        self._failure: str | None = None
        """The first exception a callback raised on this rank, until the ranks agree on it."""

    def listen_to(self, event: str) -> bool:
        """Whether some callback does something on `event`: a method of its own, not the
        base class's no-op (phalanx's TrainerCallback, or transformers')."""
        for callback in self.callbacks:
            method = getattr(callback, event, None)
            function = getattr(method, "__func__", method)
            name = getattr(function, "__qualname__", "")
            if callable(method) and name != f"TrainerCallback.{event}":
                return True
        return False

    def log(self, logs: dict[str, float]) -> None:
        """A log line (training or evaluation): into state.log_history, then on_log."""
        if not self.callbacks:
            return
        view = self.source()
        self.state.log_history.append({**logs, "epoch": view["epoch"], "step": view["global_step"]})
        self.fire("on_log", logs=logs)

    def fire(self, event: str, **extra: Any) -> None:
        """Call `event` on every callback that has it; an exception is held for `agree`."""
        if self._failure is not None or not self.callbacks:
            return  # after a failure this rank stops at the next agreement: no more calls
        for name, value in self.source().items():
            setattr(self.state, name, value)
        for callback in self.callbacks:
            method = getattr(callback, event, None)
            if not callable(method):
                continue
            try:
                result = method(self.args, self.state, self.control, **self.objects, **extra)
            except Exception as exc:
                self._failure = (
                    f"{type(callback).__name__}.{event} raised {type(exc).__name__}: {exc}"
                )
                return
            if result is not None and all(hasattr(result, f) for f in _FLAGS):
                self.control = result

    def agree(self) -> None:
        """Collective (a no-op without callbacks): every rank takes the flags any rank's
        callbacks set, and raises CallbackError if a callback raised on any rank."""
        if not self.callbacks:
            return
        failed = self._failure is not None
        mine = [float(failed)] + [float(getattr(self.control, f)) for f in _FLAGS]
        votes = self.world.all_reduce_sum(mine) if self.world.is_distributed else mine
        if votes[0]:
            raise_on_every_rank(self._error(), self.world.process_group, name_the_rank=False)
        for name, vote in zip(_FLAGS, votes[1:]):
            setattr(self.control, name, bool(vote))

    def _error(self) -> CallbackError | None:
        if self._failure is None:
            return None
        return CallbackError(
            f"a callback failed on rank {self.world.rank} at step {self.state.global_step}: "
            f"{self._failure} — fix the callback (callbacks run on every rank; every rank "
            "stopped here)"
        )
