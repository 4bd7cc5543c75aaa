"""The communication options of TrainingArguments: bad values and combinations are one-line
ConfigurationErrors; local synchronisation weights micro-batches by this rank's own samples."""

from __future__ import annotations

from typing import Any

import pytest

from phalanx.errors import ConfigurationError
from phalanx.train import TrainingArguments
from phalanx.train.batches import loss_weights

REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"ddp_comm_hook": "powersgd", "zero_stage": 2}, "does not work with zero_stage=2"),
    ({"ddp_comm_hook": "bf16", "zero_stage": 3}, "does not work with zero_stage=3"),
    ({"ddp_comm_hook": "zstd"}, "ddp_comm_hook"),
    ({"powersgd_start_iter": 1}, "powersgd_start_iter=1 must be >= 2"),
    ({"powersgd_rank": 0}, "powersgd_rank=0"),
    ({"sync_every": 0}, "sync_every=0"),
    ({"diloco_outer_lr": -1.0}, "diloco_outer_lr=-1.0"),
    ({"sync_method": "gossip"}, "sync_method"),
    ({"sync_method": "local_sgd", "ddp_comm_hook": "fp16"}, "there is no DDP to hook"),
    ({"sync_method": "diloco", "zero_stage": 1}, "sync_method='diloco' does not work with zero"),
    ({"sync_method": "local_sgd", "fp16": True}, "GradScaler"),
    ({"sync_method": "local_sgd", "even_batches": False}, "even_batches=False"),
]


@pytest.mark.parametrize(("options", "message"), REFUSED)
def test_a_wrong_combination_is_a_one_line_configuration_error(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=" — ") as raised:
        TrainingArguments(**options)
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_the_accepted_combinations_and_the_papers_defaults() -> None:
    TrainingArguments(ddp_comm_hook="powersgd", zero_stage=1)
    args = TrainingArguments(sync_method="diloco", bf16=True)
    assert (args.diloco_outer_lr, args.diloco_outer_momentum) == (0.7, 0.9)
    cli = TrainingArguments.from_cli(["--ddp_comm_hook", "PowerSGD", "--sync_every", "4"])
    assert cli.ddp_comm_hook == "powersgd" and cli.sync_every == 4


class _NoCollectives:
    """A two-rank world whose collectives must not be called."""

    is_distributed = True
    world_size = 2

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        raise AssertionError("local weights need no collective")


def test_without_a_reducer_each_rank_weights_by_its_own_samples() -> None:
    weights = loss_weights([3, 1], _NoCollectives(), reduced=False)  # type: ignore[arg-type]
    assert weights == [0.75, 0.25]  # the mean over this rank's 4 samples, not N * n / total
