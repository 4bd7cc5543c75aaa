"""`Trainer`: the data-parallel training loop, so you do not write it by hand.

It joins the job through `phalanx.init` (under any launcher, or as plain
`python train.py`: then a one-rank group, destroyed again on `close()`), wraps
the model in phalanx's DistributedDataParallel when there is more than one
rank, and shards the data with phalanx's DistributedSampler. A step is
`gradient_accumulation_steps` micro-batches, all but the last under
`no_sync()`, so gradients are all-reduced once per step; then clip,
optimizer step, scheduler step. Logging, evaluation and checkpoints happen
between steps, on every rank together.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, Dataset

from phalanx.data.sampler import DistributedSampler
from phalanx.ddp.module import DistributedDataParallel
from phalanx.diagnostics import progress
from phalanx.errors import ConfigurationError
from phalanx.train import resume
from phalanx.train.args import TrainingArguments
from phalanx.train.batches import (
    LossFn,
    batch_size,
    call_model,
    require_loss,
    takes_keyword_batch,
    to_device,
)
from phalanx.train.checkpoint import remove_torn
from phalanx.train.evaluation import ComputeMetrics, EvalSetup, evaluate_model
from phalanx.train.metrics import MetricsSink, forget_after, make_sinks
from phalanx.train.progress import Progress, StepWindow
from phalanx.train.resume import Stateful, TrainState
from phalanx.train.rng import restore_rng_state, seed_everything
from phalanx.train.schedules import make_scheduler
from phalanx.train.setup import build_optimizer, join_world, prepare_model, release, wrap_model

logger = logging.getLogger("phalanx.train")


@dataclass(frozen=True)
class TrainOutput:
    """What `Trainer.train()` returns."""

    global_step: int
    train_loss: float
    """Loss of the last optimizer step, averaged over its micro-batches and all ranks."""
    mean_train_loss: float
    """Mean step loss over the steps this call trained (NaN if it trained none)."""
    samples_per_second: float
    """Training samples over all ranks per second of this call's loop."""
    runtime_s: float
    resumed_from: str | None


