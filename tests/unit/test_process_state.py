"""docs/architecture.md's "Process-wide state" table lists every module-level object that a
module of src/phalanx writes to, and nothing else.

Found from the code: a module-level name that its module mutates (item assignment or
deletion, a mutating method call, or a `global` rebinding). A new table that holds run
state must argue for itself in the docs, or move into an object the run owns.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "phalanx"
DOC = ROOT / "docs" / "architecture.md"
_MUTATORS = {
    "append",
    "add",
    "clear",
    "discard",
    "extend",
    "insert",
    "pop",
    "popitem",
    "remove",
    "setdefault",
    "update",
}


def _module_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def written_module_state(src: Path = SRC) -> set[str]:
    """`package/module.py: name` for every module-level name its module writes to."""
    found = set()
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = _module_names(tree)
        written: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                written |= set(node.names)
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del):
                if isinstance(node.value, ast.Name):
                    written.add(node.value.id)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                target = node.func.value
                if isinstance(target, ast.Name) and node.func.attr in _MUTATORS:
                    written.add(target.id)
        rel = path.relative_to(src).as_posix()
        found |= {f"{rel}: {name}" for name in written & names if name != "__all__"}
    return found


def documented() -> set[str]:
    section = DOC.read_text().split("## Process-wide state", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z_0-9/]+\.py: [A-Za-z_]+)` \|", section, re.M))


def test_every_written_module_level_object_is_documented() -> None:
    found, listed = written_module_state(), documented()
    assert listed, f"no 'Process-wide state' table in {DOC}"
    assert found - listed == set(), "module-level state missing from docs/architecture.md"
    assert listed - found == set(), "docs/architecture.md lists module state that is gone"


def test_a_planted_module_level_cache_is_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "cache.py").write_text(
        "_CACHE: dict[int, int] = {}\nLIMIT = {1: 2}\n\n"
        "def remember(k: int) -> None:\n    _CACHE[k] = LIMIT[1]\n"
    )
    (package / "flag.py").write_text(
        "_seen = None\n\ndef mark() -> None:\n    global _seen\n    _seen = 1\n"
    )
    assert written_module_state(tmp_path) == {"pkg/cache.py: _CACHE", "pkg/flag.py: _seen"}
