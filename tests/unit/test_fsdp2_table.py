"""docs/fsdp2.md covers torch's FSDP2 as installed, and phalanx's FSDPModule has its methods.

A torch upgrade that adds a public FSDPModule method or a fully_shard argument
fails here until phalanx has the method (implemented or refusing in one line)
and the table says what phalanx does with it and which test holds it.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import phalanx

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "fsdp2.md").read_text()


def _torch_methods() -> set[str]:
    return {n for n, v in vars(TorchFSDPModule).items() if not n.startswith("_") and callable(v)}


def _rows(heading: str) -> dict[str, list[str]]:
    """The table under `heading`: its first column's backticked name -> the row's cells."""
    section = DOC.split(heading, 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {
        re.findall(r"`(\w+)`", row)[0]: [c.strip() for c in row.strip("|").split(" | ")]
        for row in rows
    }


def test_phalanx_fsdpmodule_has_every_public_method_of_torchs() -> None:
    missing = sorted(n for n in _torch_methods() if not hasattr(phalanx.FSDPModule, n))
    assert not missing, f"phalanx.FSDPModule lacks torch's {missing}"


def test_the_table_covers_every_method_with_a_status_and_a_test() -> None:
    rows = _rows("## `FSDPModule` methods")
    assert set(rows) == _torch_methods(), set(rows) ^ _torch_methods()
    for name, (_, status, test) in rows.items():
        assert status.split(":")[0].split(" ")[0] in ("implemented", "accepted", "refused"), name
        assert test, f"{name}: no test named"


def test_the_table_covers_every_fully_shard_argument() -> None:
    theirs = set(inspect.signature(torch_fully_shard).parameters)
    ours = set(inspect.signature(phalanx.fully_shard).parameters)
    assert theirs <= ours, f"phalanx.fully_shard lacks {sorted(theirs - ours)}"
    assert set(_rows("## `fully_shard` arguments")) == theirs


def test_every_test_the_page_names_exists() -> None:
    """`surface [case]` and the test functions named in the tables are real."""
    files = {
        "surface": "tests/distributed/test_fsdp2_surface.py",
        "tools": "tests/distributed/test_fsdp2_tools.py",
        "zero3": "tests/distributed/test_zero3.py",
        "limits": "tests/distributed/test_zero3_limits.py",
    }
    sources = {k: (ROOT / v).read_text() for k, v in files.items()}
    for row in DOC.splitlines():
        if not row.startswith("| `"):
            continue
        test = row.strip("|").split(" | ")[-1]
        # "tools `test_x`, surface `[a]`, `[b]`": each file's short name, then its names.
        for short, names in re.findall(r"\b(surface|tools|zero3|limits)((?:,? `[^`]+`)+)", test):
            for name in re.findall(r"`(test_\w+)`", names):
                assert f"def {name}(" in sources[short], (row, name)
            for case in re.findall(r"`\[([\w-]+)\]`", names):
                assert f'"{case}"' in sources[short], (row, case)
            assert names.strip(", "), row
        for path in re.findall(r"tests/[\w/]+\.py", test):
            assert (ROOT / path).is_file(), (row, path)
