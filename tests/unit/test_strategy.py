"""The data-parallel strategy is chosen once: nothing in the Trainer's loop or setup reads
`zero_stage` but the strategy factory (and the arguments' own checks)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import cast

import pytest

TRAIN = Path(__file__).resolve().parents[2] / "src" / "phalanx" / "train"
# Where reading zero_stage is the point: the factory, and the arguments' definition and checks.
ALLOWED = {
    "strategy/__init__.py",
    "config/args.py",
    "config/args_checks.py",
    "config/comm_checks.py",
    "config/fields.py",
}


def test_only_the_strategy_factory_reads_zero_stage() -> None:
    readers = []
    for path in sorted(TRAIN.rglob("*.py")):
        name = path.relative_to(TRAIN).as_posix()
        if name in ALLOWED or name.startswith("strategy/"):  # the next test holds strategy/
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "zero_stage":
                readers.append(f"{name}:{node.lineno}")
    assert readers == [], f"the Trainer branches on zero_stage outside strategy/: {readers}"


def test_inside_strategy_py_only_the_factory_and_messages_read_zero_stage() -> None:
    """The strategies themselves differ by class, not by a test of the stage."""
    trees = [ast.parse(p.read_text()) for p in sorted((TRAIN / "strategy").glob("*.py"))]
    tree = ast.Module(body=[n for t in trees for n in t.body], type_ignores=[])
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
    assert readers == [], f"strategy/ branches on zero_stage outside strategy_for: {readers}"


def test_the_factory_maps_every_stage() -> None:
    from phalanx.train.strategy import (
        _BY_STAGE,
        FullyShard,
        ShardedGradients,
        ShardedOptimizer,
        Strategy,
    )

    assert {0: Strategy, 1: ShardedOptimizer, 2: ShardedGradients, 3: FullyShard} == _BY_STAGE


# What the strategy owns: a test of these outside train/strategy/ is the stage rediscovered.
STRATEGY_OBJECTS = {"DistributedDataParallel", "ZeroRedundancyOptimizer", "FSDPModule"}
STRATEGY_QUESTIONS = {"unit_of", "units"}  # zero3's "is this model sharded?"


def _rediscoveries(tree: ast.AST) -> list[int]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else ""
        attr = node.func.attr if isinstance(node.func, ast.Attribute) else ""
        if name == "isinstance" and len(node.args) == 2:
            classes = ast.walk(node.args[1])
            named = {n.id for n in classes if isinstance(n, ast.Name)}
            named |= {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
            if named & STRATEGY_OBJECTS:
                found.append(node.lineno)
        if attr in STRATEGY_QUESTIONS:
            found.append(node.lineno)
    return found


def test_only_the_strategy_asks_what_its_objects_are() -> None:
    """The loop, setup, live recovery and the rest ask the strategy; none tests whether the
    model is DDP or sharded, or the optimizer ZeRO (the strategy is the one seam)."""
    found = []
    for path in sorted(TRAIN.rglob("*.py")):
        name = path.relative_to(TRAIN).as_posix()
        if name.startswith("strategy/"):
            continue
        found += [f"{name}:{line}" for line in _rediscoveries(ast.parse(path.read_text()))]
    assert found == [], f"the stage rediscovered outside train/strategy/: {found}"


def test_the_check_sees_a_rediscovery() -> None:
    code = "isinstance(m, DistributedDataParallel)\nif zero3.unit_of(m): pass\nisinstance(x, int)"
    assert _rediscoveries(ast.parse(code)) == [1, 2]


def test_auto_is_resolved_before_the_factory() -> None:
    """zero_stage / zero_offload "auto" are the planner's to resolve (train/plan/auto.py, in
    the Trainer's setup before strategy_for); the factory refuses them in one line."""
    from phalanx.errors import ConfigurationError
    from phalanx.runtime import World
    from phalanx.train.config.args import TrainingArguments
    from phalanx.train.strategy import strategy_for

    setup = (TRAIN / "trainer_setup.py").read_text()
    assert setup.index("planned_arguments(self") < setup.index("strategy_for(self.args")
    for auto in ({"zero_stage": "auto"}, {"zero_stage": 3, "zero_offload": "auto"}):
        args = TrainingArguments(report_to=[], **auto)
        with pytest.raises(ConfigurationError, match="'auto' is resolved by the Trainer"):
            strategy_for(args, cast(World, None))
