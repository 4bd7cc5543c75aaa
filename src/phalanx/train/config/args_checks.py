"""The checks of TrainingArguments' values and of their combinations: one line each
saying what is wrong and what to pass instead, raised at construction, before any
process group exists (the communication fields' own checks: comm_checks.py)."""

from __future__ import annotations

import importlib.util
import math
from typing import TYPE_CHECKING

from phalanx.train.config.comm_checks import check_comm_combinations, check_sync
from phalanx.train.config.fields import require

if TYPE_CHECKING:
    from phalanx.train.config.args import TrainingArguments


def resolve_hf_defaults(args: TrainingArguments) -> None:
    """The defaults Hugging Face derives from other fields, resolved once so that every
    reader (the loop, callbacks written for HF) sees plain values."""
    if args.eval_strategy is None:
        args.eval_strategy = "steps" if args.eval_steps > 0 else "no"
    if args.eval_strategy == "steps" and args.eval_steps == 0:
        args.eval_steps = args.logging_steps
    wants_best = args.load_best_model_at_end or args.save_strategy == "best"
    if wants_best and args.metric_for_best_model is None:
        args.metric_for_best_model = "loss"
    if args.metric_for_best_model is not None and args.greater_is_better is None:
        args.greater_is_better = not args.metric_for_best_model.endswith("loss")


def check_values(args: TrainingArguments) -> None:
    _check_run_length(args)
    _check_batches(args)
    _check_even_batches(args)
    _check_optimizer(args)
    _check_reporting(args)
    _check_strategies(args)
    _check_compile(args)
    _check_ddp(args)
    _check_zero(args)
    check_sync(args)


def _check_run_length(args: TrainingArguments) -> None:
    require(args.output_dir.strip() != "", "output_dir is empty — name a directory to write to")
    require(
        0 <= args.seed < 2**32,
        f"seed={args.seed} is outside [0, 2**32) — NumPy cannot take it; pick a smaller seed",
    )
    require(
        math.isfinite(args.num_train_epochs) and args.num_train_epochs > 0,
        f"num_train_epochs={args.num_train_epochs} must be > 0 — pass how many passes over "
        "the data to make, or set max_steps",
    )
    require(
        args.max_steps == -1 or args.max_steps > 0,
        f"max_steps={args.max_steps} trains nothing — pass a positive number of optimizer "
        "steps, or -1 to train for num_train_epochs",
    )


def _check_strategies(args: TrainingArguments) -> None:
    """Hugging Face's rules for evaluation, saving and the best model, in one line each."""
    require(
        args.warmup_steps >= 0 and (args.warmup_steps < 1 or args.warmup_steps.is_integer()),
        f"warmup_steps={args.warmup_steps} must be a whole number of steps, or a fraction in "
        "(0, 1) of the run's steps",
    )
    require(
        0 <= args.warmup_ratio < 1,
        f"warmup_ratio={args.warmup_ratio} must be in [0, 1) — it is a fraction of the steps",
    )
    if args.eval_strategy == "no" and args.save_strategy == "best":
        require(
            False,
            'save_strategy="best" saves when an evaluation improves, but '
            'eval_strategy="no" — set eval_strategy="steps" or "epoch"',
        )
    if not args.load_best_model_at_end:
        return
    require(
        args.eval_strategy != "no",
        'load_best_model_at_end needs evaluations to rank checkpoints, but eval_strategy="no" '
        '— set eval_strategy="steps" (with eval_steps) or "epoch"',
    )
    require(
        args.save_strategy in (args.eval_strategy, "best"),
        f"load_best_model_at_end needs a checkpoint at every evaluation, but save_strategy="
        f"{args.save_strategy!r} and eval_strategy={args.eval_strategy!r} — give them the "
        'same value, or save_strategy="best"',
    )
    if args.save_strategy == "steps":
        require(
            args.save_steps > 0 and args.save_steps % args.eval_steps == 0,
            f"load_best_model_at_end needs each save to follow an evaluation, but save_steps="
            f"{args.save_steps} is not a multiple of eval_steps={args.eval_steps} — make it one",
        )


def _check_compile(args: TrainingArguments) -> None:
    require(
        not (args.torch_compile and args.zero_stage == 3),  # "auto" plans around it
        "torch_compile with zero_stage=3 is not supported: stage 3's gathers run in forward "
        "hooks a compiled graph would capture — leave torch_compile off at stage 3 (stages "
        "0-2 compile)",
    )


def _check_batches(args: TrainingArguments) -> None:
    for name in (
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
    ):
        require(
            getattr(args, name) >= 1,
            f"{name}={getattr(args, name)} must be >= 1 — it counts samples (or micro-batches)",
        )
    require(
        args.dataloader_num_workers >= 0,
        f"dataloader_num_workers={args.dataloader_num_workers} must be >= 0 — 0 loads batches "
        "in the training process",
    )


