"""A Hugging Face TrainingArguments call ported by changing the import: the common fields
are accepted, and each derived value means what it means in transformers' own.

The table of what is the same, what differs and why, and what is refused is
docs/trainer.md's; this holds the "same" rows against transformers itself.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from phalanx.errors import ConfigurationError
from phalanx.train import TrainingArguments
from phalanx.train.schedules import make_scheduler, warmup_steps_for

transformers = pytest.importorskip("transformers")

COMMON: dict[str, Any] = {
    "output_dir": "runs/ported",
    "num_train_epochs": 2.0,
    "max_steps": 100,
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 16,
    "gradient_accumulation_steps": 2,
    "learning_rate": 3e-4,
    "weight_decay": 0.01,
    "lr_scheduler_type": "cosine_with_restarts",
    "lr_scheduler_kwargs": {"num_cycles": 2},
    "warmup_steps": 0.1,
    "max_grad_norm": 0.5,
    "adam_beta1": 0.85,
    "adam_beta2": 0.98,
    "adam_epsilon": 1e-7,
    "logging_strategy": "steps",
    "run_name": "ported",
    "logging_steps": 5,
    "eval_strategy": "steps",
    "save_strategy": "steps",
    "save_steps": 20,
    "save_total_limit": 2,
    "load_best_model_at_end": True,
    "seed": 7,
    "bf16": False,
    "fp16": False,
    "gradient_checkpointing": False,
    "dataloader_num_workers": 0,
    "dataloader_drop_last": True,
    "report_to": "none",
    "optim": "adamw_torch",
    "torch_compile": False,
    "remove_unused_columns": True,
    "disable_tqdm": True,
    "ddp_timeout": 600,
    "ddp_find_unused_parameters": False,
    "ddp_bucket_cap_mb": 25,
    "ddp_broadcast_buffers": False,
    "resume_from_checkpoint": None,
}


def _both() -> tuple[Any, TrainingArguments]:
    return transformers.TrainingArguments(**COMMON), TrainingArguments(**COMMON)


def test_the_common_fields_are_accepted_with_hugging_faces_derived_values() -> None:
    hf, ours = _both()
    assert len(COMMON) >= 30
    assert ours.eval_steps == hf.eval_steps == 5  # eval_steps None/0: logging_steps
    assert ours.metric_for_best_model == hf.metric_for_best_model == "loss"
    assert ours.greater_is_better is hf.greater_is_better is False
    assert ours.report_to == hf.report_to == []
    assert warmup_steps_for(ours.warmup_steps, ours.warmup_ratio, 100) == hf.get_warmup_steps(100)
    same = ("learning_rate", "weight_decay", "max_grad_norm", "save_total_limit", "seed")
    for name in (*same, "adam_beta1", "adam_beta2", "adam_epsilon", "run_name"):
        assert getattr(ours, name) == getattr(hf, name), name


def test_the_schedule_is_transformers_own() -> None:
    hf, ours = _both()

    def lrs(scheduler: Any) -> list[float]:
        out = []
        for _ in range(100):
            out.append(scheduler.get_last_lr()[0])
            scheduler.optimizer.step()
            scheduler.step()
        return out

    def optimizer() -> torch.optim.Optimizer:
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=hf.learning_rate)

    warmup = warmup_steps_for(ours.warmup_steps, ours.warmup_ratio, 100)
    mine = make_scheduler(
        optimizer(), ours.lr_scheduler_type, warmup, 100, ours.lr_scheduler_kwargs
    )
    theirs = transformers.get_scheduler(
        hf.lr_scheduler_type,
        optimizer(),
        num_warmup_steps=hf.get_warmup_steps(100),
        num_training_steps=100,
        scheduler_specific_kwargs=hf.lr_scheduler_kwargs,
    )
    assert lrs(mine) == lrs(theirs)


def test_an_unknown_field_names_the_closest_one() -> None:
    with pytest.raises(ConfigurationError, match="learning_rate"):
        TrainingArguments(learning_rat=1e-3)  # type: ignore[call-arg]
