"""`TrainingArguments`: everything that steers a `Trainer` run, checked before it starts.

One `@dataclass(kw_only=True, slots=True)` with a docstring under each field,
in the order a reader thinks about a run: where it writes, how long it runs,
how batches are built, the optimizer, precision and memory, logging and
saving, then the DDP knobs. `__post_init__` validates every field, so a bad
value fails at once on the laptop instead of an hour into a cluster job.

The annotations are the types: `fields.py` reads them to accept the obvious
spellings, refuse a value of the wrong type or outside a `Literal`, and
build the command-line flags; the checks here are about values and their
combinations only. Loading from the command line, JSON and YAML lives in
`argsio.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypeVar

from phalanx.ddp.module import DEFAULT_BUCKET_CAP_MB
from phalanx.ddp.options import DDPOptions
from phalanx.train.config.args_checks import check_combinations, check_values, resolve_hf_defaults
from phalanx.train.config.fields import Config, check_fields
from phalanx.train.logging.metrics import Reporter
from phalanx.train.nonfinite import NonFiniteAction
from phalanx.train.schedules import ScheduleName

DEFAULT_REPORT_TO: tuple[Reporter, ...] = ("console", "jsonl")
ZeroStage = Literal[0, 1, 2, 3, "auto"]
ZeroOffload = Literal["cpu", "disk", "auto"]
CommHookName = Literal["allreduce", "fp16", "bf16", "powersgd"]
SyncMethod = Literal["ddp", "local_sgd", "diloco"]
FaultTolerance = Literal["restart", "live"]
Strategy = Literal["no", "steps", "epoch"]
SaveStrategy = Literal["no", "steps", "epoch", "best"]
OptimName = Literal["adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "rmsprop"]
_Args = TypeVar("_Args", bound="TrainingArguments")


@dataclass(kw_only=True, slots=True)
class TrainingArguments(Config):
    """What a `Trainer` run does: data, optimizer, precision, logging, checkpoints and DDP.

    Build it in code, or load it with `from_cli()`, `from_json(path)` or
    `from_yaml(path)`; every field is checked when the object is made.
    """

    # ----------------------------------------------------------- where and what
    output_dir: str = "trainer_output"
    """Directory for checkpoints (checkpoint-<step>/) and metric logs; created when needed."""
    overwrite_output_dir: bool = False
    """Let a fresh run (no resume_from_checkpoint) delete the checkpoints already in
    output_dir; without it, finding any is an error that names the newest."""
    seed: int = 42
    """Seeds Python, NumPy and torch on every rank, and the sampler's shuffle."""

    # ----------------------------------------------------------- how long
    num_train_epochs: float = 3.0
    """Passes over the training set; a fraction stops part-way. Ignored when max_steps > 0."""
    max_steps: int = -1
    """Optimizer steps to train for; -1 trains for num_train_epochs instead."""

    # ----------------------------------------------------------- batches
    per_device_train_batch_size: int = 8
    """Samples per micro-batch on each rank; a step sees this x accumulation x world size."""
    per_device_eval_batch_size: int = 8
    """Samples per evaluation batch on each rank."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; only the last one all-reduces (the rest run no_sync)."""
    dataloader_num_workers: int = 0
    """DataLoader worker processes per rank; 0 loads in the training process."""
    dataloader_drop_last: bool = False
    """Drop each rank's last micro-batch of an epoch when it is smaller than the others."""

    # ----------------------------------------------------------- optimizer
    learning_rate: float = 5e-5
    """Peak learning rate of the default AdamW, reached after warmup_steps."""
    weight_decay: float = 0.0
    """AdamW weight decay, applied to matrices only (not to biases and norm weights)."""
    lr_scheduler_type: ScheduleName = "linear"
    """Learning-rate shape after warmup: "constant", "linear" (to 0) or "cosine" (to 0),
    phalanx's own; Hugging Face's others ("constant_with_warmup", "cosine_with_restarts",
    "polynomial", "inverse_sqrt", "cosine_with_min_lr", "warmup_stable_decay") through
    transformers' own get_scheduler (the `hf` extra)."""
    lr_scheduler_kwargs: dict[str, Any] | None = None
    """Extra arguments of the schedule (HF's: e.g. {"num_cycles": 2} for
    cosine_with_restarts, {"power": 2.0} for polynomial)."""
    warmup_steps: float = 0
    """Optimizer steps over which the learning rate rises linearly from 0; a value in
    (0, 1) is a fraction of the run's steps (Hugging Face 5's reading)."""
    warmup_ratio: float = 0.0
    """The warmup as a fraction of the run's steps (used when warmup_steps is 0)."""
    adam_beta1: float = 0.9
    """AdamW's beta1 (the adamw optims only)."""
    adam_beta2: float = 0.999
    """AdamW's beta2 (the adamw optims only)."""
    adam_epsilon: float = 1e-8
    """AdamW's epsilon (the adamw optims only)."""
    optim: OptimName = "adamw_torch"
    """The optimizer the Trainer builds, by Hugging Face's names: "adamw_torch",
    "adamw_torch_fused", "sgd", "adagrad", "rmsprop" (torch's own)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this after the all-reduce; 0 turns clipping off."""

    # ----------------------------------------------------------- precision and memory
    bf16: bool = False
    """Run forward and loss under bfloat16 autocast (CPU and recent GPUs)."""
    fp16: bool = False
    """Run forward and loss under float16 autocast with a GradScaler; needs a CUDA device."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory; calls the model's
    gradient_checkpointing_enable(), so the model must have one."""
    torch_compile: bool = False
    """Compile the model's forward with torch.compile (in place, before DDP wraps it);
    zero_stages 0-2."""
    torch_compile_backend: str = "inductor"
    """torch.compile's backend ("inductor", or "eager" to check the graph alone)."""
    torch_compile_mode: str | None = None
    """torch.compile's mode (None, "reduce-overhead", "max-autotune")."""
    zero_stage: ZeroStage = 0
    """ZeRO sharding over the ranks: 1 shards the optimizer state, 2 also the gradients,
    3 also the parameters (each unit of zero3_units gathered only while it computes);
    checkpoints are then sharded (torch.distributed.checkpoint) and reshard to another
    world size. "auto": the Trainer plans it (phalanx.train.plan, docs/planner.md): the
    fastest stage, micro-batch and accumulation that fit memory_budget_mb, keeping the
    global batch (per_device_train_batch_size x gradient_accumulation_steps x world)."""
    zero3_units: list[str] | None = None
    """Under zero_stage=3, the class names of the modules that become units (e.g. "Block",
    "GPT2Block", "LlamaDecoderLayer"); None takes the model's repeated blocks (the heaviest
    list of modules of one class). The root is always a unit too."""
    zero3_reshard_after_forward: bool = True
    """Under zero_stage=3, free each unit's gathered parameters after its forward and gather
    them again for its backward (FSDP2's reshard_after_forward, its default). False keeps
    them from forward to backward: one gather a step instead of two, for the memory of
    every unit's whole parameters at once (DeepSpeed's stage-3 defaults keep them so on any
    model under 1e9 parameters). The root is never freed after forward either way."""
    zero3_shard_size: int | None = None
    """Under zero_stage=3, HSDP: shard the model over groups of this many ranks (typically
    a host's: its GPUs) and replicate it across the groups, so gathers and reduce-scatters
    stay inside a group and only the reduced gradient shards cross between them; the world
    size must be a multiple of it. Under fault_tolerance="live" a lost rank's shard then
    comes from a replica, with no snapshot kept (docs/reliability.md). None: shard over
    every rank."""
    zero_offload: ZeroOffload | None = None
    """Where ZeRO's sharded state lives when device memory is short: "disk" keeps the
    optimizer state (stages 1-3) and, at stage 3, the sharded parameters and gradients in
    files under zero_offload_dir, the optimizer step streaming them a window at a time;
    "cpu" keeps stage 3's shards in host memory (FSDP2's CPUOffloadPolicy; on a CPU
    device, where they already are, it changes nothing). None: no offload. "auto": the
    Trainer plans it with the stage (none, disk with zero_offload_fraction, or cpu on a
    CUDA device): see zero_stage="auto"."""
    zero_offload_dir: str | None = None
    """The directory for zero_offload="disk" files (a local disk; each process makes its
    own scratch directory in it, removed at exit); None: output_dir/offload."""
    zero_offload_window_mb: float = 64.0
    """How much offloaded state the optimizer step holds in memory at a time."""
    zero_offload_fraction: float = 1.0
    """Under zero_offload="disk", the share of the offloadable state put in files, the rest
    kept in memory: the optimizer state first (the coldest: touched once a step), then at
    stage 3 the shards and their gradients, largest tensors first (docs/zero.md,
    "Fractional offload"). 1: all of it; with Adam at stage 3, 0.5 is the state alone."""
    memory_budget_mb: float | None = None
    """With zero_stage or zero_offload "auto": the memory each rank may use, in MB; None
    detects it (the rank's cgroup limit, else a CUDA device's free memory, else the
    host's free memory shared by its ranks)."""

    # ----------------------------------------------------------- logging, evaluation, saving
    logging_strategy: Strategy = "steps"
    """When to log: "steps" (every logging_steps), "epoch", or "no"."""
    logging_steps: int = 10
    """Log loss, learning rate, throughput and communication wait every this many steps."""
    eval_strategy: Strategy | None = None
    """When to evaluate on eval_dataset: "steps" (every eval_steps), "epoch", or "no";
    None (phalanx's default) is "steps" when eval_steps > 0, else "no"."""
    eval_steps: int = 0
    """Evaluate every this many steps; 0: every logging_steps under eval_strategy="steps",
    else only when you call evaluate()."""
    save_strategy: SaveStrategy = "steps"
    """When to write a checkpoint: "steps" (every save_steps, and at the end), "epoch",
    "best" (each time metric_for_best_model improves), or "no"."""
    save_steps: int = 500
    """Write a checkpoint every this many steps and at the end; 0 never saves."""
    save_async: bool = True
    """Write each checkpoint in the background: at the step boundary every rank copies its
    state to host memory (the loop waits for that alone), a writer thread writes it while
    training goes on, and the checkpoint is renamed into place, with its manifest and the
    save_total_limit rotation, once every rank's part is written; a save due while the
    previous is still writing waits for it (and says so). False: the loop waits for every
    save to reach the disk. Saves are written there and then whatever this says under
    fault_tolerance="live", on a preemption signal, and by Trainer.save_checkpoint()
    (docs/trainer.md, "Background saves")."""
    save_total_limit: int | None = None
    """Keep only the newest this-many checkpoints of the run's own lineage (and the best
    one, with load_best_model_at_end); another branch's, left by a rollback, are never
    deleted (docs/trainer.md, "Rollbacks"); None keeps all of them."""
    load_best_model_at_end: bool = False
    """At the end, load the model of the checkpoint whose evaluation was the best by
    metric_for_best_model (saves and evaluations must then fall on the same steps)."""
    metric_for_best_model: str | None = None
    """The evaluation metric that ranks checkpoints ("eval_" may be left out); None is
    "loss" when load_best_model_at_end is set."""
    greater_is_better: bool | None = None
    """Whether a larger metric_for_best_model is better; None: False for a name ending in
    "loss", else True."""
    resume_from_checkpoint: str | None = None
    """A checkpoint to resume from when train() is called without one (Hugging Face keeps
    this field too); "true" resumes from the newest in output_dir."""
    save_safetensors: bool = False
    """Also write the model in Hugging Face's format into each checkpoint (model.safetensors,
    sharded over 5GB with its index), so from_pretrained(checkpoint-N) works. False (HF's
    default is True): it is a second copy of the weights, since resuming reads phalanx's own;
    any checkpoint can be exported later with `phalanx consolidate --format hf`, and
    `Trainer.save_model(dir)` writes it at the end. Needs pip install 'phalanx[hf]'."""
    remove_unused_columns: bool = True
    """With dict samples and no data collator: drop the columns the model's forward does
    not take before batching (Hugging Face's), so a tokenised dataset's text column is no
    error."""
    report_to: list[Reporter] = field(default_factory=lambda: list(DEFAULT_REPORT_TO))
    """Where metrics go: any of "console", "jsonl", "csv", "tensorboard", "wandb", "mlflow"
    (each tracker through its own client, which must be installed; rank 0 alone logs);
    an empty list, "none" or ["none"] logs nowhere."""
    run_name: str | None = None
    """The run's name in the trackers (wandb, mlflow); None: output_dir's last folder."""
    disable_tqdm: bool = False
    """Hide the progress bar (it is only ever shown on rank 0)."""
    timeline: str | None = None
    """Record a timeline (forward, backward, each bucket's flight, the optimizer step,
    checkpoint saves) and write it at exit to this path as one Chrome trace; None reads
    PHALANX_TIMELINE. See docs/performance.md."""

    # ----------------------------------------------------------- faults
    on_nonfinite_grad: NonFiniteAction = "stop"
    """What a step whose gradient is NaN or infinite does (checked after the all-reduce, before
    the optimizer step): "stop" raises NonFiniteError on every rank, naming the step and the
    ranks whose loss was not finite, with nothing stepped; "skip" skips the step on every rank
    (optimizer and schedule untouched), logs it, and stops after max_consecutive_skips in a
    row; "off" checks nothing. Under fp16 the GradScaler skips such steps itself."""
    max_consecutive_skips: int = 5
    """With on_nonfinite_grad="skip": raise NonFiniteError once this many steps in a row
    were skipped."""
    save_on_signal: bool = True
    """On SIGTERM or Ctrl-C (SIGINT): finish the step in flight, agree across ranks to stop,
    save a checkpoint at that step and exit with 128 + the signal's number; a second Ctrl-C
    stops at once. False leaves both signals as they are (by default SIGTERM kills the
    process at once and Ctrl-C raises KeyboardInterrupt), with nothing saved."""
    replica_check_steps: int = 0
    """Every this many steps, check that every rank holds the same parameters and buffers
    (phalanx.check_replicas: one small all-gather); 0 never checks."""

    # ----------------------------------------------------------- DDP
    ddp_backend: str | None = None
    """torch.distributed backend: "nccl", "gloo", or any other this torch build has;
    None picks nccl with GPUs and gloo without."""
    ddp_timeout: float = 1800.0
    """Seconds a collective may block before the job fails instead of hanging."""
    ddp_find_unused_parameters: bool | None = None
    """Search the graph each step for parameters that got no gradient. None means False:
    the search costs time, and the reducer names any unused parameter if you need it.
    Do not use with gradient_checkpointing."""
    ddp_bucket_cap_mb: float | Literal["auto"] | None = None
    """Size of the gradient buckets all-reduced together, in MiB; None means DDP's 25.
    "auto": measured on the job during its first steps (docs/ddp.md)."""
    even_batches: bool = True
    """accelerate's name. True: the sampler pads so that every rank gets the same number of
    batches. False: no padding; a rank out of batches takes part in the others' remaining
    steps with no batch of its own (phalanx.Join), its optimizer stepping with theirs."""
    ddp_broadcast_buffers: bool | None = None
    """Broadcast rank 0's buffers (e.g. BatchNorm statistics) before each forward.
    None means True, or False with gradient_checkpointing (it must be False with it)."""

    ddp_comm_hook: CommHookName | None = None
    """How DDP's buckets travel (phalanx.comm_hooks): "fp16"/"bf16" halve the bytes,
    "powersgd" sends low-rank factors with error feedback (its state is checkpointed per
    rank), "allreduce" is the default path as a hook; None uses the reducer's own
    all-reduce. Not with zero_stage 2 or 3, nor with sync_method other than "ddp"."""
    powersgd_rank: int = 1
    """With ddp_comm_hook="powersgd": the rank of the low-rank approximation (1 to 4 is typical)."""
    powersgd_start_iter: int = 1000
    """With ddp_comm_hook="powersgd": steps of plain all-reduce before compressing (>= 2)."""

    # ----------------------------------------------------------- synchronisation
    sync_method: SyncMethod = "ddp"
    """How the replicas stay together: "ddp" all-reduces gradients every step; "local_sgd"
    (phalanx.LocalSGD) steps each rank on its own and averages the parameters every
    sync_every steps; "diloco" (phalanx.DiLoCo) makes an outer optimizer step on the
    averaged parameter change every sync_every steps. The last two do not wrap the model in
    DDP; their per-rank state is checkpointed, and the replicas are synced at max_steps."""
    sync_every: int = 8
    """With sync_method "local_sgd" or "diloco": inner optimizer steps between two syncs."""
    diloco_outer_lr: float = 0.7
    """With sync_method="diloco": the outer SGD's learning rate (the paper's 0.7)."""
    diloco_outer_momentum: float = 0.9
    """With sync_method="diloco": the outer SGD's Nesterov momentum (the paper's 0.9)."""

    # ----------------------------------------------------------- faults
    fault_tolerance: FaultTolerance = "restart"
    """What a lost rank costs. "restart": the run stops, and `phalanx launch --max-restarts`
    restarts every rank from the last checkpoint (every step since it is trained again).
    "live" (under `phalanx launch --live-recovery`): the survivors drop the step in flight
    and go on from their memory, the rest of the epoch dealt over them, and a replacement
    joins with a live peer's state; the per-rank batch stays, so each step then averages
    fewer samples. Every stage: 0 (sync_method ddp, local_sgd or diloco), and 1-3, where each
    rank's pieces are covered by parity on its neighbours (`live_snapshot_steps`,
    `live_redundancy`). docs/reliability.md."""
    live_snapshot_steps: int = 10
    """fault_tolerance="live" at zero_stage 1-3: every this many steps each rank writes the
    pieces only it holds to a local file and their parity to its neighbours' memory; a loss
    rolls every rank back to that step (at most this many steps trained again), a
    replacement joining does not."""
    live_redundancy: int = 2
    """fault_tolerance="live" at zero_stage 1-3: each rank's pieces are cut into this many
    chunks, each added into the parity one of its next this-many neighbours keeps: 1/k of
    the pieces in each rank's memory, and any one loss among k+1 neighbouring ranks
    survived (1: a neighbour keeps a whole copy, and two losses apart are survived too)."""

    def __post_init__(self) -> None:
        check_fields(self)  # types from the annotations, before any value check reads them
        if self.ddp_backend is not None:
            self.ddp_backend = self.ddp_backend.strip().lower()
        resolve_hf_defaults(self)
        check_values(self)
        check_combinations(self)

    def plans_memory(self) -> bool:
        """Whether zero_stage or zero_offload is "auto": the Trainer plans them (the strategy
        is made from the plan's arguments, never from these)."""
        return self.zero_stage == "auto" or self.zero_offload == "auto"

    def planned_choices(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The stages and offload tiers ("none", "disk", "cpu") a plan may choose among:
        every one where a setting is "auto", else the one set."""
        stages = (0, 1, 2, 3) if self.zero_stage == "auto" else (int(self.zero_stage),)
        if self.zero_offload == "auto":
            return stages, ("none", "disk", "cpu")
        return stages, (self.zero_offload or "none",)

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (lists copied), fit for JSON and `torch.load(weights_only=True)`."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, list) else value
        return out

    def ddp_options(self) -> DDPOptions:
        """What DistributedDataParallel gets, with the ddp_* fields' None resolved.

        find_unused_parameters: None means False. broadcast_buffers: None means True,
        or False with gradient_checkpointing. bucket_cap_mb: None means DDP's 25.
        """
        broadcast = self.ddp_broadcast_buffers
        cap = self.ddp_bucket_cap_mb
        return DDPOptions(
            bucket_cap_mb=DEFAULT_BUCKET_CAP_MB if cap is None else cap,
            find_unused_parameters=bool(self.ddp_find_unused_parameters),
            broadcast_buffers=not self.gradient_checkpointing if broadcast is None else broadcast,
        )

    @classmethod
    def from_cli(
        cls: type[_Args], argv: list[str] | None = None, defaults: Mapping[str, Any] | None = None
    ) -> _Args:
        """Parse `--field value` flags (booleans as `--bf16` / `--no-bf16`).

        `argv` defaults to sys.argv[1:]; `defaults` are the script's own
        defaults, which the flags override. An unknown flag is an error.
        """
        from phalanx.train.config.argsio import parse_cli

        args, _ = parse_cli(cls, argv, defaults, allow_unknown=False)
        return args

    @classmethod
    def from_cli_known(
        cls: type[_Args], argv: list[str] | None = None, defaults: Mapping[str, Any] | None = None
    ) -> tuple[_Args, list[str]]:
        """Like from_cli, but return the flags it does not know, for the script's own parser."""
        from phalanx.train.config.argsio import parse_cli

        return parse_cli(cls, argv, defaults, allow_unknown=True)

    @classmethod
    def from_json(cls: type[_Args], path: str | Path) -> _Args:
        """Load a JSON object whose keys are field names."""
        from phalanx.train.config.argsio import load_json

        return cls(**load_json(cls, path))

    @classmethod
    def from_yaml(cls: type[_Args], path: str | Path) -> _Args:
        """Load a YAML mapping whose keys are field names (needs PyYAML)."""
        from phalanx.train.config.argsio import load_yaml

        return cls(**load_yaml(cls, path))
