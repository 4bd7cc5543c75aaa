"""`zero_stage="auto"` / `zero_offload="auto"` in the Trainer: the arguments resolved by a
plan before the strategy is made (the strategy never sees "auto").

Every rank counts the model (the same on each), measures the machine (the
slowest rank's figures are kept) and its budget (the smallest rank's), so every
rank reaches the same plan; rank 0 prints it. Only what the arguments allow is
weighed: each candidate stage and offload is validated as TrainingArguments
first (a ddp_comm_hook, fp16 or torch_compile rules some out), and the global
batch stays per_device_train_batch_size x gradient_accumulation_steps x world.
Planned runs return freed host memory to the kernel (runtime/hostmem.py), which
is what makes their resident memory follow what they hold, as predicted.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from collections.abc import Callable, Sized
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from phalanx.errors import ConfigurationError
from phalanx.runtime import World
from phalanx.runtime.hostmem import return_freed_memory
from phalanx.train.batches import call_model, require_loss, takes_keyword_batch
from phalanx.train.collate import DefaultCollator
from phalanx.train.config.args import TrainingArguments
from phalanx.train.plan.budget import detect_budget
from phalanx.train.plan.choose import Allowed, Choice, choose
from phalanx.train.plan.count import MicroStep, count_model, meta_batch
from phalanx.train.plan.predict import Config
from phalanx.train.plan.probe import measure_rates
from phalanx.train.plan.render import render
from phalanx.train.setup import OPTIMIZERS, optimizer_recipe
from phalanx.train.strategy.choice import OptimizerChoice

__all__ = ["planned_arguments", "resolve"]


def planned_arguments(
    trainer: Any, model: nn.Module, choice: OptimizerChoice
) -> tuple[TrainingArguments, Choice | None]:
    """The Trainer's arguments, "auto" resolved (`resolve`), from its world and data."""
    args, plan = resolve(
        trainer.args,
        trainer.world,
        model,
        trainer.train_dataset,
        trainer.loss_fn,
        trainer.collate_fn,
        choice,
    )
    trainer.report.args = args  # the metric sinks record the settings the run trains with
    return args, plan


def resolve(
    args: TrainingArguments,
    world: World,
    model: nn.Module,
    dataset: Any,
    loss_fn: Callable[..., Any] | None,
    collate_fn: Callable[[list[Any]], Any] | None,
    choice: OptimizerChoice,
) -> tuple[TrainingArguments, Choice | None]:
    """`args` with "auto" replaced by the plan's settings, and the plan (None: nothing was
    "auto"). Collective: every rank calls it."""
    if not args.plans_memory():
        return args, None
    if dataset is None:
        raise ConfigurationError(
            "zero_stage='auto' plans from a micro-batch of the training set — pass "
            "train_dataset to the Trainer, or set zero_stage yourself"
        )
    return_freed_memory()
    allowed = _allowed(args)
    step = trainer_micro_step(dataset, collate_fn, loss_fn)
    # The probe draws random tensors, and a model built on the meta device takes its
    # weights from the generator after this: planned, the run starts where the seed put it
    # (without this, zero_stage="auto" trained other weights than the stage it chose).
    with torch.random.fork_rng(devices=[world.device] if world.device.type == "cuda" else []):
        factory = optimizer_factory(model, args, choice)
        count = count_model(model, step, factory, args.zero3_units)
        disk = any(tier == "disk" for _, tier in allowed)
        rates = measure_rates(world.process_group, _offload_dir(args) if disk else None)
    budget, source = _budget(args, world)
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps
    global_batch *= world.world_size
    cuda = world.device.type == "cuda"
    plan = choose(
        count,
        rates,
        world.world_size,
        global_batch,
        budget,
        source,
        cuda,
        allowed,
        keep_gathered=not args.zero3_reshard_after_forward,
    )
    if world.rank == 0:
        print(f"phalanx plan: {render(plan, world.world_size, global_batch)}", flush=True)
    # The ranks planned from the same figures; rank 0's choice binds all the same (a
    # different stage on one rank would pair different collectives).
    config = Config(**world.broadcast_json(dataclasses.asdict(plan.chosen.config)))
    return _applied(args, config), plan


