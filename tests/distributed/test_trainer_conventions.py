"""The Trainer's calling conventions, said in one line when a script gets them wrong.

The Trainer calls `model(batch)` with the collated batch (a dict whose keys forward
names is spread: `model(**batch)`) and `loss_fn(outputs, batch)` with the whole batch.
A model written as `forward(x, y)`, or a loss_fn that takes the labels, gets a
ConfigurationError at the first step naming the convention and what was passed, on
every rank, instead of a TypeError from deep inside the step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from tests.harness import run_workers


class TwoArguments(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(6, 3)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return nn.functional.cross_entropy(self.net(x), y)


class OneBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(6, 3)

    def forward(self, batch: list[Tensor]) -> Tensor:
        return self.net(batch[0])


def _train(rank: int, world: int, out_dir: str, case: str) -> str:
    from phalanx.errors import ConfigurationError
    from phalanx.train import Trainer, TrainingArguments

    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(32, 6, generator=gen), torch.randint(0, 3, (32,), generator=gen)
    )
    model: nn.Module = TwoArguments() if case == "model" else OneBatch()
    loss_fn: Any = None
    if case == "loss_fn":
        loss_fn = lambda out, labels: nn.functional.cross_entropy(out, labels)  # noqa: E731
    args = TrainingArguments(output_dir=out_dir, max_steps=2, per_device_train_batch_size=4,
                             disable_tqdm=True, ddp_backend="gloo", report_to=[])  # fmt: skip
    trainer = Trainer(model, args, train_dataset=data, loss_fn=loss_fn)
    try:
        trainer.train()
    except ConfigurationError as exc:
        return str(exc)
    finally:
        trainer.close()
    return "trained"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["model", "loss_fn"])
def test_a_slip_of_convention_is_one_line_at_the_first_step(tmp_path: Any, case: str) -> None:
    outs = run_workers(_train, 2, str(tmp_path / case), case, init_pg=False, timeout=90)
    said = [o.value for o in outs]
    assert said[0] == said[1], said  # the same line on every rank
    if case == "model":
        assert said[0].startswith("the first step's model(batch) failed with TypeError: "), said
        assert "missing 1 required positional argument: 'y'" in said[0]
        assert "(a list of 2: tensor[4, 6], tensor[4])" in said[0], said
    else:
        assert said[0].startswith("the first step's loss_fn(outputs, batch) failed with "), said
        assert "the model's outputs (a tensor of shape (4, 3))" in said[0], said
    assert "\n" not in said[0]
