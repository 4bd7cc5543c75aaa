"""No object collective of torch's in phalanx: each one unpickles what a peer sends, so anyone
who joins a group (under live recovery, groups are formed again mid-run) would run code in
every rank. Objects travel as JSON, or as tensors read back with weights_only
(src/phalanx/runtime/wire.py; tests/distributed/test_runtime.py runs them on real ranks)."""

from __future__ import annotations

import ast
from pathlib import Path

import phalanx

SRC = Path(phalanx.__file__).parent
UNPICKLING = {
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    "loads",  # pickle.loads
}
ALLOWED = {"runtime/safe_dcp.py"}  # DCP's metadata, through an unpickler of DCP's classes only


def _offences(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name, owner = node.func.attr, ast.unparse(node.func.value)
        if name in UNPICKLING and (name != "loads" or owner == "pickle"):
            found.append((node.lineno, f"{owner}.{name}"))
        if name == "load" and owner == "torch":
            safe = any(
                k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value
                for k in node.keywords
            )
            if not safe:
                found.append((node.lineno, "torch.load without weights_only=True"))
    return found


def test_no_collective_or_load_unpickles_a_peer() -> None:
    found = [
        f"{path.relative_to(SRC)}:{line}: {what}"
        for path in sorted(SRC.rglob("*.py"))
        if path.relative_to(SRC).as_posix() not in ALLOWED
        for line, what in _offences(ast.parse(path.read_text()))
    ]
    assert not found, "pickle-based exchange or load:\n" + "\n".join(found)


def test_the_check_finds_what_it_forbids() -> None:
    calls = ["dist.all_gather_object(o, x)", "torch.load(f)", "pickle.loads(b)"]
    bad = "\n".join([*calls, "torch.load(f, weights_only=True)"])
    assert [what for _, what in _offences(ast.parse(bad))] == [
        "dist.all_gather_object",
        "torch.load without weights_only=True",
        "pickle.loads",
    ]
