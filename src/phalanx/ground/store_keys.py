"""Every key phalanx writes in a job's store, in one place; and the environment live
recovery sets beside them.

The launchers (no torch) and the workers meet in one c10d store (or in etcd,
under `phalanx/<run id>/`); a key they both read is named here once, so that a
reader of the protocol, or of what an attacker with the store's address could
write (tests/faults/test_live_attacked.py), has one module to read.
"""

from __future__ import annotations

# ----------------------------------------------------------- the launch and rendezvous

ATTEMPT_KEY = "phalanx/attempt"
"""The launchers' attempt (restart) number, set by the store's host: a worker of an older
attempt that connects late must not join this one."""
OWNER_KEY = "phalanx/rank0"
"""Set by rank 0's `init`: the world size it expects, and who it is (runtime/store.py)."""
LEFT_KEY = "phalanx/left"
"""Counts the launchers that finished, so the store's host closes the store last."""
PRESENT = "phalanx/present/"
"""The roll call's prefix (launch/rollcall.py): `<node>`, `<node>/seen`, `count`, `seen`,
`all`."""
PRESENT_COUNT = f"{PRESENT}count"
"""Counts the nodes that marked themselves present."""
SEEN = "/seen"
"""Appended to a node's roll-call key once it saw that all are present."""
PRESENT_SEEN = f"{PRESENT}seen"
"""Counts the nodes that saw it."""
ALL_HERE_KEY = f"{PRESENT}all"
"""Set by the store's host once every node of the attempt is here."""
ETCD_LEASE = "lease"
"""Under an etcd run's base: the run's lease id, which every launcher keeps alive."""


def joined_key(rank: int) -> str:
    """Set by a worker's `init` once it reached the store: the world size it was given."""
    return f"phalanx/joined/{rank}"


def node_rank_key(node_rank: int) -> str:
    """Counts the launchers that claimed a static `--node-rank`: more than one is an error;
    `<key>/host` names the first."""
    return f"phalanx/node_rank/{node_rank}"


def rendezvous_prefix(run_id: str) -> str:
    """c10d rendezvous of run `run_id`: `<prefix>/joined` counts the nodes that joined,
    `<prefix>/node/<n>` names node n's host."""
    return f"phalanx/rdzv/{run_id}"


def etcd_base(run_id: str) -> str:
    """Where every key of an etcd run lives (launch/etcdmeet.py)."""
    return f"phalanx/{run_id}/"


# ----------------------------------------------------------------------- live recovery

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

RESTART_KEY = f"{KEY}restart"
"""In a run over several nodes: why a launcher restarts its worker group (RESTART_MARK, or a
loss before the first group formed), so that every node's launcher restarts its own with
it; each one that saw it adds `<RESTART_KEY>/ack/<node rank>` (launch/live.py)."""

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
