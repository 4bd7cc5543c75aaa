"""The Trainer's side of Hugging Face's format: what each checkpoint records, and save_model.

Every checkpoint of a `transformers` `PreTrainedModel` holds the files
`from_pretrained` needs beside the weights — `config.json` and
`generation_config.json`, written by their own `save_pretrained` (with
`architectures` and `dtype` set as the model's `save_pretrained` sets them)
— and `hf_tied.json`, the tied copies to leave out of the safetensors.
They are a few KB, so any checkpoint can be exported later with
`phalanx consolidate --format hf`. `save_safetensors=True` also writes the
weights into each checkpoint; `Trainer.save_model(dir)` writes the model
alone, in that format, wherever asked (docs/trainer.md, "Hugging Face's
format").
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from phalanx.errors import CheckpointError, PhalanxError
from phalanx.runtime import World
from phalanx.train.checkpoint import hf_export

if TYPE_CHECKING:
    from phalanx.train.config.args import TrainingArguments


def is_transformers_model(model: nn.Module) -> bool:
    """A `transformers.PreTrainedModel` (transformers is not imported for anything else)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def tied_copies(model: nn.Module) -> dict[str, str]:
    """{state-dict key left out: the key kept} for a transformers model's tied tensors.

    transformers' rule (`save_pretrained`): of the names one tensor is held
    under, sorted, those matching a `_tied_weights_keys` pattern of their
    module are left out, keeping one; `from_pretrained` ties them back. A
    group the model does not declare is kept whole (written under each name).
    Called on the model as the user gave it, before any sharding: ties are
    tensor identities there, on the CPU or the meta device alike.
    """
    if not is_transformers_model(model):
        return {}
    patterns = [
        f"{prefix}.{key}" if prefix else key
        for prefix, module in model.named_modules()
        for key in (getattr(module, "_tied_weights_keys", None) or ())
    ]
    names_of: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names_of.setdefault(id(tensor), []).append(name)
    left_out: dict[str, str] = {}
    for names in (sorted(group) for group in names_of.values() if len(group) > 1):
        dropped = [n for n in names if any(re.search(p, n) for p in patterns)][: len(names) - 1]
        kept = next(n for n in names if n not in dropped)
        left_out.update(dict.fromkeys(dropped, kept))
    return left_out


def hf_notes(model: nn.Module) -> dict[str, bytes]:
    """config.json and generation_config.json of a transformers model, as the bytes their
    save_pretrained writes; nothing for any other module."""
    if not is_transformers_model(model):
        return {}
    config: Any = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    config.dtype = str(dtype).removeprefix("torch.")
    notes: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="phalanx-hf-") as scratch:
        config.save_pretrained(scratch)
        generation = getattr(model, "generation_config", None)
        if generation is not None and model.can_generate():  # type: ignore[operator]
            generation.save_pretrained(scratch)
        for path in sorted(Path(scratch).iterdir()):
            notes[path.name] = path.read_bytes()
    return notes


def checkpoint_notes(model: nn.Module, tied: dict[str, str]) -> dict[str, bytes]:
    """What a checkpoint records for a later export: hf_notes and hf_tied.json."""
    notes = hf_notes(model)
    if notes:
        notes[hf_export.TIED_NOTE] = json.dumps(tied, indent=1, sort_keys=True).encode()
    return notes


def derived_weights(
    args: TrainingArguments, tied: dict[str, str]
) -> Callable[[Path, Mapping[str, str]], None] | None:
    """With save_safetensors, what the Checkpointer runs on rank 0 once the entries are in
    the staging directory: the weights in HF's format, read back from the model's entry a
    weight file at a time (so at stage 3 never whole)."""
    if not args.save_safetensors:
        return None

    def write(staging: Path, placements: Mapping[str, str]) -> None:
        from phalanx.train.checkpoint.consolidate import model_source

        source = model_source(staging, placements.get("model"))
        hf_export.write_hf(source, staging, hf_export.DEFAULT_MAX_SHARD_SIZE, tied)

    return write


def save_model(
    model: nn.Module,
    world: World,
    out: Path,
    tied: dict[str, str],
    sharded: bool,
    max_shard_size: int | str = hf_export.DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Collective: `model` in HF's format into the directory `out` (rank 0 writes).

    Unsharded, rank 0 writes its own replica. At stage 3 every rank first writes
    its shards with DCP into the staging directory (on a file system every rank
    sees, as checkpoints need), and rank 0 turns them into the weight files one
    at a time: no rank ever holds the model whole.
    """
    error: PhalanxError | None = None
    staging: Path | None = None
    if world.is_main:
        try:
            hf_export.require_hf_libraries()
            staging = hf_export.staging_beside(out)
        except PhalanxError as exc:
            error = exc
    world.barrier_or_raise(error)
    staging = Path(world.broadcast_json(None if staging is None else str(staging)))
    if sharded:
        from phalanx import zero3

        _together(world, staging, out, lambda: zero3.save_model_sharded(model, staging / "dcp"))
    notes = hf_notes(model)

    def write() -> None:
        if sharded:
            source: hf_export.Source = hf_export.DcpSource(staging / "dcp")
        else:
            source = hf_export.StateDictSource(model.state_dict())
        hf_export.write_hf(source, staging, max_shard_size, tied, notes)
        if sharded:
            shutil.rmtree(staging / "dcp")
        hf_export.publish(staging, out)

    _together(world, staging, out, write, main_only=True)
    return out


def _together(world: World, staging: Path, out: Path, action: Any, main_only: bool = False) -> None:
    """Run `action` (on every rank, or rank 0's alone), then meet: a failure anywhere is one
    error on every rank, and the staging directory is removed."""
    error: PhalanxError | None = None
    if world.is_main or not main_only:
        try:
            action()
        except PhalanxError as exc:
            error = exc
        except OSError as exc:
            error = hf_export.write_os_error(out, exc)
        except Exception as exc:  # DCP's and safetensors' own failures: one line
            error = CheckpointError(
                f"cannot write {out} ({type(exc).__name__}: {str(exc).splitlines()[0]}) — "
                "free space or fix permissions, then save again"
            )
    try:
        world.barrier_or_raise(error)
    except PhalanxError:
        if world.is_main:
            hf_export.discard(staging)
        raise
