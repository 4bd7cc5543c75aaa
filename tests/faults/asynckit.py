"""What the background-save tests share: a gate that holds one checkpoint's background write
until the test releases it (an event, never a sleep), and rank 0's status lines."""

from __future__ import annotations

import threading
from typing import Any

import phalanx.train.checkpoint.writes as writes
from phalanx.offload.held import SaveHold
from phalanx.offload.stream import Streamer
from phalanx.train import Trainer
from phalanx.train.checkpoint.background import BackgroundWriter

GATE_BOUND_S = 60.0
"""How long a held write waits to be released before it fails the run (a test bug)."""


class Gate:
    """Holds the background write of checkpoint-`step` (every rank's) before it writes a byte,
    until `release` is set; `entered` is set once it is held, `thread` names the thread."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.entered = threading.Event()
        self.release = threading.Event()
        self.thread: str | None = None


def hold_writes(*gates: Gate, release_on_collect: bool = False) -> None:
    """Install `gates` in this process (writes.write, which the writer thread runs).

    `release_on_collect`: a gate opens when the training thread starts waiting for its
    save (BackgroundWriter.collect), so a save due meanwhile must wait for it."""
    by_step = {gate.step: gate for gate in gates}
    original = writes.write

    def held_write(world: Any, lineage: Any, staged: writes.Staged) -> writes.Saved:
        gate = by_step.get(staged.step)
        if gate is not None:
            gate.thread = threading.current_thread().name
            gate.entered.set()
            if not gate.release.wait(GATE_BOUND_S):
                raise RuntimeError(f"the write of checkpoint-{gate.step} was never released")
        return original(world, lineage, staged)

    writes.write = held_write
    if release_on_collect:
        collect = BackgroundWriter.collect

        def collect_released(self: BackgroundWriter[Any]) -> Any:
            gate = by_step.get(self.step or -1)
            if gate is not None:
                gate.release.set()
            return collect(self)

        BackgroundWriter.collect = collect_released  # type: ignore[method-assign]


def said(trainer: Trainer) -> list[str]:
    """Rank 0's status lines from now on (the list fills in as the run goes)."""
    lines: list[str] = []
    say = trainer._report.say

    def recording(text: str) -> None:
        lines.append(text)
        say(text)

    trainer._report.say = recording  # type: ignore[method-assign]
    return lines


def local_params(trainer: Trainer) -> list[list[float]]:
    """This rank's parameters (stage 3: its shards), as plain lists."""
    return [
        getattr(p, "_local_tensor", p).detach().reshape(-1).tolist()
        for p in trainer.model.parameters()
    ]


def record_holds() -> list[SaveHold]:
    """Every SaveHold a background save takes in this process from now on (offload/held.py)."""
    holds: list[SaveHold] = []
    original = Streamer.hold_for_save

    def recorded(self: Streamer) -> SaveHold:
        hold = original(self)
        holds.append(hold)
        return hold

    Streamer.hold_for_save = recorded  # type: ignore[method-assign]
    return holds
