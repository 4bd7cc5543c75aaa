"""A run holds one `World`: every part of a Trainer that asks which rank this is holds the
Trainer's own, so live recovery's `World.rebind` reaches all of them at once.

Found by walking the Trainer's objects (phalanx's own, a few levels down), not by a list
of the parts that hold one: a new part that copies the World fails here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from phalanx.runtime import World
from phalanx.train import Trainer, TrainingArguments


def worlds_in(root: object, depth: int = 4) -> list[tuple[str, World]]:
    """Every World reachable from `root` through phalanx objects' attributes and lists."""
    found: list[tuple[str, World]] = []
    seen: set[int] = set()

    def walk(obj: Any, path: str, left: int) -> None:
        if isinstance(obj, World):  # every holder counts, the same World or not
            found.append((path, obj))
            return
        if id(obj) in seen or left < 0:
            return
        seen.add(id(obj))
        if isinstance(obj, list | tuple):
            for i, item in enumerate(obj):
                walk(item, f"{path}[{i}]", left - 1)
        elif type(obj).__module__.startswith("phalanx") and hasattr(obj, "__dict__"):
            for name, value in vars(obj).items():
                walk(value, f"{path}.{name}", left - 1)

    walk(root, "trainer", depth)
    return found


class _OnFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, batch: list[Tensor]) -> Tensor:
        return self.net(batch[0])


def _xent(outputs: Tensor, batch: list[Tensor]) -> Tensor:
    return nn.functional.cross_entropy(outputs, batch[1])


@pytest.mark.timeout(120)
def test_every_part_of_a_trainer_holds_its_one_world(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _OnFirst()
    data = TensorDataset(torch.randn(32, 6), torch.randint(0, 3, (32,)))
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to=[], disable_tqdm=True, ddp_backend="gloo",
        max_steps=2, save_steps=1, logging_steps=1, per_device_train_batch_size=8,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data, loss_fn=_xent)
    try:
        trainer.train()
        found = worlds_in(trainer)
        assert len(found) >= 5, found  # the report, strategy, callbacks, counters, checkpointer
        copies = [path for path, world in found if world is not trainer.world]
        assert copies == [], f"parts holding a World of their own: {copies}"
    finally:
        trainer.close()


def test_rebind_changes_the_rank_in_place() -> None:
    import torch.distributed as dist

    group = dist.GroupMember.WORLD
    assert group is None  # no group in this test: rebind touches none
    cpu = torch.device("cpu")
    world = World(0, 0, 1, 1, 0, cpu, "gloo", group, "none", None, None)  # type: ignore[arg-type]
    holder = [world]
    world.rebind(2, 3)
    assert (holder[0].rank, holder[0].world_size, holder[0].is_main) == (2, 3, False)
    with pytest.raises(AttributeError):
        world.rank = 1  # type: ignore[misc]  # frozen but for rebind
