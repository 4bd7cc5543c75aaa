"""The names live recovery shares between the launcher (no torch) and the workers: the
store keys of its protocol and the environment the launcher sets (runtime/membership.py,
launch/live.py)."""

from __future__ import annotations

KEY = "phalanx/live/"
"""Every key of the protocol in the job's store starts so."""

LIVE_ENV = "PHALANX_LIVE_RECOVERY"
"""Set to "1" in every worker of a `phalanx launch --live-recovery` run."""
MEMBER_ENV = "PHALANX_LIVE_MEMBER"
"""A replacement's member name (`j<n>`); first workers are `r<rank>` and have none."""
STALL_ENV = "PHALANX_LIVE_STALL_S"
"""Seconds without a heartbeat after which the launcher fences a worker (and survivors stop
waiting for a member that neither checked in nor was reported lost)."""
MIN_MEMBERS_ENV = "PHALANX_LIVE_MIN_MEMBERS"
"""The fewest members the run goes on with."""
QUORUM_TIMEOUT_ENV = "PHALANX_LIVE_QUORUM_TIMEOUT_S"
"""How long survivors wait for that many members before they stop."""

RESTART_MARK = "live-restart"
"""A file in the progress directory: this run cannot go on without a lost rank (ZeRO's
shards), so a loss restarts the group from its checkpoint instead."""

HEARTBEAT_S = 0.5
"""How often a worker's heartbeat file is touched."""


GENERATION_KEY = f"{KEY}generation"
"""The generation the members last agreed on (absent: 0, the first workers)."""
FINISHED_KEY = f"{KEY}finished"
"""Set (to the last step) by the members when training ended: a replacement still waiting
to join has nothing to do, and exits 0 instead of waiting out its quorum timeout."""


def abort_key(generation: int) -> str:
    """Set when `generation` is over: a member saw a collective fail, a launcher lost one of
    its workers, or a replacement waits to join."""
    return f"{KEY}g{generation}/abort"


def members_key(generation: int) -> str:
    """The JSON list of `generation`'s members, in rank order (generation 0 has none: its
    members are the first workers, `r<rank>`)."""
    return f"{KEY}g{generation}/members"


def grow_key(generation: int) -> str:
    """Set by a replacement waiting to join while `generation` trains."""
    return f"{KEY}g{generation}/grow"


def lost_key(member: str) -> str:
    """Written by a member's launcher when it died or was fenced."""
    return f"{KEY}lost/{member}"


def heartbeat_name(member: str) -> str:
    """A worker's heartbeat file, in its progress directory (PHALANX_PROGRESS_DIR)."""
    return f"live-{member}.beat"


def checkin_key(generation: int, member: str) -> str:
    """A survivor's check-in for `generation`: JSON {"step": the steps it applied}."""
    return f"{KEY}g{generation}/in/{member}"


def claim_key(member: str) -> str:
    """Held by the launcher that took the replacement name `member` (`j<n>`): names are
    claimed in order, j1, j2, ..., each by one launcher, so the members find every
    replacement by reading the claims until the first one missing."""
    return f"{KEY}join/claim/{member}"


def join_key(member: str) -> str:
    """A replacement's state: "waiting" to be let in, then "joined"."""
    return f"{KEY}join/{member}"


def node_key(node_rank: int, what: str) -> str:
    """A node's entry (launch/livenodes.py): `members` (JSON list of the members its workers
    run as), `beat` (its launcher's count of signs of life), `lost` (how often the store's
    host declared it lost), `taken/<n>` (the launcher that took it over after loss n)."""
    return f"{KEY}node/{node_rank}/{what}"
