"""A phalanx checkpoint's model in Hugging Face's format, one output file at a time.

`phalanx consolidate --format hf CHECKPOINT OUT_DIR` (and the Trainer's
`save_safetensors` / `save_model`) write what `from_pretrained(OUT_DIR)`
reads: `model.safetensors`, or `model-0000k-of-0000n.safetensors` with
`model.safetensors.index.json` over `max_shard_size`, and, for a
`transformers` model, the `config.json` (and `generation_config.json`) the
Trainer recorded in the checkpoint with the config's own `save_pretrained`.
The formats are the ecosystem's own: the shard plan and index are
huggingface_hub's `split_torch_state_dict_into_shards`, each file is
safetensors' `save_file`.

The model is never whole in memory: the plan is made from shapes and dtypes
alone (meta tensors), then each output file's tensors are read, written and
let go before the next. A `model.pt` (stages 0-2) is read through a memory
map, so only the tensors of the file being written are touched; stage 3's
DCP directory is read by key into tensors allocated for that file only.

Tied weights: safetensors refuses tensors that share memory, so, as
transformers' `save_pretrained` does, the tied copies (the names its
`_tied_weights_keys` declare, recorded by the Trainer as `hf_tied.json`) are
left out and `from_pretrained` ties them back. Any other tensor held under
two names (a plain module's) is written under both.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from phalanx.errors import CheckpointError, ConfigurationError
from phalanx.ground.safe_files import create_dir
from phalanx.train.checkpoint.directory import describe_os_error, fsync_dir

DEFAULT_MAX_SHARD_SIZE = "5GB"
"""huggingface_hub's default for `split_torch_state_dict_into_shards` (transformers 4's)."""
INDEX = "model.safetensors.index.json"
TIED_NOTE = "hf_tied.json"
"""{tied copy: the name kept}: written by the Trainer beside config.json."""
HF_NOTES = ("config.json", "generation_config.json")
"""What save_pretrained of the config and the generation config write; copied as they are."""
_INSTALL = "pip install 'phalanx[hf]'"


def require_hf_libraries() -> None:
    """Refuse in one line, before anything is read, where safetensors or huggingface_hub
    is missing."""
    for module in ("safetensors", "huggingface_hub"):
        try:
            __import__(module)
        except ImportError:
            raise ConfigurationError(
                f"writing Hugging Face's format needs the {module} package, which is not "
                f"installed — {_INSTALL}"
            ) from None


# ------------------------------------------------------------------ sources


class Source(Protocol):
    """Where the model's tensors come from: their shapes first, then a few at a time."""

    def specs(self) -> dict[str, tuple[torch.Size, torch.dtype]]: ...

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]: ...


class TorchFileSource:
    """A `model.pt` (torch.save of the state dict) read through a memory map: each read maps
    the file again and touches only the tensors asked for, unmapped when they are let go."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _mapped(self) -> dict[str, Any]:
        try:
            return torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # torch raises many types for a bad or foreign file
            raise CheckpointError(
                f"{self.path} cannot be loaded ({type(exc).__name__}) — the checkpoint is "
                "corrupt; export an earlier one"
            ) from exc

    def specs(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        state = self._mapped()
        return {k: (v.shape, v.dtype) for k, v in state.items() if isinstance(v, torch.Tensor)}

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        state = self._mapped()
        return {key: state[key] for key in keys}


class DcpSource:
    """Stage 3's `model/` DCP directory (entries "model.<key>"): each read allocates the
    tensors asked for and has DCP fill only those, through phalanx.runtime.safe_dcp."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._specs: dict[str, tuple[torch.Size, torch.dtype]] | None = None

    def specs(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from phalanx.runtime import safe_dcp

        if self._specs is not None:
            return self._specs
        entries = safe_dcp.read_metadata(self.directory).state_dict_metadata
        self._specs = {
            fqn.removeprefix("model."): (meta.size, meta.properties.dtype)
            for fqn, meta in entries.items()
            if fqn.startswith("model.") and isinstance(meta, TensorStorageMetadata)
        }
        return self._specs

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        from phalanx.runtime import safe_dcp

        specs = self.specs()
        model = {key: torch.empty(specs[key][0], dtype=specs[key][1]) for key in keys}
        safe_dcp.read_into({"model": model}, self.directory)
        return model


class StateDictSource:
    """Tensors already in memory (a live model's state dict, or an old checkpoint read whole)."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}

    def specs(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        return {k: (v.shape, v.dtype) for k, v in self.state.items()}

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        return {key: self.state[key].detach().cpu() for key in keys}


# ------------------------------------------------------------------ writing


@dataclass(frozen=True)
class Written:
    """What `write_hf` wrote."""

    files: list[str]
    """The weight files, in order."""
    tensors: int
    tied_left_out: list[str]
    plan: dict[str, list[str]]
    """Output file -> the tensors it holds: each file's tensors are read together."""


def plan_shards(
    specs: Mapping[str, tuple[torch.Size, torch.dtype]], max_shard_size: int | str
) -> Any:
    """huggingface_hub's shard plan over meta tensors of the given shapes (nothing read)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    meta = {k: torch.empty(size, dtype=dtype, device="meta") for k, (size, dtype) in specs.items()}
    try:
        return split_torch_state_dict_into_shards(meta, max_shard_size=max_shard_size)
    except ValueError as exc:
        raise ConfigurationError(
            f"max_shard_size {max_shard_size!r} is not a size ({exc}) — give bytes or a size "
            'such as "5GB" or "500MB"'
        ) from None


def write_hf(
    source: Source,
    directory: Path,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    tied: Mapping[str, str] | None = None,
    notes: Mapping[str, bytes] | None = None,
) -> Written:
    """Write the weights of `source` (less the `tied` copies) and `notes` into `directory`,
    one weight file's tensors in memory at a time; every file is fsynced."""
    from safetensors.torch import save_file

    specs = source.specs()
    left_out = sorted(key for key in tied or {} if key in specs)
    kept = {k: v for k, v in specs.items() if k not in left_out}
    split = plan_shards(kept, max_shard_size)
    plan = {name: list(keys) for name, keys in split.filename_to_tensors.items()}
    for name, keys in plan.items():
        tensors = _unshared(source.read(keys))
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        del tensors  # before the next file's are read
        # safetensors writes a temporary file of mode 0600 and renames it: the weights
        # would be the one file of the export (and of a checkpoint) no one else can read.
        os.chmod(directory / name, 0o666 & ~_umask())
        _fsync(directory / name)
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)}
        _write_bytes(directory / INDEX, (json.dumps(index, indent=2, sort_keys=True) + "\n"))
    for name, data in (notes or {}).items():
        _write_bytes(directory / name, data)
    fsync_dir(directory)
    return Written(list(plan), len(kept), left_out, plan)


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, none sharing memory with another (safetensors refuses that): a
    tensor a plain module holds under two names is copied for the second."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        ptr = tensor.untyped_storage().data_ptr()
        out[key] = tensor.clone() if ptr in seen and tensor.numel() else tensor.contiguous()
        seen.add(ptr)
    return out


