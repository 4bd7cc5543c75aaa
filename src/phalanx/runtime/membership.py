"""Who is in the next generation of a live-recovery run, agreed through the job's store.

After an abort, every survivor checks in under the next generation with the
number of steps it has applied. The first survivor to see every old member
accounted for (checked in, or reported lost by its launcher: `lost/<member>`),
or the settle time run out, proposes the members (the checked-in survivors in
their old order, then the replacements waiting to join) with one
compare-and-set; every other member reads that proposal, so all agree whatever
they saw. A member left out (a stalled rank that woke up late) is fenced: it
stops, and cannot bring stale state back. Replacements announce themselves under
`join/`; they are taken in at the next generation. Fewer than `min_members`
after `quorum_timeout_s` is `NoQuorum`, naming who is missing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

import torch.distributed as dist

from phalanx.errors import NoQuorum
from phalanx.ground.live_keys import (
    FINISHED_KEY,
    GENERATION_KEY,
    JOIN_SEQ_KEY,
    KEY,
    MIN_MEMBERS_ENV,
    QUORUM_TIMEOUT_ENV,
    STALL_ENV,
    abort_key,
    grow_key,
    lost_key,
    members_key,
)
from phalanx.runtime.live import LiveGroup

__all__ = ["Membership", "Settings", "settings_from_env"]

_POLL_S = 0.05


def _join_key(member: str) -> str:
    return f"{KEY}join/{member}"


def _checkin_key(generation: int, member: str) -> str:
    return f"{KEY}g{generation}/in/{member}"


@dataclass(frozen=True)
class Settings:
    min_members: int = 1
    settle_s: float = 10.0
    """How long survivors wait for an old member that neither checked in nor was reported
    lost (a host gone with its launcher) before leaving it out."""
    quorum_timeout_s: float = 60.0


class Membership:
    """This process's side of the protocol, over its `LiveGroup`."""

    def __init__(self, group: LiveGroup, settings: Settings) -> None:
        self.group = group
        self.store: dist.Store = group.store
        self.settings = settings

    # ------------------------------------------------------------ survivors
    def next_generation(self, applied_step: int, reason: str) -> list[str]:
        """Leave the current generation and agree on the next one's members (in order)."""
        group = self.group
        old, gen = group.members, group.generation
        self.store.compare_set(abort_key(gen), "", f"{group.member}: {reason}")
        checkin = json.dumps({"step": applied_step})
        self.store.set(_checkin_key(gen + 1, group.member), checkin)
        members = self._agree(gen + 1, old)
        if group.member not in members:
            raise NoQuorum(
                f"{group.member} was left out of generation {gen + 1} (it checked in after the "
                "others had gone on without it) — it stops; its launcher may start a replacement"
            )
        return members

    def _agree(self, gen: int, old: list[str]) -> list[str]:
        start = time.monotonic()
        key = members_key(gen)
        while not self.store.check([key]):
            waited = time.monotonic() - start
            arrived = [m for m in old if self.store.check([_checkin_key(gen, m)])]
            lost = [m for m in old if m not in arrived and self.store.check([lost_key(m)])]
            missing = [m for m in old if m not in arrived and m not in lost]
            if not missing or waited > self.settings.settle_s:
                joiners = [j for j in self._waiting_joiners() if j not in old]
                proposal = arrived + joiners
                if len(proposal) >= self.settings.min_members:
                    self.store.compare_set(key, "", json.dumps(proposal))
                    break
                if waited > self.settings.quorum_timeout_s:
                    raise NoQuorum(self._short(gen, proposal, lost, missing))
            time.sleep(_POLL_S)
        members: list[str] = json.loads(self.store.get(key))
        self.store.set(GENERATION_KEY, str(gen))
        return members

    def _short(self, gen: int, proposal: list[str], lost: list[str], missing: list[str]) -> str:
        need = self.settings.min_members
        gone = ", ".join([f"{m} (lost)" for m in lost] + [f"{m} (silent)" for m in missing])
        return (
            f"no quorum for generation {gen} after {self.settings.quorum_timeout_s:.0f} s: "
            f"{len(proposal)} of the {need} members it needs ({', '.join(proposal) or 'none'}); "
            f"missing {gone or 'no one'} — start replacements (phalanx launch --live-recovery "
            "with --max-restarts), or lower --live-min-members"
        )

    def _waiting_joiners(self) -> list[str]:
        count = self.store.add(JOIN_SEQ_KEY, 0)
        joiners = [f"j{n}" for n in range(1, count + 1)]
        return [j for j in joiners if self.store.check([_join_key(j)])]

    def ask_to_grow(self) -> None:
        """At a step boundary with a replacement waiting: end this generation for everyone."""
        raise self.group.lost("a replacement is waiting to join")

    # ------------------------------------------------------------ replacements
    def finish(self, step: int) -> None:
        """Training ended at `step` (every member says so): no replacement will be let in."""
        self.store.set(FINISHED_KEY, str(step))

    def join(self, member: str) -> tuple[int, list[str]]:
        """As replacement `member`: wait to be taken into a generation; (it, its members).

        When the run finishes first, this process has nothing to do: it says so and
        exits 0 (SystemExit), so that the rest of the script (a save, an upload) does not
        run on a replica that never trained."""
        self.store.set(_join_key(member), "waiting")
        start = time.monotonic()
        while True:
            current = self._generation()
            for gen in (current, current + 1):  # the members may have moved on already
                key = members_key(gen)
                if gen > 0 and self.store.check([key]):
                    members: list[str] = json.loads(self.store.get(key))
                    if member in members:
                        self.store.delete_key(_join_key(member))
                        return gen, members
            if self.store.check([FINISHED_KEY]):
                self.store.delete_key(_join_key(member))
                step = self.store.get(FINISHED_KEY).decode()
                print(f"[phalanx] replacement {member}: the run finished (step {step}) before "
                      "it could join; nothing to do", file=sys.stderr, flush=True)  # fmt: skip
                raise SystemExit(0)
            self.store.compare_set(grow_key(current), "", member)
            if time.monotonic() - start > self.settings.quorum_timeout_s:
                raise NoQuorum(
                    f"replacement {member} was not taken into the run within "
                    f"{self.settings.quorum_timeout_s:.0f} s (generation {current} goes on "
                    "without it) — check that the run is still training"
                )
            time.sleep(_POLL_S)

    def _generation(self) -> int:
        if not self.store.check([GENERATION_KEY]):
            return 0
        return int(self.store.get(GENERATION_KEY))


def settings_from_env(environ: dict[str, str] | None = None) -> Settings:
    """The settings `phalanx launch --live-recovery` passes its workers."""
    env = os.environ if environ is None else environ
    stall = float(env.get(STALL_ENV, Settings.settle_s))
    return Settings(
        min_members=int(env.get(MIN_MEMBERS_ENV, Settings.min_members)),
        settle_s=2 * stall,
        quorum_timeout_s=float(env.get(QUORUM_TIMEOUT_ENV, Settings.quorum_timeout_s)),
    )
