"""A Trainer's world: joining it, the model on its device, the optimizer, and letting go."""

from __future__ import annotations

import inspect
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import AdamW, Optimizer

from phalanx.ddp.module import DistributedDataParallel
from phalanx.errors import ConfigurationError
from phalanx.jobenv import launched_by_launcher
from phalanx.train.args import TrainingArguments
from phalanx.train.ranks import Ranks


def join_world(args: TrainingArguments) -> Ranks:
    """DDP when a launcher started us (or a group exists already); else one plain process.

    A plain `python train.py` sets up no process group at all: nothing to
    rendezvous with, nothing to tear down, and errors point at the model.
    """
    if launched_by_launcher() or (dist.is_available() and dist.is_initialized()):
        from phalanx.runtime import init  # the runtime validates ddp_backend, naming the fix

        world = init(backend=args.ddp_backend, timeout=args.ddp_timeout)
        ranks = Ranks(world.rank, world.world_size, world.device, world.process_group)
    else:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        ranks = Ranks(0, 1, device, None)
    _check_precision(args, ranks.device)
    return ranks


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


def prepare_model(model: nn.Module, args: TrainingArguments, device: torch.device) -> nn.Module:
    """Turn on gradient checkpointing if asked, and move the model to this rank's device."""
    if args.gradient_checkpointing:
        _enable_gradient_checkpointing(model)
    return model.to(device)


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


def build_optimizer(model: nn.Module, args: TrainingArguments) -> Optimizer:
    """AdamW; weight decay on matrices only, since decaying biases and norm gains hurts."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ConfigurationError(
            "the model has no trainable parameter — unfreeze some (requires_grad=True)"
        )
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return AdamW([g for g in groups if g["params"]], lr=args.learning_rate)


def wrap_model(model: nn.Module, args: TrainingArguments, ranks: Ranks) -> nn.Module:
    """phalanx DDP with the arguments' DDP options, or the model itself on one plain process."""
    if not ranks.distributed:
        return model
    # A model wrapped before (by an earlier Trainer) is unhooked from that wrapper by DDP itself.
    return DistributedDataParallel(
        model,
        device_ids=[ranks.device] if ranks.device.type == "cuda" else None,
        process_group=ranks.group,
        **asdict(args.ddp_options()),
    )


def release(wrapped: nn.Module | None, owns_group: bool) -> None:
    """Unhook DDP from the model, and destroy the process group if we created it.

    The model outlives the Trainer (`trainer.model`): left hooked, its
    parameters would keep reporting gradients to a reducer nobody drives.
    """
    if isinstance(wrapped, DistributedDataParallel):
        wrapped.reducer.remove_hooks()
    if owns_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
