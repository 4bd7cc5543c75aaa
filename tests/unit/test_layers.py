"""docs/architecture.md's layer table is the rule: every import in src/phalanx goes down it.

Read from the code (the AST of every module, imports inside functions and under
TYPE_CHECKING included: a lazy upward import is still a cycle in the design),
checked against the table the docs show, so the two cannot drift apart. The
torch-free claim (the command, the launcher and the ground floor) is checked
by importing them in a fresh interpreter. Each check is shown to fail on a
planted import in a copy of the tree.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "phalanx"
DOC = ROOT / "docs" / "architecture.md"
TORCH_FREE_GROUND = {"ground", "errors"}
TORCH_FREE = ("ground", "errors", "launch", "cli")
"""What `phalanx launch` imports: none of it may bring torch."""


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


def package_of(path: Path, src: Path = SRC) -> str:
    rel = path.relative_to(src)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.suffix else rel.stem


def imports_of(path: Path, lazy: bool = True) -> list[tuple[int, str]]:
    """(line, phalanx package) of every phalanx import in the file.

    `lazy=False`: only those run when the module is imported (not inside a function).
    """
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree) if lazy else _outside_functions(tree)
    found = []
    for node in nodes:
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
            if node.module == "phalanx":  # from phalanx import errors
                modules = [f"phalanx.{a.name}" for a in node.names]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] == "phalanx" and len(parts) > 1:
                found.append((node.lineno, parts[1]))
    return found


def _outside_functions(tree: ast.AST) -> list[ast.AST]:
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            todo.extend(ast.iter_child_nodes(node))
    return out


def violations(rows: list[tuple[set[str], bool]], src: Path = SRC) -> list[str]:
    rank = {name: i for i, (names, _) in enumerate(rows) for name in names}
    lateral = {name: ok for names, ok in rows for name in names}
    out = []
    for path in sorted(src.rglob("*.py")):
        mine = package_of(path, src)
        assert mine in rank, f"{path}: package {mine!r} is in no row of {DOC.name}'s table"
        for line, target in imports_of(path):
            if target == mine:
                continue
            assert target in rank, f"{path}:{line}: {target!r} is in no row of the table"
            upward = rank[target] < rank[mine]
            sideways = rank[target] == rank[mine] and not lateral[mine]
            if upward or sideways:
                out.append(f"{path.relative_to(src.parents[1])}:{line}: {mine} imports {target}")
    return out


def torch_loaded_by(src: Path = SRC) -> list[str]:
    """The torch modules that importing every module of TORCH_FREE brings, in a fresh python."""
    probe = f"""
import importlib, json, pkgutil, sys
sys.path.insert(0, {str(src.parent)!r})
import phalanx
assert phalanx.__file__.startswith({str(src)!r}), phalanx.__file__
for name in {TORCH_FREE!r}:
    module = importlib.import_module("phalanx." + name)
    for info in pkgutil.walk_packages(getattr(module, "__path__", []), module.__name__ + "."):
        importlib.import_module(info.name)
import phalanx.__main__
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] == "torch")))
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def torch_free_violations(src: Path = SRC) -> list[str]:
    """Imports of the launcher (any) and of the command (at import time) beyond what they may.

    The command may import train/ inside a function (`consolidate` does, when it runs).
    """
    out = []
    for package, lazy, allowed in (("launch", True, {"launch"}), ("cli", False, {"cli", "launch"})):
        for path in sorted((src / package).rglob("*.py")):
            for line, target in imports_of(path, lazy):
                if target not in allowed | TORCH_FREE_GROUND:
                    rel = path.relative_to(src.parents[1])
                    out.append(f"{rel}:{line}: {package} imports {target}")
    return out


def _copy_of_the_tree(tmp_path: Path) -> Path:
    copy = tmp_path / "src" / "phalanx"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_every_import_goes_down_the_layer_table() -> None:
    assert violations(layer_table()) == []


def test_the_torch_free_rows_are_the_bottom_row() -> None:
    """What the launcher may import is exactly the table's ground row."""
    assert layer_table()[-1][0] == TORCH_FREE_GROUND


def test_the_launcher_and_the_command_import_only_the_torch_free_ground() -> None:
    assert torch_free_violations() == []


def test_the_command_the_launcher_and_the_ground_import_no_torch() -> None:
    assert torch_loaded_by() == []


def test_a_planted_upward_import_fails(tmp_path: Path) -> None:
    """The check can fail: runtime importing ddp, in a copy of the tree, is caught."""
    copy = _copy_of_the_tree(tmp_path)
    planted = copy / "runtime" / "_planted_upward.py"
    planted.write_text("from phalanx.ddp.module import DistributedDataParallel\n")
    found = violations(layer_table(), copy)
    assert found == ["src/phalanx/runtime/_planted_upward.py:1: runtime imports ddp"]


def test_a_planted_torch_import_in_the_ground_fails(tmp_path: Path) -> None:
    """The torch-free check can fail: a ground module importing torch, in a copy, is caught."""
    copy = _copy_of_the_tree(tmp_path)
    with (copy / "ground" / "ports.py").open("a") as ports:
        ports.write("\nimport torch  # planted\n")
    assert "torch" in torch_loaded_by(copy)


def test_a_planted_import_of_train_in_the_command_fails(tmp_path: Path) -> None:
    """At import time the command may not import train/ (consolidate_cmd does, inside its
    functions, and is allowed); the launcher may not import it at all."""
    copy = _copy_of_the_tree(tmp_path)
    (copy / "cli" / "_planted.py").write_text("from phalanx.train import Trainer\n")
    (copy / "launch" / "_planted.py").write_text("def f() -> None:\n    import phalanx.train\n")
    assert sorted(torch_free_violations(copy)) == [
        "src/phalanx/cli/_planted.py:1: cli imports train",
        "src/phalanx/launch/_planted.py:2: launch imports train",
    ]


@pytest.mark.parametrize("package", ["launch", "cli"])
def test_the_package_docstring_names_every_module(package: str) -> None:
    doc = (SRC / package / "__init__.py").read_text().split('"""')[1]
    named = set(re.findall(r"`([a-z_]+)`", doc))
    modules = {p.stem for p in (SRC / package).glob("*.py") if p.stem != "__init__"}
    assert modules <= named, f"{package}/__init__.py's docstring misses {sorted(modules - named)}"


def test_architecture_names_every_module() -> None:
    """Every module of src/phalanx is named in docs/architecture.md (its diagram or tables),
    so a reader finds where each one sits."""
    doc = DOC.read_text()
    modules = {p.stem for p in SRC.rglob("*.py") if p.stem != "__init__"}
    missing = sorted(m for m in modules if not re.search(rf"\b{m}\b", doc))
    assert missing == [], f"docs/architecture.md names none of {missing}"
