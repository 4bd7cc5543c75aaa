"""The data-parallel strategy is chosen once: nothing in the Trainer's loop or setup reads
`zero_stage` but the strategy factory (and the arguments' own checks)."""

from __future__ import annotations

import ast
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[2] / "src" / "phalanx" / "train"
# Where reading zero_stage is the point: the factory, and the arguments' definition and checks.
ALLOWED = {
    "strategy.py",
    "config/args.py",
    "config/args_checks.py",
    "config/comm_checks.py",
    "config/fields.py",
}


def test_only_the_strategy_factory_reads_zero_stage() -> None:
    readers = []
    for path in sorted(TRAIN.rglob("*.py")):
        name = path.relative_to(TRAIN).as_posix()
        if name in ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "zero_stage":
                readers.append(f"{name}:{node.lineno}")
    assert readers == [], f"the Trainer branches on zero_stage outside strategy.py: {readers}"


def test_inside_strategy_py_only_the_factory_and_messages_read_zero_stage() -> None:
    """The strategies themselves differ by class, not by a test of the stage."""
    tree = ast.parse((TRAIN / "strategy.py").read_text())
    allowed: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "strategy_for":
            allowed |= {id(n) for n in ast.walk(node)}
        if isinstance(node, ast.JoinedStr):  # an error message naming the setting
            allowed |= {id(n) for n in ast.walk(node)}
    readers = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "zero_stage" and id(node) not in allowed
    ]
    assert readers == [], f"strategy.py branches on zero_stage outside strategy_for: {readers}"


def test_the_factory_maps_every_stage() -> None:
    from phalanx.train.strategy import (
        _BY_STAGE,
        FullyShard,
        ShardedGradients,
        ShardedOptimizer,
        Strategy,
    )

    assert {0: Strategy, 1: ShardedOptimizer, 2: ShardedGradients, 3: FullyShard} == _BY_STAGE