def _check_even_batches(args: TrainingArguments) -> None:
    require(
        args.even_batches or args.zero_stage in (0, 1, "auto"),
        f"even_batches=False with zero_stage={args.zero_stage}: a rank out of batches holds "
        "no full gradients to shard — use even_batches=True (padding), or zero_stage 0 or 1",
    )


def _check_optimizer(args: TrainingArguments) -> None:
    for name in ("learning_rate", "weight_decay", "max_grad_norm"):
        value = getattr(args, name)
        require(
            math.isfinite(value) and value >= 0,
            f"{name}={value} must be a finite number >= 0 — pass 0 or more"
            + (" (0 turns clipping off)" if name == "max_grad_norm" else ""),
        )
    require(
        args.warmup_steps >= 0,
        f"warmup_steps={args.warmup_steps} must be >= 0 — 0 starts at the full learning rate",
    )


def _check_reporting(args: TrainingArguments) -> None:
    require(
        args.logging_steps >= 1,
        f"logging_steps={args.logging_steps} must be >= 1 — it is how many steps lie "
        "between two log lines",
    )
    for name in ("eval_steps", "save_steps"):
        require(
            getattr(args, name) >= 0,
            f"{name}={getattr(args, name)} must be >= 0 — 0 turns it off",
        )
    require(
        args.max_consecutive_skips >= 1,
        f"max_consecutive_skips={args.max_consecutive_skips} must be >= 1 — it is how many "
        "non-finite steps in a row are skipped before the run stops",
    )
    require(
        args.replica_check_steps >= 0,
        f"replica_check_steps={args.replica_check_steps} must be >= 0 — 0 turns it off",
    )
    limit = args.save_total_limit
    require(
        limit is None or limit >= 1,
        f"save_total_limit={limit} would delete every checkpoint — pass >= 1, or None to keep all",
    )
    if args.save_safetensors:
        missing = [m for m in ("safetensors", "huggingface_hub") if not importlib.util.find_spec(m)]
        require(
            not missing,
            f"save_safetensors=True needs the {' and '.join(missing)} package, which is not "
            "installed — pip install 'phalanx[hf]', or pass save_safetensors=False",
        )
    for tracker, package in (("wandb", "wandb"), ("mlflow", "mlflow")):
        require(
            tracker not in args.report_to or importlib.util.find_spec(package) is not None,
            f'report_to includes "{tracker}" but its client is not installed — pip install '
            f"{'wandb' if tracker == 'wandb' else 'mlflow-skinny'}, or drop it from report_to",
        )
    if "tensorboard" in args.report_to:
        require(
            importlib.util.find_spec("tensorboard") is not None,
            'report_to includes "tensorboard" but the tensorboard package is not installed — '
            "pip install tensorboard, or drop it from report_to",
        )


def _check_ddp(args: TrainingArguments) -> None:
    require(
        args.ddp_backend is None or args.ddp_backend != "",
        "ddp_backend is empty — name a backend such as 'gloo' or 'nccl', or pass None",
    )
    require(
        math.isfinite(args.ddp_timeout) and args.ddp_timeout > 0,
        f"ddp_timeout={args.ddp_timeout} must be a finite number of seconds > 0 — it bounds how "
        "long a collective may block before the job fails instead of hanging (default 1800)",
    )
    cap = args.ddp_bucket_cap_mb
    require(
        cap is None or cap == "auto" or (math.isfinite(cap) and cap > 0),
        f"ddp_bucket_cap_mb={cap} must be > 0 MiB — the default is 25",
    )


def _check_zero(args: TrainingArguments) -> None:
    """ZeRO's settings: each one means something only with the stage or tier it names."""
    budget = args.memory_budget_mb
    require(
        budget is None or (math.isfinite(budget) and budget > 0),
        f"memory_budget_mb={budget} must be > 0 MB — what each rank may use, or None to detect it",
    )
    require(
        budget is None or args.plans_memory(),
        "memory_budget_mb is what zero_stage='auto' / zero_offload='auto' plan within — set "
        "one of them to 'auto', or drop memory_budget_mb",
    )
    _check_stage3(args)
    _check_offload(args)


