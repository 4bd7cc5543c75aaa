"""One rank of a plan_grid.py run: the Trainer on one model and configuration (or "auto"),
its step times, peak RSS and loss, printed as one RESULT line."""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import plan_grid_models as gm
import torch


def main(config: dict[str, Any]) -> None:
    import phalanx
    from phalanx.runtime.hostmem import return_freed_memory

    return_freed_memory()  # as a planned run does (train/plan/auto.py)
    torch.set_num_threads(1)
    spec = gm.MODELS[config["model"]]
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.build()
    scratch = Path(config["scratch"])
    auto = bool(config.get("auto"))
    extra: dict[str, Any] = (
        {"zero_stage": "auto", "zero_offload": "auto"}
        if auto
        else {
            "zero_stage": config["stage"],
            "zero_offload": config.get("offload"),
        }
    )
    if config.get("offload") == "disk" or auto:
        extra["zero_offload_dir"] = str(scratch / "offload")
    if config.get("offload") == "disk":
        extra |= {
            "zero_offload_fraction": config["fraction"],
            "zero_offload_window_mb": config["window_mb"],
        }
    args = phalanx.TrainingArguments(
        output_dir=str(scratch / "out"),
        overwrite_output_dir=True,
        max_steps=config["steps"],
        per_device_train_batch_size=config["micro"],
        gradient_accumulation_steps=config["accumulation"],
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        **extra,
    )
    trainer = phalanx.Trainer(model=model, args=args, train_dataset=spec.data(), loss_fn=spec.loss)
    times: list[float] = []
    step = trainer.loop._train_step

    def timed(*a: object, **k: object) -> Any:
        start = time.perf_counter()
        out = step(*a, **k)  # type: ignore[arg-type]
        times.append(time.perf_counter() - start)
        return out

    trainer.loop._train_step = timed  # type: ignore[method-assign]
    trainer.train()
    plan = None
    if trainer.plan is not None:
        plan = {
            "chosen": gm.key(trainer.plan.chosen.config),
            "budget_mb": trainer.plan.budget / 2**20,
        }
    result = {
        "rank": int(os.environ["RANK"]),
        "step_s": times,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "loss": trainer.state.loss_sum,
        "plan": plan,
    }
    trainer.close()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
