"""ZeRO optimizer state through torch.distributed.checkpoint: each rank writes its pieces.

The saved structure is the plain optimizer format (phalanx.optim.zero_state)
with every piece-wise tensor as a 1-D DTensor over the flattened parameter,
sharded as phalanx.parallel.sharding cuts it. DCP records where each rank's
piece lies, so loading at another world size reads whatever saved pieces
overlap the new ones, and `dcp_to_torch_save` (or `phalanx consolidate`)
turns the directory into whole tensors without any phalanx code.

Loading builds its destination from the checkpoint's own metadata, not
from the live optimizer: a fresh optimizer has no state yet, and the saved
one may hold state for only some parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from phalanx.errors import CheckpointError
from phalanx.optim.zero_state import SCALAR_KEYS, PieceOptimizer, is_piecewise
from phalanx.parallel.sharding import Piece

# torch.distributed.checkpoint and DTensor are imported where they are used: together
# they cost seconds of CPU at import, in every process, checkpointing sharded or not.
if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor


def _mesh(view: PieceOptimizer) -> DeviceMesh:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(view.group, view.device.type)


def _as_dtensor(local: torch.Tensor, piece: Piece, mesh: DeviceMesh) -> DTensor:
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=torch.Size([piece.numel]), stride=(1,)
    )


def sharded_state_dict(view: PieceOptimizer) -> dict[str, Any]:
    """What `save_sharded` hands DCP: this rank's pieces as DTensors, the scalars, the groups
    and the whole shapes (local work: a background save copies it and writes it later)."""
    mesh = _mesh(view)
    state: dict[str, dict[str, Any]] = {}
    for i, entry in view.optim.state_dict()["state"].items():
        piece = view.pieces[i]
        state[str(i)] = {
            key: _as_dtensor(value, piece, mesh) if is_piecewise(key, value, piece) else value
            for key, value in entry.items()
        }
    groups = {str(g): group for g, group in enumerate(view.plain_groups())}
    # The whole shapes, so a consolidation without the model can restore them.
    shapes = {str(i): list(shape) for i, shape in enumerate(view.shapes)}
    return {"state": state, "param_groups": groups, "shapes": shapes}


def save_sharded(view: PieceOptimizer, directory: Path) -> None:
    """Collective: write this rank's pieces (and, once, the scalars and groups) to `directory`."""
    import torch.distributed.checkpoint as dcp

    dcp.save(sharded_state_dict(view), checkpoint_id=str(directory), process_group=view.group)


def load_sharded(view: PieceOptimizer, directory: Path) -> list[dict[str, Any]]:
    """Collective: read the pieces this rank owns now (any saved world size) and load them.

    Returns the saved param_groups (hyperparameters), which the caller applies to its own.
    """
    from torch.distributed.tensor import DTensor

    from phalanx.runtime import safe_dcp

    mesh = _mesh(view)
    try:
        metadata = safe_dcp.read_metadata(directory).state_dict_metadata
    except CheckpointError:
        raise
    except Exception as exc:  # a missing .metadata file: the checkpoint is unusable
        raise CheckpointError(
            f"{directory} is not a readable torch.distributed.checkpoint directory "
            f"({type(exc).__name__}: {exc}) — resume from an earlier checkpoint"
        ) from exc

    def allocate(fqn: str, meta: TensorStorageMetadata) -> torch.Tensor:
        dtype = meta.properties.dtype
        section, index, key = [*fqn.split(".", 2), "", ""][:3]
        if section == "state" and key not in SCALAR_KEYS and len(meta.size) == 1:
            piece = view.pieces[int(index)]
            if meta.size[0] == piece.numel:
                local = torch.empty(piece.length, dtype=dtype, device=view.device)
                return _as_dtensor(local, piece, mesh)
        return torch.empty(meta.size, dtype=dtype)

    destination = nest(metadata, allocate)
    safe_dcp.load(destination, directory, process_group=view.group)
    state = {
        int(i): {k: v.to_local() if isinstance(v, DTensor) else v for k, v in entry.items()}
        for i, entry in destination.get("state", {}).items()
    }
    groups = [destination["param_groups"][str(g)] for g in range(len(destination["param_groups"]))]
    for group in groups:
        group["params"] = list(group["params"])
    # The pieces are already this rank's: the optimizer takes them as they are.
    view.optim.load_state_dict({"state": state, "param_groups": groups})
    return groups


def nest(
    metadata: dict[str, Any], allocate: Callable[[str, TensorStorageMetadata], torch.Tensor]
) -> dict[str, Any]:
    """A nested destination dict whose flattened keys are exactly the checkpoint's.

    Tensors come from `allocate(fqn, meta)`; other values are placeholders that
    DCP replaces with the saved objects.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    root: dict[str, Any] = {}
    for fqn, meta in metadata.items():
        *path, leaf = fqn.split(".")
        node = root
        for part in path:
            node = node.setdefault(part, {})
        if isinstance(meta, TensorStorageMetadata):
            node[leaf] = allocate(fqn, meta)
        elif isinstance(meta, BytesStorageMetadata):
            node[leaf] = None
    return root
