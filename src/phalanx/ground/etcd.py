"""A torch-free client of etcd's v3 API over its JSON gateway (the standard library's HTTP).

`phalanx launch --rdzv-backend etcd` keeps the job's keys in etcd, a store
replicated over its members by Raft, instead of in one launcher's TCPStore: the
launchers meet there, the workers' c10d store is a view of it
(runtime/etcdstore.py), and live recovery agrees there. The launcher imports no
torch and etcd's Python packages are unmaintained, so this speaks the gateway
every etcd 3.4+ member serves beside gRPC (`POST /v3/kv/range`, `/v3/kv/put`,
`/v3/kv/txn`, `/v3/kv/deleterange`, `/v3/lease/*`; keys and values base64).

`Etcd` is the connection: one keep-alive HTTP connection per thread to the member
that answered last; a member that refuses, resets or does not answer within
`_REQUEST_S` is skipped for the next. When no member answers for `timeout_s`
(a majority is down: a member without a leader answers nothing but "request
timed out", after 7 s), every call raises `StoreLost`, in one line that names
each member and what it said. `EtcdKV` is one run's view: a key prefix, the
run's lease on every key it writes, and the operations torch's TCPStore has
(`set`, `get`, `check`, `compare_set`, `add`, `delete`), so the launcher's code
that meets through a TCPStore meets through etcd as it is.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from phalanx.errors import ConfigurationError, StoreLost

__all__ = [
    "ENDPOINTS_ENV",
    "LEASE_ENV",
    "PREFIX_ENV",
    "TIMEOUT_ENV",
    "Etcd",
    "EtcdKV",
    "NotEtcd",
    "parse_endpoints",
]

ENDPOINTS_ENV = "PHALANX_ETCD_ENDPOINTS"
"""The etcd members, HOST:PORT,...: set in every worker of a run whose store is etcd."""
PREFIX_ENV = "PHALANX_ETCD_PREFIX"
"""The key prefix of the worker's attempt: its c10d store's keys live under it."""
LEASE_ENV = "PHALANX_ETCD_LEASE"
"""The run's lease: every key the run writes expires with it once no launcher keeps it."""
TIMEOUT_ENV = "PHALANX_ETCD_TIMEOUT_S"
"""How long no member may answer before the store counts as lost (--rdzv-conf read_timeout)."""

DEFAULT_PORT = 2379
_REQUEST_S = 1.0
"""One request's bound, then the next member is asked: a member without a leader answers
only after 7 s, in vain, and one whose host vanished never (no reset comes). etcd answers
in milliseconds, and every request is safe to ask again (a put, a compare on a revision);
so a lost member costs the launchers' beats (every 0.5 s) about a second, not three, which
--live-stall-timeout (2 s in the tests) would take for a lost node."""
_BACKOFF_S = (0.05, 0.1, 0.2, 0.5)
_POLL_S = 0.05
_ADD_MARKS = b"\0phalanx-add/"
"""Where `EtcdKV.add` leaves its markers: outside every view's prefix (no view counts them),
under the view's lease (they go with the run's keys)."""
_RETRYABLE = {1, 2, 4, 8, 14}
"""gRPC codes worth asking another member (or again): cancelled, unknown ("context deadline
exceeded"), deadline exceeded, resource exhausted, unavailable ("no leader", "timed out")."""


class NotEtcd(OSError):
    """Something answered at an endpoint, but not as etcd's v3 gateway does."""


