"""The Trainer: a data-parallel training loop steered by `TrainingArguments`.

    args = TrainingArguments(output_dir="runs/a", max_steps=1000, gradient_accumulation_steps=4)
    Trainer(model=net, args=args, train_dataset=ds, loss_fn=fn).train(resume_from_checkpoint=True)

Runs on one process under plain `python`, and data-parallel under
`phalanx launch`, torchrun, srun or mpirun. See docs/trainer.md.
"""

from __future__ import annotations

from phalanx.errors import CheckpointError
from phalanx.train.args import TrainingArguments
from phalanx.train.evaluation import EvalPrediction
from phalanx.train.resume import CheckpointFallbackWarning
from phalanx.train.trainer import Trainer, TrainOutput

__all__ = [
    "CheckpointError",
    "CheckpointFallbackWarning",
    "EvalPrediction",
    "TrainOutput",
    "Trainer",
    "TrainingArguments",
]
