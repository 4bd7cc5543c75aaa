"""What the training loop has really used of a sampler's indices: a DataLoader reads ahead,
so the indices handed out are not the samples trained on (data/sampler.py's state_dict)."""

from __future__ import annotations

import sys
from types import FrameType

from torch.utils.data.dataloader import _BaseDataLoaderIter

from phalanx.errors import ConfigurationError

__all__ = ["ConsumedBatches", "drawn_by_loader_with_workers"]


class ConsumedBatches:
    """The batches of one pass that the training loop has received, counted as it receives them.

    A DataLoader hands the loop batches in the order it drew their indices
    (`in_order=True`, torch's default), each `batch_size` indices but the last;
    so after k batches the loop has used `min(k * batch_size, drawn)` of the
    indices drawn this pass, however far the workers have read ahead.
    """

    def __init__(self, batch_size: int | None, uncountable: str | None = None) -> None:
        self.batches = 0
        self.batch_size = batch_size
        self.uncountable = uncountable
        """Why batches cannot be turned into samples here, if they cannot."""

    def position(self, start: int, drawn: int) -> int:
        if self.uncountable is not None or self.batch_size is None:
            raise ConfigurationError(
                f"state_dict() cannot count the samples the loop used: {self.uncountable} — "
                "pass state_dict(consumed=samples_used)"
            )
        return min(start + self.batches * self.batch_size, drawn)


# A torch DataLoader iterator draws our indices a few calls up the stack (through its
# batch sampler); this many frames is ample, and a miss only skips the guard.
_FRAMES_TO_SEARCH = 12


def drawn_by_loader_with_workers() -> bool:
    """Whether a torch DataLoader iterator with worker processes is drawing our indices.

    Its workers fetch `prefetch_factor` batches each ahead of the loop, so the
    indices handed out overstate what the loop used. The iterator class is
    torch's, found on the stack: a guard against a silent skip on resume.
    """
    frame: FrameType | None = sys._getframe(2)
    for _ in range(_FRAMES_TO_SEARCH):
        if frame is None:
            return False
        owner = frame.f_locals.get("self")
        if isinstance(owner, _BaseDataLoaderIter):
            return int(getattr(owner, "_num_workers", 0)) > 0
        frame = frame.f_back
    return False
