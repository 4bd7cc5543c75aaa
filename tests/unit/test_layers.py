"""docs/architecture.md's layer table is the rule: every import in src/phalanx goes down it.

Read from the code (the AST of every module, imports inside functions and under
TYPE_CHECKING included: a lazy upward import is still a cycle in the design),
checked against the table the docs show, so the two cannot drift apart.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "phalanx"
DOC = ROOT / "docs" / "architecture.md"
TORCH_FREE_GROUND = {
    "errors",
    "jobenv",
    "netif",
    "ports",
    "storeclient",
    "parent_launch",
    "progress_record",
}


def layer_table() -> list[tuple[set[str], bool]]:
    """Rows top to bottom: (packages, whether they may import each other)."""
    rows = []
    section = DOC.read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1].startswith("`"):
            names = set(re.findall(r"`([a-z_0-9]+)`", cells[1]))
            rows.append((names, not cells[2].startswith("none")))
    assert rows, f"no layer table in {DOC}"
    return rows


def package_of(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.suffix else rel.stem


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, phalanx package) of every phalanx import in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
            if node.module == "phalanx":  # from phalanx import progress_record
                modules = [f"phalanx.{a.name}" for a in node.names]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] == "phalanx" and len(parts) > 1:
                found.append((node.lineno, parts[1]))
    return found


def violations(rows: list[tuple[set[str], bool]]) -> list[str]:
    rank = {name: i for i, (names, _) in enumerate(rows) for name in names}
    lateral = {name: ok for names, ok in rows for name in names}
    out = []
    for path in sorted(SRC.rglob("*.py")):
        mine = package_of(path)
        assert mine in rank, f"{path}: package {mine!r} is in no row of {DOC.name}'s table"
        for line, target in imports_of(path):
            if target == mine:
                continue
            assert target in rank, f"{path}:{line}: {target!r} is in no row of the table"
            upward = rank[target] < rank[mine]
            sideways = rank[target] == rank[mine] and not lateral[mine]
            if upward or sideways:
                out.append(f"{path.relative_to(ROOT)}:{line}: {mine} imports {target}")
    return out


def test_every_import_goes_down_the_layer_table() -> None:
    assert violations(layer_table()) == []


def test_the_launcher_imports_only_the_torch_free_ground() -> None:
    for path in (SRC / "launch").rglob("*.py"):
        for line, target in imports_of(path):
            if target not in ("launch", "train"):  # train: consolidate, lazily, for torch
                assert target in TORCH_FREE_GROUND, f"{path}:{line}: launch imports {target}"


def test_a_planted_upward_import_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: runtime importing ddp is caught."""
    planted = SRC / "runtime" / "_planted_upward.py"
    planted.write_text("from phalanx.ddp.module import DistributedDataParallel\n")
    try:
        found = violations(layer_table())
    finally:
        planted.unlink()
    assert found == ["src/phalanx/runtime/_planted_upward.py:1: runtime imports ddp"]


def test_the_launchers_docstring_names_every_module() -> None:
    doc = (SRC / "launch" / "__init__.py").read_text().split('"""')[1]
    named = set(re.findall(r"`([a-z_]+)`", doc))
    modules = {p.stem for p in (SRC / "launch").glob("*.py") if p.stem != "__init__"}
    assert modules <= named, f"launch/__init__.py's docstring misses {sorted(modules - named)}"
