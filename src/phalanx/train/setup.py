"""A Trainer's world: joining it, the model on its device, the optimizer, and letting go."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import SGD, Adagrad, AdamW, Optimizer, RMSprop
from torch.utils.data import DataLoader, Dataset

from phalanx import zero3
from phalanx.data.sampler import DistributedSampler
from phalanx.ddp.module import DistributedDataParallel
from phalanx.ddp.sync import raise_if_settings_differ
from phalanx.diagnostics.timeline import Timeline
from phalanx.errors import ConfigurationError
from phalanx.offload import (
    CPUOffloadPolicy,
    DiskOffloadPolicy,
    OffloadPolicy,
    offload_optimizer,
    shared_files,
    streamer_of,
)
from phalanx.optim.zero import ZeroRedundancyOptimizer
from phalanx.runtime import World, init, shutdown
from phalanx.runtime.hostmem import return_freed_memory
from phalanx.train.args import TrainingArguments
from phalanx.zero3.meta_init import has_meta_tensors, materialize


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
    everyone: list[Any] = [None] * world.world_size
    dist.all_gather_object(everyone, mine, group=world.process_group)
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


def prepare_model(model: nn.Module, args: TrainingArguments, world: World) -> nn.Module:
    """Check the precision fits the device, turn on gradient checkpointing if asked, and
    move the model to this rank's device. At stage 3 or under offload, host memory freed
    goes back to the kernel (runtime/hostmem.py).

    A model built on the meta device is given rank 0's initial values here, whole,
    below stage 3; at stage 3 it stays meta until `wrap_model` has sharded it, so
    that each rank only ever holds its shards (zero3/meta_init.py).
    """
    _check_precision(args, world.device)
    if args.zero_stage == 3 or args.zero_offload is not None:
        return_freed_memory()  # the point of these runs is less host memory: see hostmem.py
    if args.gradient_checkpointing:
        _enable_gradient_checkpointing(model)
    if args.torch_compile:
        # In place, before any wrapper: DDP's hooks sit on the parameters, outside the graph.
        model.compile(backend=args.torch_compile_backend, mode=args.torch_compile_mode)
    if has_meta_tensors(model):
        if args.zero_stage == 3:
            return model  # fully_shard moves what is not meta to the device
        materialize(model, world.device, group=world.process_group)
    return model.to(world.device)


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


def build_optimizer(model: nn.Module, args: TrainingArguments, world: World) -> Optimizer:
    """AdamW (or `args.optim`); weight decay on matrices only, since decaying biases and
    norm gains hurts.

    Under ZeRO the same two groups go to a ZeroRedundancyOptimizer over AdamW,
    built after the model is wrapped (stage 2 hooks the wrapper's reducer). A
    world of one runs it too, with one shard: its checkpoints then have the
    sharded layout, so a one-process run and a many-rank run resume each
    other's. Stage 2 there is stage 1: with no reducer there is nothing to
    reduce-scatter, and the single shard is the whole gradient.
    """
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
    groups = [g for g in groups if g["params"]]
    disk = offload_policy(args)
    disk = disk if isinstance(disk, DiskOffloadPolicy) else None
    cls, defaults = OPTIMIZERS[args.optim]
    if cls is AdamW:
        defaults = {
            **defaults,
            "betas": (args.adam_beta1, args.adam_beta2),
            "eps": args.adam_epsilon,
        }
    if args.zero_stage in (0, 3):  # stage 3's optimizer steps the model's DTensor shards
        optimizer = cls(groups, lr=args.learning_rate, **defaults)
        return optimizer if disk is None else offload_optimizer(optimizer, disk)
    return ZeroRedundancyOptimizer(
        groups,
        cls,
        process_group=world.process_group,
        shard_gradients=args.zero_stage == 2 and world.is_distributed,
        offload_policy=disk,
        lr=args.learning_rate,
        **defaults,
    )


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
        rank = dist.get_rank() if dist.is_initialized() else 0
        shared_files(path, rank, "zero_offload_dir")
        return DiskOffloadPolicy(path=path, window_mb=args.zero_offload_window_mb)
    if args.zero_offload == "cpu":
        return CPUOffloadPolicy()
    return None


def check_user_optimizer(optimizer: Optimizer, args: TrainingArguments) -> None:
    """Refuse the optimizers the Trainer cannot drive: it builds ZeRO itself, after wrapping."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        raise ConfigurationError(
            "the Trainer builds ZeroRedundancyOptimizer itself, after it wraps the model "
            "(stage 2 must hook that wrapper) — pass zero_stage=1 or 2 instead of "
            "optimizer=ZeroRedundancyOptimizer(...)"
        )
    if args.zero_stage == 3:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not all(zero3.is_sharded(p) for p in params):
            raise ConfigurationError(
                "zero_stage=3 shards the model, so an optimizer built over its whole "
                "parameters steps tensors the model no longer uses — shard the model first "
                "(phalanx.zero3.shard_model) and build the optimizer over model.parameters(), "
                "or drop optimizer= and let the Trainer build AdamW"
            )
        return
    if args.zero_stage in (1, 2):
        raise ConfigurationError(
            f"zero_stage={args.zero_stage} shards the AdamW the Trainer builds, so it cannot "
            f"take your {type(optimizer).__name__} — drop optimizer= (and set learning_rate "
            "and weight_decay), or keep your optimizer with zero_stage=0"
        )


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


