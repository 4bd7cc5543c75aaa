"""The checks of TrainingArguments' communication fields (ddp_comm_hook, powersgd_*,
sync_method, sync_every, diloco_*): their values, and the combinations that break."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from phalanx.train.config.fields import require

if TYPE_CHECKING:
    from phalanx.train.config.args import TrainingArguments


def check_sync(args: TrainingArguments) -> None:
    require(
        args.powersgd_rank >= 1,
        f"powersgd_rank={args.powersgd_rank} must be >= 1 — 1 to 4 is typical",
    )
    require(
        args.powersgd_start_iter >= 2,
        f"powersgd_start_iter={args.powersgd_start_iter} must be >= 2 — DDP rebuilds its "
        "buckets after the first step, which PowerSGD's memory must not straddle",
    )
    require(
        args.sync_every >= 1,
        f"sync_every={args.sync_every} must be >= 1 — it counts optimizer steps between syncs",
    )
    for name in ("diloco_outer_lr", "diloco_outer_momentum"):
        value = getattr(args, name)
        require(
            math.isfinite(value) and value >= 0,
            f"{name}={value} must be a finite number >= 0 — the paper uses 0.7 and 0.9",
        )


def check_comm_combinations(args: TrainingArguments) -> None:
    """Hooks and local synchronisation replace DDP's all-reduce: refuse what then breaks."""
    hook, method = args.ddp_comm_hook, args.sync_method
    require(
        hook is None or args.zero_stage in (0, 1, "auto"),
        f"ddp_comm_hook={hook!r} does not work with zero_stage={args.zero_stage} — ZeRO "
        "reduce-scatters (stage 2) or shards the model (stage 3) itself; use zero_stage 0 or "
        "1, or drop ddp_comm_hook",
    )
    if method == "ddp":
        return
    refused = [
        (hook is not None, f"ddp_comm_hook={hook!r} (there is no DDP to hook)"),
        (
            args.zero_stage not in (0, "auto"),
            f"zero_stage={args.zero_stage} (its shards need every step's gradients reduced)",
        ),
        (args.fp16, "fp16 (each rank's GradScaler would skip steps on its own)"),
        (not args.even_batches, "even_batches=False (a rank out of data would miss a sync)"),
    ]
    for bad, what in refused:
        require(
            not bad,
            f"sync_method={method!r} does not work with {what} — use sync_method='ddp', or "
            "drop that option",
        )
