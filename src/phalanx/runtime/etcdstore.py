"""The workers' c10d store when the job's store is etcd (`phalanx launch --rdzv-backend etcd`).

torch's TCPStore lives in one process, so the host that serves it is a single
point of failure: lose it and every rank of the job dies. `EtcdStore` is a
`torch.distributed.Store` written in Python over the torch-free etcd client
(ground/etcd.py), so the store survives the loss of any minority of etcd's
members. `init_process_group`, gloo's rendezvous of every live generation (through
a `PrefixStore` over it) and the live protocol (ground/live_store.py) use it as
they use a TCPStore: `set`; `get`, which waits for the key as torch's stores do;
`add` and `compare_set`, each one transaction; `check`, `wait`, `delete_key`,
`num_keys`. A blocking wait polls (every 10 ms at first, then less often): a store
is used to meet, not in the step. When no etcd member answers for
PHALANX_ETCD_TIMEOUT_S every call raises `StoreLost` (errors.py).
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from phalanx.errors import ConfigurationError
from phalanx.ground.etcd import (
    ENDPOINTS_ENV,
    LEASE_ENV,
    PREFIX_ENV,
    TIMEOUT_ENV,
    Etcd,
    EtcdKV,
    parse_endpoints,
)

__all__ = ["EtcdStore", "etcd_store_from_env"]

_POLLS_S = (0.01, 0.02, 0.05, 0.1)
_DEFAULT_TIMEOUT_S = 60.0


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdStore(dist.Store):
    """A c10d store over etcd (module docstring); safe to use from several threads."""

    def __init__(
        self,
        endpoints: tuple[str, ...],
        prefix: str,
        lease: int,
        timeout: timedelta,
        unavailable_s: float = _DEFAULT_TIMEOUT_S,
    ) -> None:
        """`timeout`: how long `get` and `wait` wait for a key (torch's store timeout);
        `unavailable_s`: how long etcd may answer nothing before every call is `StoreLost`."""
        super().__init__()
        self.wait_timeout = timeout
        super().set_timeout(timeout)
        self.endpoints, self.prefix, self.lease = endpoints, prefix, lease
        self.unavailable_s = unavailable_s
        self.kv = EtcdKV(Etcd(endpoints, unavailable_s), prefix, lease)
        # torch holds a Python store from C++ (a PrefixStore over it, the default group's
        # store) without a Python reference, and pybind11 then loses the Python half: every
        # call fails with "Not implemented". Closing at exit keeps it alive until then.
        atexit.register(self.close)

    def set_timeout(self, timeout: timedelta) -> None:
        """How long `get` and `wait` wait (torch's own stubs do not show `timeout`)."""
        self.wait_timeout = timeout
        super().set_timeout(timeout)

    def close(self) -> None:
        """Close this thread's connections to etcd."""
        self.kv.close()

    def clone(self) -> EtcdStore:
        """Another store over the same keys (its own connections)."""
        return EtcdStore(
            self.endpoints, self.prefix, self.lease, self.wait_timeout, self.unavailable_s
        )

    def set(self, key: str, value: bytes | str) -> None:
        self.kv.set(key, _bytes(value))

    def get(self, key: str) -> bytes:
        """The value of `key` once it exists; DistStoreError after the store's timeout."""
        self._wait_for([key], self.wait_timeout)
        return self.kv.get(key)

    def add(self, key: str, amount: int) -> int:
        return self.kv.add(key, int(amount))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self.kv.compare_set(key, _bytes(expected), _bytes(desired))

    def check(self, keys: list[str]) -> bool:
        return self.kv.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_for(keys, self.wait_timeout if timeout is None else timeout)

    def delete_key(self, key: str) -> bool:
        return self.kv.delete(key)

    def num_keys(self) -> int:
        return self.kv.num_keys()

    def has_extended_api(self) -> bool:
        """No multi_get/multi_set/append: a PrefixStore over us asks (and torch's default
        answer for a Python store is an internal assert)."""
        return False

    def _wait_for(self, keys: list[str], timeout: timedelta) -> None:
        seconds = timeout.total_seconds()
        deadline = time.monotonic() + seconds
        polls = 0
        while not self.kv.check(keys):
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(
                    f"etcd store: waited {seconds:g}s for {', '.join(keys)} under "
                    f"{self.prefix} — a rank that should have written it is missing"
                )
            time.sleep(_POLLS_S[min(polls, len(_POLLS_S) - 1)])
            polls += 1


def etcd_store_from_env(environ: Mapping[str, str], timeout: timedelta) -> EtcdStore | None:
    """The etcd store the launcher named in the worker's environment; None when it named
    none (the store is a TCPStore)."""
    endpoints = environ.get(ENDPOINTS_ENV, "")
    if not endpoints:
        return None
    prefix = environ.get(PREFIX_ENV, "")
    if not prefix:
        raise ConfigurationError(
            f"{ENDPOINTS_ENV} is set but {PREFIX_ENV} is not — start the workers with "
            "phalanx launch --rdzv-backend etcd, which sets both"
        )
    try:
        lease = int(environ.get(LEASE_ENV, "0") or 0)
        unavailable_s = float(environ.get(TIMEOUT_ENV, _DEFAULT_TIMEOUT_S))
    except ValueError as exc:
        raise ConfigurationError(
            f"{LEASE_ENV} or {TIMEOUT_ENV} is not a number ({exc}) — start the workers with "
            "phalanx launch --rdzv-backend etcd"
        ) from exc
    return EtcdStore(parse_endpoints(endpoints), prefix, lease, timeout, unavailable_s)