def _applied(args: TrainingArguments, config: Config) -> TrainingArguments:
    """`args` with the chosen configuration's settings in place of "auto"."""
    return dataclasses.replace(
        args,
        zero_stage=config.stage,  # type: ignore[arg-type]
        zero_offload=None if config.offload == "none" else config.offload,
        zero_offload_fraction=config.fraction if config.offload == "disk" else 1.0,
        zero_offload_dir=args.zero_offload_dir if config.offload == "disk" else None,
        zero_offload_window_mb=config.window_mb
        if config.offload == "disk"
        else args.zero_offload_window_mb,
        per_device_train_batch_size=config.micro_batch,
        gradient_accumulation_steps=config.accumulation,
        memory_budget_mb=None,
    )


def _allowed(args: TrainingArguments) -> Allowed:
    """The (stage, tier) pairs whose arguments pass TrainingArguments' own checks."""
    stages, tiers = args.planned_choices()
    allowed = []
    for stage, tier in itertools.product(stages, tiers):
        try:
            dataclasses.replace(
                args,
                zero_stage=stage,  # type: ignore[arg-type]
                zero_offload=None if tier == "none" else tier,  # type: ignore[arg-type]
                zero_offload_dir=args.zero_offload_dir if tier == "disk" else None,
                memory_budget_mb=None,
            )
        except ConfigurationError:
            continue
        allowed.append((stage, tier))
    return allowed


def _offload_dir(args: TrainingArguments) -> str:
    return args.zero_offload_dir or str(Path(args.output_dir) / "offload")


def _budget(args: TrainingArguments, world: World) -> tuple[float, str]:
    """memory_budget_mb, else the smallest rank's detected budget."""
    if args.memory_budget_mb is not None:
        return args.memory_budget_mb * 2**20, "memory_budget_mb"
    mine = detect_budget(world.device.type, world.local_world_size)
    everyone: list[Any] = world.all_gather_json(list(mine))
    return min((float(b), str(s)) for b, s in everyone)


def trainer_micro_step(
    dataset: Any, collate_fn: Callable[[list[Any]], Any] | None, loss_fn: Callable[..., Any] | None
) -> MicroStep:
    """One micro-batch of the training set's first samples, called and lost as the Trainer's
    step calls it (model(batch) or model(**batch); loss_fn or the model's own loss)."""
    collate = collate_fn or DefaultCollator(None)

    def micro_step(model: nn.Module, n: int) -> torch.Tensor:
        batch = meta_batch(collate(_samples(dataset, n)))
        keyword = takes_keyword_batch(getattr(model, "original", model), batch)
        outputs = call_model(model, batch, keyword)
        return require_loss(outputs, batch, loss_fn).float()

    return micro_step


def _samples(dataset: Any, n: int) -> list[Any]:
    if isinstance(dataset, Sized) and hasattr(dataset, "__getitem__"):
        length = len(dataset)
        return [dataset[i % length] for i in range(n)]
    items = list(itertools.islice(iter(dataset), n))
    return list(itertools.islice(itertools.cycle(items), n)) if items else items


def optimizer_factory(
    model: nn.Module, args: TrainingArguments, choice: OptimizerChoice
) -> Callable[[list[nn.Parameter]], Optimizer]:
    """Builds the optimizer the run would step (the user's class and options, or the
    arguments'), over given parameters: count.py steps it once to weigh its state."""
    if choice.optimizer is not None:
        cls, options = type(choice.optimizer), _options(choice.optimizer)
    elif choice.cls_and_kwargs is not None:
        cls, options = choice.cls_and_kwargs[0], dict(choice.cls_and_kwargs[1])
    else:
        cls, options = OPTIMIZERS[args.optim][0], optimizer_recipe(model, args)[2]
    return lambda params: cls(params, **options)


def _options(optimizer: Optimizer) -> dict[str, Any]:
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}
