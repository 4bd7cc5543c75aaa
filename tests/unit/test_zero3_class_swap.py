"""fully_shard's class swap: one FSDP<Class> per user class, a subclass its own."""

from __future__ import annotations

from torch import nn

from phalanx.zero3.module import FSDPModule, swap_class


class Block(nn.Linear):
    pass


class WideBlock(Block):
    pass


def test_one_sharded_class_per_user_class_and_none_inherited() -> None:
    a, b, wide = Block(2, 2), Block(3, 3), WideBlock(2, 2)
    swap_class(a)
    swap_class(wide)  # before b: a subclass swapped must not hand its class to the parent
    swap_class(b)
    assert type(a) is type(b) and type(a).__name__ == "FSDPBlock"
    assert type(wide).__name__ == "FSDPWideBlock" and type(wide) is not type(a)
    assert isinstance(wide, FSDPModule) and isinstance(wide, WideBlock)
    assert type(a).__mro__[1:3] == (FSDPModule, Block)