def _check_stage3(args: TrainingArguments) -> None:
    """The settings of stage 3's units and shards: none means anything below stage 3."""
    require(
        args.zero3_units is None or args.zero_stage in (3, "auto"),
        f"zero3_units={args.zero3_units} only means something with zero_stage=3 — set "
        "zero_stage=3, or drop zero3_units",
    )
    require(
        args.zero3_reshard_after_forward or args.zero_stage in (3, "auto"),
        "zero3_reshard_after_forward=False only means something with zero_stage=3 (the "
        "stage that gathers parameters) — set zero_stage=3, or drop it",
    )
    size = args.zero3_shard_size
    require(
        size is None or args.zero_stage == 3,
        f"zero3_shard_size={size} is HSDP's shard group, which only zero_stage=3 has — set "
        "zero_stage=3, or drop zero3_shard_size",
    )
    require(
        size is None or size >= 1,
        f"zero3_shard_size={size} must be >= 1 — the ranks each copy of the model is "
        "sharded over (e.g. the GPUs per host)",
    )


def _check_offload(args: TrainingArguments) -> None:
    """Offload's settings: each one means something only with the tier it names."""
    require(
        args.zero_offload is None or args.zero_stage != 0,
        f"zero_offload={args.zero_offload!r} offloads ZeRO's sharded state, and zero_stage=0 "
        "shards nothing — set zero_stage to 1, 2 or 3 (3 offloads the parameters too)",
    )
    require(
        args.zero_offload != "cpu" or args.zero_stage in (3, "auto"),
        f"zero_offload='cpu' moves stage 3's shards to host memory; at zero_stage="
        f"{args.zero_stage} use zero_offload='disk' (the optimizer state in files), or "
        "zero_stage=3",
    )
    require(
        args.zero_offload_dir is None or args.zero_offload in ("disk", "auto"),
        "zero_offload_dir is where zero_offload='disk' writes — set zero_offload='disk', "
        "or drop zero_offload_dir",
    )
    require(
        args.zero_offload_window_mb > 0,
        f"zero_offload_window_mb={args.zero_offload_window_mb} must be > 0 — it is how much "
        "offloaded state the optimizer step holds at a time (e.g. 64)",
    )
    fraction = args.zero_offload_fraction
    require(
        0.0 <= fraction <= 1.0,
        f"zero_offload_fraction={fraction} must be in [0, 1] — the share of the offloadable "
        "state kept in files (1: all of it)",
    )
    require(
        fraction == 1.0 or args.zero_offload == "disk",
        f"zero_offload_fraction={fraction} is the share zero_offload='disk' puts in files — "
        "set zero_offload='disk', or drop zero_offload_fraction",
    )


def check_combinations(args: TrainingArguments) -> None:
    """The documents' warnings, made errors: each combination gives wrong results or crashes."""
    check_comm_combinations(args)
    require(
        args.fault_tolerance != "live" or args.ddp_comm_hook is None,
        f'fault_tolerance="live" does not work with ddp_comm_hook={args.ddp_comm_hook!r} — a '
        "hook's futures cannot be abandoned when a peer is lost; drop the hook, or use "
        'fault_tolerance="restart"',
    )
    require(
        args.live_snapshot_steps >= 1,
        f"live_snapshot_steps={args.live_snapshot_steps} must be >= 1 — it is how many steps "
        "apart live recovery snapshots each rank's pieces (e.g. 10)",
    )
    require(
        args.live_redundancy >= 1,
        f"live_redundancy={args.live_redundancy} must be >= 1 — it is how many neighbours "
        "share the parity of each rank's pieces (1: a whole copy on one; 2, the default, "
        "half a copy on each of two)",
    )
    require(
        args.fault_tolerance != "live" or args.even_batches,
        'fault_tolerance="live" does not work with even_batches=False — the rest of an epoch '
        "is dealt evenly over the survivors; leave even_batches at True",
    )
    require(
        not (args.bf16 and args.fp16),
        "bf16 and fp16 are both set — choose one precision (bf16 needs no loss scaling)",
    )
    require(
        not (args.fp16 and args.zero_stage not in (0, "auto")),
        f"fp16 does not work with zero_stage={args.zero_stage} — the GradScaler unscales and "
        "checks whole gradients, which ZeRO cuts between ranks; use bf16=True (no loss scaling)",
    )
    if not args.gradient_checkpointing:
        return
    require(
        args.ddp_find_unused_parameters is not True,
        "ddp_find_unused_parameters=True does not work with gradient_checkpointing — "
        "checkpointing drops activations and recomputes them in backward, so the graph "
        "searched after forward is not the one backward runs, and parameters get marked "
        "ready twice; leave ddp_find_unused_parameters unset",
    )
    require(
        args.ddp_broadcast_buffers is not True,
        "ddp_broadcast_buffers=True does not work with gradient_checkpointing — the "
        "broadcast rewrites buffers in place between forward and the recomputation in "
        "backward, which then sees different values; leave ddp_broadcast_buffers unset",
    )
