"""Who is in the next generation of a live-recovery run, agreed through the job's store.

After an abort, every survivor checks in under the next generation with the
number of steps it has applied. The first survivor to see every old member
accounted for (checked in, or reported lost by its launcher: `lost/<member>`),
or the settle time run out, proposes the members (the checked-in survivors in
their old order, then the replacements waiting to join) with one
compare-and-set; every other member reads that proposal, so all agree whatever
they saw. A member left out (a stalled rank that woke up late) is fenced: it
stops, and cannot bring stale state back. Replacements announce themselves under
`join/` (under the name their launcher claimed, `join/claim/`); they are taken in
at the next generation, unless their launcher reported them lost meanwhile.
Every value is read through `LiveStore`: one that is not signed with the run's
secret is absent, so a stranger can neither check in, nor report a member lost,
nor propose the members (docs/reliability.md, "Who can steer a run"). Fewer than `min_members`
after `quorum_timeout_s` is `NoQuorum`, naming who is missing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from phalanx.errors import NoQuorum
from phalanx.ground.live_store import LiveStore
from phalanx.ground.store_keys import (
    FINISHED_KEY,
    GENERATION_KEY,
    MIN_MEMBERS_ENV,
    QUORUM_TIMEOUT_ENV,
    STALL_ENV,
    checkin_key,
    claim_key,
    grow_key,
    join_key,
    lost_key,
    members_key,
)
from phalanx.runtime.live import LiveGroup

__all__ = ["Membership", "Settings", "settings_from_env"]

_POLL_S = 0.05
"""The longest pause between two looks at the store while agreeing or waiting to join."""
_FIRST_POLL_S = 0.002
"""The first pause: an agreement is usually complete within milliseconds of the last
check-in, so the pauses start short and double up to _POLL_S (a fixed 0.05 s made every
change of members wait 0.05-0.1 s for nothing: docs/reliability.md)."""


def _pauses() -> Iterator[float]:
    pause = _FIRST_POLL_S
    while True:
        yield pause
        pause = min(_POLL_S, 2 * pause)


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
        self.store: LiveStore = group.live_store
        self.settings = settings
        self._generation_seen = 0
        """The highest generation read from GENERATION_KEY (a replayed older value is ignored)."""

    # ------------------------------------------------------------ survivors
    def next_generation(self, applied_step: int, reason: str) -> list[str]:
        """Leave the current generation and agree on the next one's members (in order)."""
        group = self.group
        old, gen = group.members, group.generation
        self.store.end_generation(gen, group.member, reason)
        self.store.put(checkin_key(gen + 1, group.member), json.dumps({"step": applied_step}))
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
        members = _member_list(self.store.read_json(key))
        pauses = _pauses()
        while members is None:
            waited = time.monotonic() - start
            arrived = [m for m in old if self._checked_in(gen, m)]
            lost = [m for m in old if m not in arrived and self._lost(m)]
            missing = [m for m in old if m not in arrived and m not in lost]
            if not missing or waited > self.settings.settle_s:
                proposal = arrived + [j for j in self._waiting_joiners() if j not in old]
                if len(proposal) >= self.settings.min_members:
                    members = _member_list(json.loads(self.store.first(key, json.dumps(proposal))))
                    break
                if waited > self.settings.quorum_timeout_s:
                    raise NoQuorum(self._short(gen, proposal, lost, missing))
            time.sleep(next(pauses))
            members = _member_list(self.store.read_json(key))
        if members is None:  # signed by a member, yet not a list of names: never expected
            raise NoQuorum(f"generation {gen}'s members could not be read — restart the run")
        self.store.put(GENERATION_KEY, str(gen))
        return members

    def _checked_in(self, gen: int, member: str) -> bool:
        entry = self.store.read_json(checkin_key(gen, member))
        return isinstance(entry, dict) and isinstance(entry.get("step"), int)

    def _lost(self, member: str) -> bool:
        return self.store.read(lost_key(member)) is not None

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
        """The replacements waiting to be let in: every claimed name j1, j2, ... (up to the
        first unclaimed) whose state is "waiting" and whose launcher has not lost it."""
        waiting, n = [], 1
        while self.store.read(claim_key(f"j{n}")) is not None:
            member = f"j{n}"
            if self.store.read(join_key(member)) == "waiting" and not self._lost(member):
                waiting.append(member)
            n += 1
        return waiting

    def ask_to_grow(self) -> None:
        """At a step boundary with a replacement waiting: end this generation for everyone."""
        raise self.group.lost("a replacement is waiting to join")

    # ------------------------------------------------------------ replacements
    def finish(self, step: int) -> None:
        """Training ended at `step` (every member says so): no replacement will be let in."""
        self.store.put(FINISHED_KEY, str(step))

    def join(self, member: str) -> tuple[int, list[str]]:
        """As replacement `member`: wait to be taken into a generation; (it, its members).

        When the run finishes first, this process has nothing to do: it says so and
        exits 0 (SystemExit), so that the rest of the script (a save, an upload) does not
        run on a replica that never trained."""
        self.store.put(join_key(member), "waiting")
        start, pauses = time.monotonic(), _pauses()
        while True:
            current = self._generation()
            for gen in (current, current + 1):  # the members may have moved on already
                members = _member_list(self.store.read_json(members_key(gen))) if gen else None
                if members is not None and member in members:
                    self.store.put(join_key(member), "joined")
                    return gen, members
            step = self.store.read(FINISHED_KEY)
            if step is not None:
                self.store.put(join_key(member), "finished")
                print(
                    f"[phalanx] replacement {member}: the run finished (step {step}) before it "
                    "could join; nothing to do",
                    file=sys.stderr,
                    flush=True,
                )
                raise SystemExit(0)
            self.store.first(grow_key(current), member)
            if time.monotonic() - start > self.settings.quorum_timeout_s:
                raise NoQuorum(
                    f"replacement {member} was not taken into the run within "
                    f"{self.settings.quorum_timeout_s:.0f} s (generation {current} goes on "
                    "without it) — check that the run is still training"
                )
            time.sleep(next(pauses))

    def _generation(self) -> int:
        """The members' generation, never going back (a stranger may replay an older value)."""
        read = self.store.read_int(GENERATION_KEY)
        if read is not None and read > self._generation_seen:
            self._generation_seen = read
        return self._generation_seen


def _member_list(value: Any) -> list[str] | None:
    """`value` as a list of member names, or None."""
    if isinstance(value, list) and value and all(isinstance(m, str) for m in value):
        return value
    return None


def settings_from_env(environ: dict[str, str] | None = None) -> Settings:
    """The settings `phalanx launch --live-recovery` passes its workers."""
    env = os.environ if environ is None else environ
    stall = float(env.get(STALL_ENV, Settings.settle_s))
    return Settings(
        min_members=int(env.get(MIN_MEMBERS_ENV, Settings.min_members)),
        settle_s=2 * stall,
        quorum_timeout_s=float(env.get(QUORUM_TIMEOUT_ENV, Settings.quorum_timeout_s)),
    )
