"""A fully_shard model's (and its optimizer's) state, through torch's own state-dict tools.

The parameters are DTensors, so torch.distributed.checkpoint's `state_dict`
functions give every form: sharded (what DCP saves from every rank and
reshards at load) and full (whole tensors). These helpers name the forms the
Trainer and `phalanx consolidate` use; any FSDP2 script can call torch's
directly instead. The optimizer's full form here is the plain optimizer's
(state keyed by parameter index, in param_groups order), so a plain model's
optimizer loads it.

Every read of a DCP directory goes through phalanx.runtime.safe_dcp. A stage-3
directory written before parameters were DTensors (flat 1-D pieces, a
"shapes" entry) is refused with the bridge named: `phalanx consolidate`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from phalanx.errors import CheckpointError
from phalanx.offload.streamed import streamer_of

# torch.distributed.checkpoint is imported where it is used: it costs seconds of CPU at
# import, in every process, sharded or not.


def _options(full: bool, cpu_offload: bool = False) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=cpu_offload)


def full_state_dict(model: nn.Module, to: int = 0) -> dict[str, Any] | None:
    """Collective: the plain model's state_dict (whole tensors, on the CPU) on rank `to`."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=_options(full=True, cpu_offload=to == 0))
    if dist.get_rank() != to:
        return None
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def load_full_state_dict(model: nn.Module, state_dict: dict[str, Any]) -> None:
    """Load the plain model's state_dict (whole tensors, on every rank): each keeps its shard."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state_dict, options=_options(full=True))


def plain_optimizer_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (torch's `get_optimizer_state_dict`) in
    the plain optimizer's form: parameter indices in param_groups order."""
    index: dict[str, int] = {}
    groups = []
    for group in state_dict["param_groups"]:
        names = list(group["params"])
        plain = {k: v for k, v in group.items() if k != "params"}
        plain["params"] = [index.setdefault(n, len(index)) for n in names]
        groups.append(plain)
    state = {index[name]: entry for name, entry in state_dict["state"].items() if name in index}
    return {"state": state, "param_groups": groups}


def full_optimizer_state_dict(
    model: nn.Module, optim: Optimizer, to: int = 0
) -> dict[str, Any] | None:
    """Collective: the plain optimizer's state_dict (whole tensors) on rank `to`."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optim, options=_options(full=True, cpu_offload=to == 0))
    if dist.get_rank() != to:
        return None
    return plain_optimizer_state(state)


def model_state_to_save(model: nn.Module) -> dict[str, Any]:
    """What `save_model_sharded` hands DCP: {"model": its sharded state dict} (local work)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {"model": get_model_state_dict(model)}


def save_model_sharded(model: nn.Module, directory: Path) -> None:
    """Collective: every rank writes its shards (and rank 0 the replicated rest) with DCP."""
    import torch.distributed.checkpoint as dcp

    dcp.save(model_state_to_save(model), checkpoint_id=str(directory))


def load_model_sharded(model: nn.Module, directory: Path) -> None:
    """Collective: read this rank's shards, whatever world size wrote them."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from phalanx.runtime import safe_dcp

    _refuse_flat_pieces(directory)
    state = {"model": get_model_state_dict(model)}
    safe_dcp.load(state, directory)
    set_model_state_dict(model, state["model"])


def optimizer_state_to_save(model: nn.Module, optim: Optimizer) -> dict[str, Any]:
    """What `save_optimizer_sharded` hands DCP: {"optimizer": its sharded state dict}."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return {"optimizer": get_optimizer_state_dict(model, optim)}


def save_optimizer_sharded(model: nn.Module, optim: Optimizer, directory: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(optimizer_state_to_save(model, optim), checkpoint_id=str(directory))


def load_optimizer_sharded(model: nn.Module, optim: Optimizer, directory: Path) -> None:
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from phalanx.runtime import safe_dcp

    _refuse_flat_pieces(directory)
    streamer = streamer_of(optim)
    if streamer is not None:  # offloaded: its state made in files, a window at a time
        streamer.init_state(optim)
    state = {"optimizer": get_optimizer_state_dict(model, optim)}
    safe_dcp.load(state, directory)
    set_optimizer_state_dict(model, optim, state["optimizer"])


def _refuse_flat_pieces(directory: Path) -> None:
    """A stage-3 entry from before DTensor parameters: 1-D pieces and their shapes."""
    from phalanx.runtime import safe_dcp

    keys = safe_dcp.read_metadata(directory).state_dict_metadata
    if any(key.startswith("shapes.") for key in keys):
        checkpoint = directory.parent
        raise CheckpointError(
            f"{checkpoint} was written by an older phalanx, whose stage 3 saved flat 1-D "
            "pieces — convert it with `phalanx consolidate "
            f"{checkpoint} OUT.pt` and load OUT.pt's model into your model before training"
        )
