"""The Hugging Face export's files have the mode any file the user writes has: 0666 less
the umask (0644 under the usual 022). safetensors' own save_file wrote the weight files
0600 (a temporary file renamed), so nobody else could read the weights of an export made
to be shared, while its config and index beside them were 0644."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from phalanx.train.checkpoint import hf_export

pytest.importorskip("safetensors", reason="the export needs safetensors (the hf extra)")


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077], ids=lambda m: f"umask-{m:03o}")
def test_every_exported_file_gets_the_mode_the_umask_gives(tmp_path: Path, umask: int) -> None:
    weights = {f"layer{i}.weight": torch.full((64, 64), float(i)) for i in range(4)}
    notes = {"config.json": b"{}\n"}
    previous = os.umask(umask)
    try:
        written = hf_export.write_hf(
            hf_export.StateDictSource(weights), tmp_path, 40_000, {}, notes
        )
    finally:
        os.umask(previous)
    assert len(written.files) > 1  # shards and their index, not one file alone
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask), {k: oct(v) for k, v in modes.items()}