def wrap_model(model: nn.Module, args: TrainingArguments, world: World) -> nn.Module:
    """phalanx DDP with the arguments' DDP options, or the model itself in a world of one
    or under a local sync_method.

    Under zero_stage=3 the model is sharded in place instead (its units, then the
    root; in a world of one too, so checkpoints have one layout whatever the size)
    unless it arrives sharded already, and the loop calls it as it is.
    """
    if args.zero_stage == 3:
        if zero3.unit_of(model) is None:
            policy = zero3.by_class_names(args.zero3_units) if args.zero3_units else None
            zero3.shard_model(model, policy, offload_policy=offload_policy(args))
        if has_meta_tensors(model):
            materialize(model, world.device, group=world.process_group)
        return model
    if not world.is_distributed or args.sync_method != "ddp":
        # One rank has nothing to all-reduce; local SGD / DiLoCo sync parameters themselves.
        return model
    # A model wrapped before (by an earlier Trainer) is unhooked from that wrapper by DDP itself.
    return DistributedDataParallel(
        model,
        device_ids=[world.device] if world.device.type == "cuda" else None,
        process_group=world.process_group,
        **asdict(args.ddp_options()),
    )


def record_offload_to(optimizer: Optimizer, timeline: Timeline | None) -> None:
    """Put the offloaded optimizer's reads and writes on the timeline's "io" track."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local one
    streamer = streamer_of(inner) if isinstance(inner, Optimizer) else None
    if streamer is not None:
        streamer.timeline = timeline


def _release_offload(optimizer: Optimizer | None) -> None:
    """Finish the offloaded optimizer's writes and remove its scratch directory (the model's
    offloaded shards stay readable: their files are unlinked, not unmapped)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local one
    streamer = streamer_of(inner) if isinstance(inner, Optimizer) else None
    if streamer is not None:
        streamer.close()
        streamer.files.close()


def release(wrapped: nn.Module | None, owns_group: bool, optimizer: Optimizer | None) -> None:
    """Unhook DDP from the model, remove the optimizer's offload scratch directory, and
    destroy the process group if we created it.

    The model outlives the Trainer (`trainer.model`): left hooked, its
    parameters would keep reporting gradients to a reducer nobody drives.
    """
    _release_offload(optimizer)
    if isinstance(wrapped, DistributedDataParallel):
        wrapped.reducer.remove_hooks()
    if owns_group:
        shutdown()