class Trainer:
    """Train `model` on `train_dataset` as `args` says; see docs/trainer.md."""

    def __init__(
        self,
        model: nn.Module,
        args: TrainingArguments | None = None,
        train_dataset: Dataset[Any] | None = None,
        eval_dataset: Dataset[Any] | None = None,
        loss_fn: LossFn | None = None,
        optimizer: Optimizer | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        compute_metrics: ComputeMetrics | None = None,
    ) -> None:
        self.args = args if args is not None else TrainingArguments()
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.loss_fn = loss_fn
        self.collate_fn = collate_fn
        self.compute_metrics = compute_metrics
        self.state = TrainState()
        self._sinks: list[MetricsSink] | None = None
        self._progress: Progress | None = None
        self._keyword: bool | None = None
        self.sampler: DistributedSampler | None = None
        self.world, self._owns_group = join_world(self.args)
        """Rank, world size, device, and the group: one of one rank for a plain process."""
        self._closed = False
        try:
            self._setup_model(model, optimizer)
            if train_dataset is not None:
                self._setup_training(train_dataset)
        except BaseException:
            self.close()  # a Trainer that could not be made must not keep its group
            raise

    # ------------------------------------------------------------------ setup
    def _setup_model(self, model: nn.Module, optimizer: Optimizer | None) -> None:
        self.model: nn.Module = prepare_model(model, self.args, self.world.device)
        """The unwrapped module: what you save, export, or evaluate yourself."""
        self.wrapped_model: nn.Module = wrap_model(self.model, self.args, self.world)
        """What the loop calls: phalanx DDP with more than one rank, else the model itself."""
        self.optimizer = (
            optimizer if optimizer is not None else build_optimizer(self.model, self.args)
        )
        self.scaler = torch.amp.GradScaler("cuda") if self.args.fp16 else None

    def _setup_training(self, dataset: Dataset[Any]) -> None:
        args = self.args
        self.sampler = DistributedSampler(
            dataset,
            num_replicas=self.world.world_size,
            rank=self.world.rank,
            shuffle=True,
            seed=args.seed,
        )
        # Its own generator: making an iterator must not draw from the global RNG,
        # or a resumed run (which makes one mid-epoch) would shift the dropout masks.
        self._loader_generator = torch.Generator()
        self.train_loader: DataLoader[Any] = DataLoader(
            dataset,
            batch_size=args.per_device_train_batch_size,
            sampler=self.sampler,
            num_workers=args.dataloader_num_workers,
            collate_fn=self.collate_fn,
            drop_last=args.dataloader_drop_last,
            generator=self._loader_generator,
        )
        self.micro_batches_per_epoch = len(self.train_loader)
        if self.micro_batches_per_epoch == 0:
            raise ConfigurationError(
                f"the training set ({len(self.sampler)} samples for this rank) gives no "
                f"micro-batch of {args.per_device_train_batch_size} — lower "
                "per_device_train_batch_size or set dataloader_drop_last=False"
            )
        steps_per_epoch = math.ceil(self.micro_batches_per_epoch / args.gradient_accumulation_steps)
        self.max_steps = (
            args.max_steps
            if args.max_steps > 0
            else math.ceil(args.num_train_epochs * steps_per_epoch)
        )
        self.scheduler = make_scheduler(
            self.optimizer, args.lr_scheduler_type, args.warmup_steps, self.max_steps
        )

    def _stateful(self) -> Stateful:
        assert self.sampler is not None
        return Stateful(self.model, self.optimizer, self.scheduler, self.scaler, self.sampler)

    def _autocast(self) -> AbstractContextManager[Any]:
        if not (self.args.bf16 or self.args.fp16):
            return nullcontext()
        dtype = torch.bfloat16 if self.args.bf16 else torch.float16
        return torch.autocast(self.world.device.type, dtype=dtype)

    # ------------------------------------------------------------------ train
    def train(self, resume_from_checkpoint: bool | str | Path | None = None) -> TrainOutput:
        """Train to max_steps (or num_train_epochs), resuming from a checkpoint if asked.

        `resume_from_checkpoint=True` picks the newest valid checkpoint in
        output_dir (falling back past corrupt ones with a warning) and starts
        afresh when there is none yet; a path resumes from exactly that one.
        """
        self._check_open()
        if self.train_dataset is None:
            raise ConfigurationError("train() needs a train_dataset — pass one to the Trainer")
        seed_everything(self.args.seed)
        self.state = TrainState()
        resumed_from, rng = self._maybe_resume(resume_from_checkpoint)
        self._open_outputs(resumed=resumed_from is not None)
        if rng is not None:
            restore_rng_state(rng)  # last, so nothing above can shift the dropout masks
        try:
            window = self._loop()
        finally:
            self._close_outputs()
        return self._output(window, resumed_from)

    def _maybe_resume(
        self, resume_from: bool | str | Path | None
    ) -> tuple[str | None, dict[str, Any] | None]:
        if resume_from is None or resume_from is False:
            return None, None
        path = resume.choose(resume_from, Path(self.args.output_dir), self.world)
        if path is None:
            if self.world.is_main:
                logger.info("no checkpoint in %s yet: starting from step 0", self.args.output_dir)
            return None, None
        self.state, rng = resume.restore(path, self._stateful(), self.args, self.world)
        if self.world.is_main:
            logger.info("resumed from %s at step %d", path, self.state.global_step)
        return str(path), rng

    def _open_outputs(self, resumed: bool) -> None:
        if self.world.is_main:
            output_dir = Path(self.args.output_dir)
            remove_torn(output_dir)
            forget_after(output_dir, self.state.global_step if resumed else 0)
            self._progress = Progress(self.max_steps, self.state.global_step, self.args)
            self._sinks = make_sinks(self.args.report_to, output_dir, self._progress.write)

    def _close_outputs(self) -> None:
        for sink in self._sinks or []:
            sink.close()
        if self._progress is not None:
            self._progress.close()
        self._sinks, self._progress = None, None

    def _loop(self) -> StepWindow:
        run = StepWindow(self._comm_wait())
        window = StepWindow(self._comm_wait())
        while self.state.global_step < self.max_steps:
            finished_epoch = self._train_epoch(run, window)
            if finished_epoch:
                self.state.epoch += 1
                self.state.batches_done = 0
        if window.steps:
            self._log(window)
        return run

    def _epoch_batches(self) -> Iterator[Any]:
        assert self.sampler is not None
        self.sampler.set_epoch(self.state.epoch)
        self._loader_generator.manual_seed(self.args.seed + self.state.epoch)
        return iter(self.train_loader)

    def _train_epoch(self, run: StepWindow, window: StepWindow) -> bool:
        """Train from the current position to the end of the epoch or max_steps."""
        accumulation = self.args.gradient_accumulation_steps
        losses: list[Tensor] = []
        for batch in self._epoch_batches():
            micro = self.state.batches_done
            first = micro - micro % accumulation
            in_step = min(accumulation, self.micro_batches_per_epoch - first)
            last = micro + 1 == first + in_step
            losses.append(self._micro_step(batch, 1.0 / in_step, sync=last))
            self.state.batches_done += 1
            for tracker in (run, window):
                tracker.add_samples(batch_size(batch))
            if last:
                self._finish_step(torch.stack(losses).mean(), run, window)
                losses = []
                if self.state.global_step >= self.max_steps:
                    return False
        return True

    def _micro_step(self, batch: Any, scale: float, sync: bool) -> Tensor:
        batch = to_device(batch, self.world.device)
        if self._keyword is None:
            self._keyword = takes_keyword_batch(self.model, batch)
        skip_sync = not sync and isinstance(self.wrapped_model, DistributedDataParallel)
        with self.wrapped_model.no_sync() if skip_sync else nullcontext():  # type: ignore[operator]
            with self._autocast():
                outputs = call_model(self.wrapped_model, batch, self._keyword)
                loss = require_loss(outputs, batch, self.loss_fn)
            scaled = loss.float() * scale
            if self.scaler is not None:
                scaled = self.scaler.scale(scaled)
            scaled.backward()
        return loss.detach().float()

    def _finish_step(self, loss: Tensor, run: StepWindow, window: StepWindow) -> None:
        grad_norm = self._optimizer_step()
        self.state.global_step += 1
        progress.step(self.state.global_step + 1)
        for tracker in (run, window):
            tracker.add_step(loss, grad_norm)
        if self._progress is not None:
            self._progress.advance()
        step, args = self.state.global_step, self.args
        if step % args.logging_steps == 0:
            self._log(window)
        if args.eval_steps and step % args.eval_steps == 0:
            self.evaluate()
        if args.save_steps and (step % args.save_steps == 0 or step == self.max_steps):
            self.save_checkpoint()

    def _optimizer_step(self) -> Tensor | None:
        """Clip after the all-reduce (the gradients are then the same everywhere), then step."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = None
        if self.args.max_grad_norm > 0:
            params = [p for p in self.model.parameters() if p.grad is not None]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.args.max_grad_norm)
        stepped = True
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            stepped = self.scaler.get_scale() >= scale  # a lowered scale means inf/NaN: skipped
        else:
            self.optimizer.step()
        if stepped:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    # ---------------------------------------------------------------- logging
    def _comm_wait(self) -> float:
        if isinstance(self.wrapped_model, DistributedDataParallel):
            return self.wrapped_model.reducer.stats.comm_wait_s
        return 0.0

    def _log(self, window: StepWindow) -> None:
        """Reduce the window over ranks (every rank calls this), log it on rank 0, reset it."""
        reduced = window.reduce(self.world, self._comm_wait())
        metrics = {k: v for k, v in reduced.items() if k not in ("last_loss", "window_s")}
        metrics["lr"] = float(self.scheduler.get_last_lr()[0])
        metrics["epoch"] = self.state.epoch + self.state.batches_done / self.micro_batches_per_epoch
        self._emit(metrics)
        window.reset(self._comm_wait())

    def _emit(self, metrics: dict[str, float]) -> None:
        if self._progress is not None and "loss" in metrics:
            self._progress.show_loss(metrics["loss"])
        for sink in self._sinks or []:
            sink.log(self.state.global_step, metrics)

    def _output(self, run: StepWindow, resumed_from: str | None) -> TrainOutput:
        summary = run.reduce(self.world, self._comm_wait())
        return TrainOutput(
            global_step=self.state.global_step,
            train_loss=summary.get("last_loss", math.nan),
            mean_train_loss=summary.get("loss", math.nan),
            samples_per_second=summary.get("samples_per_second", 0.0),
            runtime_s=summary.get("window_s", 0.0),
            resumed_from=resumed_from,
        )

    def close(self) -> None:
        """Let go of the process group; the Trainer cannot train or evaluate afterwards.

        Unhooks DDP from the model (`trainer.model` stays usable) and destroys
        the group if this Trainer created it. At interpreter exit the group is
        torn down by the hook `phalanx.init()` registers; call this to release
        it earlier.
        """
        if self._closed:
            return
        self._closed = True
        # A constructor that failed half-way (a bad model) may have no wrapped model yet.
        wrapped = self.__dict__.get("wrapped_model")
        if wrapped is not None:
            self.wrapped_model = self.model
        release(wrapped, self._owns_group)

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigurationError(
                "this Trainer was closed and has let go of the process group — make a new one"
            )

    # ------------------------------------------------------ evaluate and save
    def evaluate(self, eval_dataset: Dataset[Any] | None = None) -> dict[str, float]:
        """eval_loss over the whole eval set (each sample once) plus compute_metrics' results.

        Every rank must call it; every rank gets the same dict.
        """
        self._check_open()
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ConfigurationError("evaluate() needs an eval_dataset — pass one to the Trainer")
        setup = EvalSetup(
            world=self.world,
            batch_size=self.args.per_device_eval_batch_size,
            num_workers=self.args.dataloader_num_workers,
            collate_fn=self.collate_fn,
            loss_fn=self.loss_fn,
            autocast=self._autocast,
        )
        metrics = evaluate_model(self.model, dataset, setup, self.compute_metrics)
        self._emit(metrics)
        return metrics

    def save_checkpoint(self) -> Path:
        """Write output_dir/checkpoint-<step>/ now (every rank must call it)."""
        self._check_open()
        if self.sampler is None:
            raise ConfigurationError("save_checkpoint() needs a train_dataset — pass one")
        path = resume.save(self._stateful(), self.state, self.args, self.world)
        if self.world.is_main:
            logger.info("saved %s", path)
        return path
