"""The reducer's private torch calls: run a callback when the outermost backward ends,
and ask whether a profiler is recording.

torch 2.13 has no public way to run code when a backward pass ends. torch's own
DDP reducer and FSDP2 use the engine's `queue_callback`, and so do we: it is as
stable as they are. It queues on the graph task running *now*. Inside a
reentrant backward (`checkpoint(..., use_reentrant=True)` starts one from its
node's backward) that is the nested task, which ends before the outer backward
has produced the gradients of the layers outside the checkpoint. So the
callback is queued from the backward that computes the gradient of the
wrapped module's *outputs*: whatever nests inside it, that is the outermost
backward through this forward. torch's DDP reaches the same task through its
`_DDPSink` node on the outputs; a hook on the output tensors does it without
wrapping (or cloning) them.

A `record_function` span costs about 60 µs at the end of a backward here (enter
and exit, their code cold after the backward's kernels) even with no profiler
running; `profiled` opens one only when a profiler records.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import Variable

from phalanx.runtime.nested import iter_tensors


class EndOfBackward:
    """Calls `callback` once, when the backward through a watched forward ends."""

    __slots__ = ("_callback", "_queued")

    def __init__(self, callback: Callable[[], None]) -> None:
        self._callback = callback
        self._queued = False

    def watch(self, outputs: Any) -> None:
        """After a forward: queue the callback from the backward that reaches `outputs`.

        Leaves are skipped: a hook on a leaf (a parameter returned as it is)
        would stay on it for good, and its backward queues through `queue` anyway.
        """
        for tensor in iter_tensors(outputs):
            if tensor.requires_grad and tensor.grad_fn is not None:
                tensor.register_hook(self._on_output_grad)

    @property
    def queued(self) -> bool:
        """Whether the callback waits for the backward running now to end."""
        return self._queued

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        self.queue()

    def queue(self) -> None:
        """Queue the callback on the backward running now, unless it is queued already.

        The outputs' hooks call this first. The reducer calls it too when a
        gradient arrives, for a backward that does not pass through the outputs
        (a parameter used outside forward); there the task running now is the
        only one there is.
        """
        if not self._queued:
            self._queued = True
            Variable._execution_engine.queue_callback(self._run)

    def _run(self) -> None:
        self._queued = False
        self._callback()


def profiled(name: str) -> contextlib.AbstractContextManager[Any]:
    """A `torch.profiler.record_function(name)` span when a profiler records, else nothing."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
