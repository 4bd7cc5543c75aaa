"""The Trainer: a data-parallel training loop steered by `TrainingArguments`.

    args = TrainingArguments(output_dir="runs/a", max_steps=1000, gradient_accumulation_steps=4)
    Trainer(model=net, args=args, train_dataset=ds, loss_fn=fn).train(resume_from_checkpoint=True)

Runs on one process under plain `python`, and data-parallel under
`phalanx launch`, torchrun, srun or mpirun. See docs/trainer.md.
"""

from __future__ import annotations

from phalanx.errors import CheckpointError, NonFiniteError, OutputError
from phalanx.train.callbacks import (
    CallbackError,
    CallbackState,
    EarlyStoppingCallback,
    TrainerCallback,
    TrainerControl,
)
from phalanx.train.checkpoint.checkpointer import CheckpointFallbackWarning
from phalanx.train.checkpoint.outputdir import IncompleteSaveWarning
from phalanx.train.checkpoint.stateful import ShardedStateful, Stateful
from phalanx.train.config.args import TrainingArguments
from phalanx.train.evaluation import EvalPrediction
from phalanx.train.stopping import TrainingStopped
from phalanx.train.trainer import Trainer
from phalanx.train.trainer_state import ResumeWarning, TrainOutput

__all__ = [
    "CallbackError",
    "CallbackState",
    "CheckpointError",
    "CheckpointFallbackWarning",
    "EarlyStoppingCallback",
    "EvalPrediction",
    "IncompleteSaveWarning",
    "NonFiniteError",
    "OutputError",
    "ResumeWarning",
    "ShardedStateful",
    "Stateful",
    "TrainOutput",
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainingArguments",
    "TrainingStopped",
]