def parse_endpoints(text: str) -> tuple[str, ...]:
    """`h1:2379,h2:2379,[::1]:2379` (http:// allowed, port 2379 when left out) as HOST:PORT."""
    found = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item.startswith("https://"):
            raise ConfigurationError(
                f"--rdzv-endpoint {item}: phalanx speaks plain HTTP to etcd — keep etcd's client "
                "port on the job's private network and give http:// or HOST:PORT"
            )
        item = item.removeprefix("http://").rstrip("/")
        host, colon, port = item.rpartition(":")
        if not colon or (host.count(":") and not host.endswith("]")):
            host, port = item, str(DEFAULT_PORT)
        if not host or not port.isdigit():
            raise ConfigurationError(
                f"--rdzv-endpoint {item!r} is not HOST:PORT — e.g. 10.0.0.1:2379,10.0.0.2:2379"
            )
        found.append(f"{host}:{int(port)}")
    if not found:
        raise ConfigurationError("--rdzv-endpoint names no etcd member — e.g. h1:2379,h2:2379")
    return tuple(found)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with `prefix` (etcd's range_end)."""
    data = bytearray(prefix)
    while data:
        if data[-1] < 0xFF:
            data[-1] += 1
            return bytes(data)
        data.pop()
    return b"\0"


class Etcd:
    """Calls to an etcd cluster, from any thread, over whichever member answers (docstring)."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float) -> None:
        self.endpoints = tuple(endpoints)
        self.timeout_s = timeout_s
        self._good = 0
        self._local = threading.local()

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST `body` to `/v3/<path>` on a member that answers; `StoreLost` after `timeout_s`
        without one."""
        data = json.dumps(body).encode()
        deadline = time.monotonic() + self.timeout_s
        seen: dict[str, str] = {}
        for attempt in range(1_000_000):
            start = self._good
            for k in range(len(self.endpoints)):
                index = (start + k) % len(self.endpoints)
                left = max(0.1, min(_REQUEST_S, deadline - time.monotonic()))
                reply = self._try(index, path, data, left, seen)
                if reply is not None:
                    self._good = index
                    return reply
            if time.monotonic() >= deadline:
                break
            time.sleep(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)])
        said = "; ".join(f"{ep}: {why}" for ep, why in seen.items())
        raise StoreLost(
            f"the job's store, etcd at {','.join(self.endpoints)}, has not answered for "
            f"{self.timeout_s:g}s ({said}) — a majority of its members is down or cut off; "
            "bring them back, then start the run again (it resumes from its last checkpoint)"
        )

    def _try(
        self, index: int, path: str, data: bytes, timeout_s: float, seen: dict[str, str]
    ) -> dict[str, Any] | None:
        """One member's answer, or None (and `seen` says why) when it has none to give."""
        endpoint = self.endpoints[index]
        try:
            status, raw = self._post(index, path, data, timeout_s)
        except (OSError, http.client.HTTPException) as exc:
            self._drop(index)
            seen[endpoint] = str(exc) or type(exc).__name__
            return None
        try:
            reply = json.loads(raw)
        except ValueError:
            raise NotEtcd(
                f"{endpoint} answered {raw[:60]!r} (HTTP {status}), not as etcd's v3 gateway"
            ) from None
        error = reply.get("error") if isinstance(reply, dict) else None
        if error is None and status == 200:
            return reply.get("result", reply)  # lease/keepalive wraps its answer in "result"
        detail = error if isinstance(error, dict) else reply
        code = detail.get("code", detail.get("grpc_code", -1))
        message = str(detail.get("message", error))
        if code in _RETRYABLE or status in (502, 503, 504):
            seen[endpoint] = message
            return None
        raise RuntimeError(f"etcd at {endpoint} refused /v3/{path}: {message} (code {code})")

    def _post(self, index: int, path: str, data: bytes, timeout_s: float) -> tuple[int, bytes]:
        connections: dict[int, http.client.HTTPConnection] = self._local.__dict__.setdefault(
            "connections", {}
        )
        conn = connections.get(index)
        if conn is None:
            host, _, port = self.endpoints[index].rpartition(":")
            conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout_s)
            connections[index] = conn
        conn.timeout = timeout_s
        if conn.sock is not None:
            conn.sock.settimeout(timeout_s)
        conn.request("POST", f"/v3/{path}", data, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()

    def _drop(self, index: int) -> None:
        connections = self._local.__dict__.get("connections", {})
        conn = connections.pop(index, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Close this thread's connections (another thread's close with it)."""
        for index in list(self._local.__dict__.get("connections", {})):
            self._drop(index)

    # ------------------------------------------------------------ leases
    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (its id, the TTL etcd granted; at least its minimum, 2 s here)."""
        reply = self.call("lease/grant", {"TTL": ttl_s})
        return int(reply["ID"]), int(reply.get("TTL", ttl_s))

    def keepalive(self, lease: int) -> int:
        """Renew `lease`: its TTL, or 0 when it has expired (its keys are gone)."""
        return int(self.call("lease/keepalive", {"ID": str(lease)}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        with contextlib.suppress(RuntimeError):  # expired already: nothing left to revoke
            self.call("lease/revoke", {"ID": str(lease)})


class EtcdKV:
    """One run's keys in etcd: what a TCPStore client offers, under `prefix` (docstring)."""

    def __init__(self, etcd: Etcd, prefix: str, lease: int = 0) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self.lease = lease
        self.address = f"etcd {','.join(etcd.endpoints)} ({prefix})"

    def view(self, sub: str) -> EtcdKV:
        """The keys under `sub` inside this view, over the same connection and lease."""
        return EtcdKV(self.etcd, self.prefix + sub, self.lease)

    def __enter__(self) -> EtcdKV:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.etcd.close()

    def _key(self, key: str) -> str:
        return _b64((self.prefix + key).encode())

    def _put(self, key: str, value: bytes) -> dict[str, Any]:
        put: dict[str, Any] = {"key": self._key(key), "value": _b64(value)}
        if self.lease:
            put["lease"] = str(self.lease)
        return put

    def _kv(self, key: str) -> dict[str, Any] | None:
        kvs = self.etcd.call("kv/range", {"key": self._key(key)}).get("kvs") or []
        return kvs[0] if kvs else None

    def set(self, key: str, value: bytes) -> None:
        self.etcd.call("kv/put", self._put(key, value))

    def read(self, key: str) -> bytes | None:
        """The value of `key`, or None when absent."""
        kv = self._kv(key)
        return None if kv is None else _unb64(kv.get("value"))

    def get(self, key: str) -> bytes:
        """The value of an existing `key` (KeyError when absent, as a TCPStore errs)."""
        value = self.read(key)
        if value is None:
            raise KeyError(key)
        return value

    def check(self, keys: Sequence[str]) -> bool:
        """True when every key exists, without waiting (one round trip for them all)."""
        ranges = [{"request_range": {"key": self._key(k), "count_only": True}} for k in keys]
        reply = self.etcd.call("kv/txn", {"success": ranges})
        counts = [int(r["response_range"].get("count", 0)) for r in reply.get("responses", [])]
        return len(counts) == len(keys) and all(counts)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """torch's compare_set: `desired` replaces `expected` (b"": absent) atomically; the value
        `key` holds afterwards (`expected` when absent and not replaced, as torch's store)."""
        target = self._key(key)
        compare = (
            {"key": target, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
            if not expected
            else {"key": target, "target": "VALUE", "result": "EQUAL", "value": _b64(expected)}
        )
        reply = self.etcd.call(
            "kv/txn",
            {
                "compare": [compare],
                "success": [{"request_put": self._put(key, desired)}],
                "failure": [{"request_range": {"key": target}}],
            },
        )
        if reply.get("succeeded"):
            return desired
        kvs = reply["responses"][0]["response_range"].get("kvs") or []
        return _unb64(kvs[0].get("value")) if kvs else expected

    def add(self, key: str, amount: int) -> int:
        """Add to the counter `key` (0 when new; decimal text, as torch's store keeps it) and
        return its new value: a read, then a put on condition that no one wrote in between."""
        while True:
            kv = self._kv(key)
            now = int(_unb64(kv.get("value")) or b"0") if kv else 0
            if amount == 0:  # a read: no write, so a poll of a counter costs one range
                return now
            if self.added(self.etcd.call("kv/txn", self.add_txn(key, kv, now + amount))):
                return now + amount

    def add_txn(self, key: str, kv: dict[str, Any] | None, value: int) -> dict[str, Any]:
        """The transaction that makes `key` `value` unless someone wrote it since `kv`; it
        also writes a marker of its own, so that when `Etcd.call` sends it again (the first
        answer was lost, or came after `_REQUEST_S`) the second reads as the first's
        success, not as a conflict to add again after."""
        target = self._key(key)
        if kv is None:
            compare = {"key": target, "target": "CREATE", "create_revision": "0"}
        else:
            compare = {"key": target, "target": "MOD", "mod_revision": kv["mod_revision"]}
        marker: dict[str, Any] = {"key": _b64(_ADD_MARKS + secrets.token_bytes(12))}
        put_marker = {**marker, "value": _b64(b"1")}
        if self.lease:
            put_marker["lease"] = str(self.lease)
        return {
            "compare": [{**compare, "result": "EQUAL"}],
            "success": [
                {"request_put": self._put(key, b"%d" % value)},
                {"request_put": put_marker},
            ],
            "failure": [{"request_range": marker}],
        }

    @staticmethod
    def added(reply: dict[str, Any]) -> bool:
        """Whether `add_txn`'s transaction (this sending of it, or an earlier one) wrote the
        counter; False: someone else wrote it first, so read it and try again."""
        if reply.get("succeeded"):
            return True
        kvs = reply["responses"][0]["response_range"].get("kvs") or []
        return bool(kvs)

    def delete(self, key: str) -> bool:
        reply = self.etcd.call("kv/deleterange", {"key": self._key(key)})
        return int(reply.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        """How many keys this view holds."""
        start = (self.prefix).encode()
        body = {"key": _b64(start), "range_end": _b64(prefix_end(start)), "count_only": True}
        return int(self.etcd.call("kv/range", body).get("count", 0))

    def wait_for(
        self, keys: Sequence[str], timeout_s: float, cancelled: Callable[[], bool] = lambda: False
    ) -> bool:
        """Poll until every key exists (True), or `timeout_s` passes or `cancelled()` (False)."""
        deadline = time.monotonic() + timeout_s
        while not self.check(keys):
            if time.monotonic() >= deadline or cancelled():
                return False
            time.sleep(_POLL_S)
        return True

    def wait_for_count(
        self,
        key: str,
        count: int | Callable[[], int],
        timeout_s: float,
        cancelled: Callable[[], bool],
    ) -> bool:
        """Poll until counter `key` reaches `count` (asked again each poll when callable)."""
        deadline = time.monotonic() + timeout_s
        while self.add(key, 0) < (count() if callable(count) else count):
            if time.monotonic() >= deadline or cancelled():
                return False
            time.sleep(_POLL_S)
        return True
