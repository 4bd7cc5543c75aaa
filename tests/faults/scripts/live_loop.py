"""A hand-written DDP loop under `phalanx launch --live-recovery` (tests/faults/test_live.py).

Each step takes the next `world * BATCH` samples of one fixed order, this rank's
slice of them; so a ledger of (step, offset, world) per applied step shows
whether any sample was skipped or repeated. KILL_MEMBER kills or stops itself
(KILL_SIGNAL) at KILL_STEP, before the step's backward, with a collective in
flight on the others. HOLD_STEP and HOLD_WORLD hold the members at that step's boundary
until the world has grown back to HOLD_WORLD (a replacement coming from a new host), so
the run cannot end before it arrives. ADMIT_AT lets a replacement in at that step
only (as a replayed membership does), so two runs with the same loss are bit-identical.
HANG_AT_EXIT_MEMBER finishes the run, then hangs in an exit handler.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import phalanx
from phalanx.errors import PeerLost
from phalanx.runtime.live import current_live_group
from phalanx.runtime.membership import settings_from_env
from phalanx.runtime.recovery import LiveRecovery

BATCH, SAMPLES, STEPS = 4, 4096, int(os.environ.get("STEPS", "30"))
PAUSE_S = float(os.environ.get("PAUSE_S", "0"))
HOLD_STEP, HOLD_WORLD = (
    int(os.environ.get("HOLD_STEP", "-1")),
    int(os.environ.get("HOLD_WORLD", "0")),
)


def main() -> None:
    phalanx.init(backend="gloo", timeout=60)
    group = current_live_group()
    assert group is not None, "run me under phalanx launch --live-recovery"
    admit_at = [int(os.environ["ADMIT_AT"])] if os.environ.get("ADMIT_AT") else None
    live = LiveRecovery(group, settings_from_env(), admit_at)  # ADMIT_AT: a replacement's step
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.randn(SAMPLES, 16, generator=torch.Generator().manual_seed(1))
    target = data.sum(dim=1, keepdim=True).sin()
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(2))
    at = {"step": 0, "offset": 0}

    def save() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **at}

    def load(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        at.update(step=state["step"], offset=state["offset"])

    if group.member == os.environ.get("DIE_ON_ADMISSION"):
        die_on_admission(live)
    if group.member.startswith("j"):
        say(group, f"joined: {live.join(group.member, save, load)}")
    ddp = phalanx.DistributedDataParallel(model, process_group=group)
    ledger = Path(os.environ["LEDGER_DIR"]) / f"{group.member}.jsonl"
    while at["step"] < STEPS:
        try:
            live.boundary(at["step"])
            while at["step"] == HOLD_STEP and group.size() < HOLD_WORLD:
                time.sleep(0.05)
                live.boundary(at["step"])  # PeerLost once a replacement asks to join
            world, rank = group.size(), group.rank()
            start = at["offset"] + rank * BATCH
            rows = order[start : start + BATCH]
            loss = nn.functional.mse_loss(ddp(data[rows]), target[rows])
            maybe_die(group.member, at["step"])
            time.sleep(PAUSE_S)  # a step of a real model's length, so a replacement can catch up
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            at["step"] += 1
            at["offset"] += world * BATCH
            with ledger.open("a") as out:
                out.write(json.dumps({"step": at["step"], "offset": at["offset"], "world": world,
                                      "loss": loss.item()}) + "\n")  # fmt: skip
        except PeerLost as exc:
            optimizer.zero_grad(set_to_none=True)
            done = live.recover(at["step"], str(exc), save, load)
            say(group, f"recovered: {done}")
            ddp = phalanx.DistributedDataParallel(model, process_group=group)
    live.finish(at["step"])
    phalanx.check_replicas(ddp, group)
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    say(group, f"done step={at['step']} offset={at['offset']} digest={digest:.12e}")
    if group.member == os.environ.get("HANG_AT_EXIT_MEMBER"):
        atexit.register(hang_at_exit)


def hang_at_exit() -> None:
    """A teardown that never returns (as a group's can): the launcher must end it."""
    threading.Event().wait()


def maybe_die(member: str, step: int) -> None:
    if member == os.environ.get("KILL_MEMBER") and step == int(os.environ["KILL_STEP"]):
        os.kill(os.getpid(), getattr(signal, os.environ.get("KILL_SIGNAL", "SIGKILL")))


def die_on_admission(live: LiveRecovery) -> None:
    """Be let in, then die before connecting: the members wait for it in vain."""
    admitted = live.membership.join

    def join_then_die(member: str) -> tuple[int, list[str]]:
        admitted(member)
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")

    live.membership.join = join_then_die  # type: ignore[method-assign]


def say(group: Any, line: str) -> None:
    print(f"[{group.member}] {line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
