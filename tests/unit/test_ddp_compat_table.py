"""docs/ddp.md's compatibility table covers torch's DistributedDataParallel as installed.

A torch upgrade that adds a constructor argument or a public method fails
here until the table (and the constructor) says what phalanx does with it.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import torch

from phalanx.ddp.module import DistributedDataParallel

DOC = (Path(__file__).resolve().parents[2] / "docs" / "ddp.md").read_text()
TORCH_DDP = torch.nn.parallel.DistributedDataParallel


def _table_names(heading: str) -> set[str]:
    """The backticked names in the first column of the table under `heading`."""
    section = DOC.split(heading, 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`(\w+)", row.split(" | ")[0])}


def test_every_torch_constructor_argument_is_ours_in_torchs_order_and_in_the_table() -> None:
    theirs = list(inspect.signature(TORCH_DDP.__init__).parameters)
    ours = list(inspect.signature(DistributedDataParallel.__init__).parameters)
    assert ours == theirs  # positional calls bind the same way
    missing = set(theirs) - {"self"} - _table_names("### Constructor arguments")
    assert not missing, f"docs/ddp.md does not say what phalanx does with {sorted(missing)}"


def test_every_public_torch_method_is_in_the_table() -> None:
    own = set(vars(TORCH_DDP)) - set(vars(torch.nn.Module))
    public = {name for name in own if not name.startswith("_")}
    missing = public - _table_names("### Methods and attributes")
    assert not missing, f"docs/ddp.md does not say what phalanx does with {sorted(missing)}"