def _umask() -> int:
    """This process's umask, read without changing it (Linux's /proc/self/status; elsewhere
    set and put back at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync(path: Path) -> None:
    with path.open("rb") as file:
        os.fsync(file.fileno())


def _write_bytes(path: Path, data: bytes | str) -> None:
    with path.open("wb") as file:
        file.write(data.encode() if isinstance(data, str) else data)
        file.flush()
        os.fsync(file.fileno())


# ------------------------------------------------------------------ publishing


def staging_beside(out: Path) -> Path:
    """A new, empty `.<name>.<random>.tmp/` beside `out` (its folders made): nothing planted
    under a name that can be guessed blocks it or is written through; errors in one line."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(
            f"{out} is a file, and Hugging Face's format is a directory — give a directory "
            f"(new or existing), e.g. {out.with_suffix('')}-hf"
        )
    parent = out.parent
    refuse_a_file_above(out)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        return create_dir(parent, f".{out.name}")
    except OSError as exc:
        raise CheckpointError(
            f"cannot create a folder beside {out} ({describe_os_error(exc)}) — write to a "
            "folder you can write"
        ) from None


def publish(tmp: Path, out: Path) -> None:
    """Move the finished `tmp` to `out`.

    A new `out` is one rename: all of it or nothing. Into an existing directory
    (say, one holding the tokenizer) each file is renamed over its old self,
    the weight files first and the index and config after, then a previous
    export's weight files that the new one does not have are removed, as
    save_pretrained does.
    """
    if not out.exists():
        os.rename(tmp, out)
        fsync_dir(out.parent)
        return
    names = sorted(p.name for p in tmp.iterdir())
    for name in sorted(names, key=lambda n: not n.endswith(".safetensors")):
        os.replace(tmp / name, out / name)
    for stale in _previous_export(out, set(names)):
        stale.unlink()
    fsync_dir(out)
    tmp.rmdir()


def _previous_export(out: Path, new: set[str]) -> Iterable[Path]:
    for path in out.iterdir():
        weights = path.name.startswith("model") and path.name.endswith(".safetensors")
        if (weights or path.name == INDEX) and path.name not in new and path.is_file():
            yield path


def discard(tmp: Path) -> None:
    with contextlib.suppress(OSError):
        shutil.rmtree(tmp)


def write_os_error(out: Path, exc: OSError) -> CheckpointError:
    """One line for a write that the system refused (a full disk, a read-only folder)."""
    reason = describe_os_error(exc)
    full = exc.errno == 28  # ENOSPC
    fix = "free space or write elsewhere" if full else "write to a folder you can write to"
    return CheckpointError(f"cannot write {out} ({reason}) — {fix}; {out} was left as it was")


def refuse_a_file_above(out: Path) -> None:
    """One line when a folder on the way to `out` is a file (mkdir would fail obscurely)."""
    parent = out.parent
    blocking = next((p for p in (parent, *parent.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise CheckpointError(
            f"cannot write {out}: {blocking} is a file, not a directory — choose an output "
            "path whose folders are directories"
        )
