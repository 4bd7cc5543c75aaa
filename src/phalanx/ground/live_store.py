"""The live protocol's view of the job's store: every value signed and checked (torch-free).

Workers hold torch's TCPStore, launchers the torch-free `StoreClient`; both have
`set`, `get`, `check` and `compare_set`, and both go through `LiveStore`, so no
value of the protocol is read without its signature checked (ground/runauth.py).
A stranger's value reads as absent. A key that a member must claim first
(`first`) is won by compare-and-set, and a stranger's garbage there is swapped
out rather than taken as an answer; a store that keeps being overwritten ends in
one line (`StoreTampered`) instead of a loop.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from phalanx.errors import StoreTampered
from phalanx.ground.runauth import RunKey
from phalanx.ground.store_keys import abort_key

__all__ = ["KeyValue", "LiveStore", "StoreConn"]

ABORT_REASON_BYTES = 400
"""The longest reason a generation's end records (a store value, read by every member)."""
_CLAIM_TRIES = 8


class KeyValue(Protocol):
    """What torch's TCPStore and the launcher's StoreClient both offer."""

    def set(self, key: str, value: bytes, /) -> None: ...

    def get(self, key: str, /) -> bytes: ...

    def check(self, keys: list[str], /) -> bool: ...

    def compare_set(self, key: str, expected: bytes, desired: bytes, /) -> bytes: ...


class StoreConn(KeyValue, Protocol):
    """A launcher's connection to the job's store: to a launcher's TCPStore (`StoreClient`)
    or to etcd (`EtcdKV`, --rdzv-backend etcd), which the launchers' code uses alike."""

    address: str

    def add(self, key: str, amount: int, /) -> int: ...

    def close(self) -> None: ...

    def __enter__(self) -> StoreConn: ...

    def __exit__(self, *exc: object) -> None: ...


class LiveStore:
    """Signed reads and writes of the live protocol's keys."""

    def __init__(self, store: KeyValue, key: RunKey) -> None:
        self.store = store
        self.key = key

    def put(self, key: str, value: str) -> None:
        self.store.set(key, self.key.sign(key, value))

    def read(self, key: str) -> str | None:
        """The signed value of `key`; None when absent or not this run's."""
        if not self.store.check([key]):
            return None
        return self.key.open_text(key, self.store.get(key))

    def read_json(self, key: str) -> Any:
        text = self.read(key)
        if text is None:
            return None
        try:
            return json.loads(text)
        except ValueError:  # signed, so ours: a bug, but never a crash
            self.key.reject(key, text.encode(), "signed, but not JSON")
            return None

    def read_int(self, key: str) -> int | None:
        text = self.read(key)
        if text is None:
            return None
        try:
            return int(text)
        except ValueError:
            self.key.reject(key, text.encode(), "signed, but not a number")
            return None

    def first(self, key: str, value: str) -> str:
        """Claim `key` with `value` unless this run already holds a value there; the value
        that holds it afterwards (ours, or the first member's)."""
        desired = self.key.sign(key, value)
        expected = b""
        for _ in range(_CLAIM_TRIES):
            current = self.store.compare_set(key, expected, desired)
            text = self.key.open_text(key, current)
            if text is not None:
                return text
            expected = current  # a stranger's value: swap exactly it out
        raise StoreTampered(
            f"the store key {key} keeps being overwritten by someone outside this run — keep "
            "the store's port on a private network (docs/reliability.md, 'Who can steer a run')"
        )

    def end_generation(self, generation: int, who: str, reason: str) -> str:
        """End `generation` for every member: the one way a generation ends (a member saw a
        collective fail, a survivor moves on, a launcher lost a worker). The first reason
        written stays, and is the one returned; it is cut to `ABORT_REASON_BYTES`."""
        return self.first(abort_key(generation), f"{who}: {reason}"[:ABORT_REASON_BYTES])

    def claimed(self, key: str, value: str) -> bool:
        """Whether `first(key, value)` made `value` the holder (so that two claimants of one
        key never both win)."""
        return self.first(key, value) == value
