"""Every key phalanx writes in a job's store is named in ground/store_keys.py, and only there.

Read from the code: a string literal (or the head of an f-string) that starts with
`phalanx/` anywhere else in src/phalanx is a store key built outside its module.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "phalanx"
HOME = "ground/store_keys.py"


def keys_built_outside(src: Path = SRC) -> list[str]:
    found = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        if rel == HOME:
            continue
        for node in ast.walk(ast.parse(path.read_text())):  # an f-string's parts too
            text = node.value if isinstance(node, ast.Constant) else None
            if isinstance(node, ast.Constant) and isinstance(text, str) and text[:8] == "phalanx/":
                found.append(f"{rel}:{node.lineno}: {text!r}")
    return found


def test_store_keys_are_built_in_one_module() -> None:
    assert keys_built_outside() == []


def test_a_planted_key_is_found(tmp_path: Path) -> None:
    (tmp_path / "ground").mkdir()
    (tmp_path / "ground" / "store_keys.py").write_text('KEY = "phalanx/live/"\n')
    (tmp_path / "meet.py").write_text('def k(n: int) -> str:\n    return f"phalanx/x/{n}"\n')
    assert keys_built_outside(tmp_path) == ["meet.py:2: 'phalanx/x/'"]
