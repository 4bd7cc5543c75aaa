"""A Trainer's world: joining it, the model on its device, the optimizer, and letting go."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import SGD, Adagrad, AdamW, RMSprop
from torch.utils.data import DataLoader, Dataset

from phalanx.data.sampler import DistributedSampler
from phalanx.errors import ConfigurationError
from phalanx.offload import (
    CPUOffloadPolicy,
    DiskOffloadPolicy,
    OffloadPolicy,
)
from phalanx.parallel.sync import raise_if_settings_differ
from phalanx.runtime import World, init
from phalanx.train.config.args import TrainingArguments


def join_world(args: TrainingArguments) -> tuple[World, bool]:
    """The job's `World`, and whether this call created its group (then the caller owns it).

    Under any launcher, and as a plain `python train.py` alike: a single
    process gets a real one-rank group, so the loop's collectives need no
    special case. `phalanx.init` validates ddp_backend, naming the fix. A group
    that existed before (the user's, or an earlier Trainer's) is used, not owned.
    """
    created = not (dist.is_available() and dist.is_initialized())
    world = init(backend=args.ddp_backend, timeout=args.ddp_timeout)
    return world, created


# Arguments a rank may set on its own: they shape no collective.
PER_RANK_ARGUMENTS = ("dataloader_num_workers", "disable_tqdm", "report_to", "timeline")


def check_same_arguments(args: TrainingArguments, world: World) -> None:
    """Collective: the same TrainingArguments on every rank, or one line on every rank naming
    the first that differs and each rank's value. Ranks that differ in zero_stage or
    ddp_bucket_cap_mb would issue different collectives and abort in gloo (or hang in NCCL)."""
    if not world.is_distributed:
        return
    mine = {k: v for k, v in args.to_dict().items() if k not in PER_RANK_ARGUMENTS}
    everyone: list[Any] = world.all_gather_json(mine)
    raise_if_settings_differ(everyone, "TrainingArguments")


def _check_precision(args: TrainingArguments, device: torch.device) -> None:
    if args.fp16 and device.type != "cuda":
        raise ConfigurationError(
            f"fp16 needs a CUDA device (its loss scaling is GPU-only here), but this run is "
            f"on {device} — use bf16=True on CPU, or run on GPUs"
        )
    if args.bf16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigurationError(
            "bf16 is not supported by this GPU — use fp16=True, or a GPU with bfloat16 "
            "(Ampere or newer)"
        )


def prepare_device_model(model: nn.Module, args: TrainingArguments, world: World) -> nn.Module:
    """What every strategy does first: check the precision fits the device, turn on gradient
    checkpointing if asked, and compile if asked (the strategy then places the model)."""
    _check_precision(args, world.device)
    if args.gradient_checkpointing:
        _enable_gradient_checkpointing(model)
    if args.torch_compile:
        # In place, before any wrapper: DDP's hooks sit on the parameters, outside the graph.
        model.compile(backend=args.torch_compile_backend, mode=args.torch_compile_mode)
    return model


def _enable_gradient_checkpointing(model: nn.Module) -> None:
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if not callable(enable):
        raise ConfigurationError(
            f"gradient_checkpointing=True but {type(model).__name__} has no "
            "gradient_checkpointing_enable() method — add one that wraps your blocks in "
            "torch.utils.checkpoint.checkpoint(..., use_reentrant=False), or turn "
            "gradient_checkpointing off"
        )
    try:
        accepts_kwargs = "gradient_checkpointing_kwargs" in inspect.signature(enable).parameters
    except (TypeError, ValueError):
        accepts_kwargs = False
    if accepts_kwargs:
        # Non-reentrant checkpointing runs one backward, so each gradient hook fires
        # once, as DDP's reducer requires; the reentrant kind runs nested backwards.
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        enable()


def optimizer_recipe(
    model: nn.Module, args: TrainingArguments
) -> tuple[Any, list[dict[str, Any]], dict[str, Any]]:
    """`args.optim`'s class, the two parameter groups, and its settings: weight decay on
    matrices only, since decaying biases and norm gains hurts (the strategy builds it)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ConfigurationError(
            "the model has no trainable parameter — unfreeze some (requires_grad=True)"
        )
    # Under stage 3 the parameters are DTensors: dim() is the whole parameter's.
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    cls, defaults = OPTIMIZERS[args.optim]
    settings = {"lr": args.learning_rate, **defaults}
    if cls is AdamW:
        settings.update(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    return cls, [g for g in groups if g["params"]], settings


# TrainingArguments.optim, by Hugging Face's names: torch's own optimizers, all elementwise
# (what ZeRO's sharding needs: each element's update reads only its own state).
OPTIMIZERS: dict[str, tuple[Any, dict[str, Any]]] = {  # (an Optimizer class, its extras)
    "adamw_torch": (AdamW, {}),
    "adamw_torch_fused": (AdamW, {"fused": True}),
    "sgd": (SGD, {}),
    "adagrad": (Adagrad, {}),
    "rmsprop": (RMSprop, {}),
}


def offload_policy(args: TrainingArguments) -> OffloadPolicy | None:
    """zero_offload as a policy: "disk" under zero_offload_dir (default output_dir/offload;
    this process's scratch directory is made now, so an unwritable one fails before any
    step, in words naming zero_offload_dir), "cpu" FSDP2's CPUOffloadPolicy."""
    if args.zero_offload == "disk":
        path = args.zero_offload_dir or str(Path(args.output_dir) / "offload")
        policy = DiskOffloadPolicy(
            path=path,
            window_mb=args.zero_offload_window_mb,
            fraction=args.zero_offload_fraction,
        )
        policy.files("zero_offload_dir")
        return policy
    if args.zero_offload == "cpu":
        return CPUOffloadPolicy()
    return None


def train_loader(
    dataset: Dataset[Any],
    sampler: DistributedSampler,
    args: TrainingArguments,
    collate_fn: Callable[[list[Any]], Any] | None,
    generator: torch.Generator,
) -> DataLoader[Any]:
    """This rank's micro-batches; an epoch with none of them is an error naming the fix."""
    loader: DataLoader[Any] = DataLoader(
        dataset,
        batch_size=args.per_device_train_batch_size,
        sampler=sampler,
        num_workers=args.dataloader_num_workers,
        collate_fn=collate_fn,
        drop_last=args.dataloader_drop_last,
        generator=generator,
    )
    if len(loader) == 0:
        raise ConfigurationError(
            f"the training set ({len(sampler)} samples for this rank) gives no "
            f"micro-batch of {args.per_device_train_batch_size} — lower "
            "per_device_train_batch_size or set dataloader_drop_last=False"
        )
    return loader
