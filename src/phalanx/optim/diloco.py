"""DiLoCo (Douillard et al., 2023): local steps inside, an outer optimizer across ranks.

Every H inner steps, each rank's *outer gradient* is how far its parameters
moved since the last synchronisation (parameters then minus now). The ranks
average it with one all-reduce, go back to the parameters of the last
synchronisation, and let an outer optimizer step with the averaged outer
gradient: by default SGD with Nesterov momentum, lr 0.7, momentum 0.9, the
paper's choice (torchft ships the same algorithm). With outer lr 1 and no
momentum this is exactly local SGD.

Used like LocalSGD (see local_sgd.py): the unwrapped module, its (inner)
optimizer, no DistributedDataParallel; synchronisation runs from a hook on
the inner optimizer's `step()`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import SGD, Optimizer

from phalanx.errors import ConfigurationError
from phalanx.optim.local_sgd import PeriodicSync, average_coalesced, foreign_tensor

# The paper's outer optimizer (Douillard et al., 2023, section 3).
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9


class DiLoCo(PeriodicSync):
    """Every `sync_every` inner steps, an outer optimizer step on the averaged outer gradient.

    `outer_optimizer` must be built on the module's trainable parameters (the
    same tensors the inner optimizer trains); None builds the paper's
    `SGD(lr=0.7, momentum=0.9, nesterov=True)`.
    """

    def __init__(
        self,
        module: nn.Module,
        inner_optimizer: Optimizer,
        sync_every: int,
        outer_optimizer: Optimizer | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if outer_optimizer is not None:  # before the base class hooks the inner optimizer
            _check_outer(outer_optimizer, inner_optimizer, module)
        super().__init__(module, inner_optimizer, sync_every, process_group)
        if outer_optimizer is None:
            outer_optimizer = SGD(self.params, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
        self.outer_optimizer = outer_optimizer
        self.anchor = [p.detach().clone() for p in self.params]
        """The parameters at the last synchronisation (after the broadcast, at first)."""

    def _synchronise(self) -> None:
        outer_grads = torch._foreach_sub(self.anchor, [p.detach() for p in self.params])
        average_coalesced(outer_grads, self.group, self.stats, self._flats)
        # The outer step starts from the last synchronised point, not from where this
        # rank wandered; the inner gradients are put back afterwards for the caller.
        inner_grads = [p.grad for p in self.params]
        for p, anchor, outer_grad in zip(self.params, self.anchor, outer_grads):
            p.copy_(anchor)
            p.grad = outer_grad
        self.outer_optimizer.step()
        for p, inner_grad in zip(self.params, inner_grads):
            p.grad = inner_grad
        torch._foreach_copy_(self.anchor, [p.detach() for p in self.params])

    def _extra_state(self) -> dict[str, Any]:
        return {
            "anchor": [t.clone() for t in self.anchor],
            "outer_optimizer": self.outer_optimizer.state_dict(),
        }

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        torch._foreach_copy_(self.anchor, list(state["anchor"]))
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])


def _check_outer(outer: Optimizer, inner: Optimizer, module: nn.Module) -> None:
    if outer is inner:
        raise ConfigurationError(
            "DiLoCo got the same optimizer as inner and outer — build a separate outer "
            "optimizer on the same parameters, or pass outer_optimizer=None for the paper's"
        )
    stray = foreign_tensor(outer, [p for p in module.parameters() if p.requires_grad])
    if stray is not None:
        raise ConfigurationError(
            f"DiLoCo's outer optimizer holds a {list(stray.shape)} tensor that is not a "
            "trainable parameter of the module — build it on "
            "[p for p in module.parameters() if p.requires_grad]"
        )
