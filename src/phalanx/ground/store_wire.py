"""torch's TCPStore wire protocol, as both of phalanx's torch-free ends speak it: the
launcher's client (storeclient.py) and the store it serves (storeserver.py).

torch/csrc/distributed/c10d/TCPStoreBackend.hpp and TCPStoreLibUvBackend.cpp: a
request is a command byte, then native-endian fixed-size integers and byte strings
prefixed by their u64 length; a connection opens with VALIDATE and the magic number.
"""

from __future__ import annotations

import struct
from enum import IntEnum

__all__ = ["MAGIC", "Incomplete", "Query", "Reader", "Refused", "sized"]

MAGIC = 0x3C85F7CE
"""c10d::detail::validationMagicNumber."""


class Query(IntEnum):
    """c10d::detail::QueryType, in the order torch declares it."""

    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST_KEYS = 17
    BARRIER = 18


READY, NOT_READY = b"\x00", b"\x01"
"""CheckResponseType."""
STOP_WAITING, WAIT_CANCELED = b"\x00", b"\x01"
"""WaitResponseType."""

# torch's server's limits (TCPStoreLibUvBackend.cpp), which ours keeps.
MAX_KEY = 8 * 1024
MAX_PAYLOAD = 8 * 1024 * 1024
MAX_KEYS = 128 * 1024

U32, U64, I64 = struct.Struct("=I"), struct.Struct("=Q"), struct.Struct("=q")


def sized(data: bytes) -> bytes:
    """A byte string as the protocol sends one: its u64 length, then the bytes."""
    return U64.pack(len(data)) + data


class Incomplete(Exception):
    """The request is not all here yet: wait for more bytes."""


class Refused(Exception):
    """The peer broke the protocol: its connection is closed."""


class Reader:
    """Reads one request from the front of a buffer; raises `Incomplete` past its end, and
    `Refused` for a string or a count past torch's limits."""

    def __init__(self, data: bytearray) -> None:
        self._data = data
        self.pos = 0

    def take(self, size: int) -> bytes:
        end = self.pos + size
        if end > len(self._data):
            raise Incomplete
        chunk = bytes(self._data[self.pos : end])
        self.pos = end
        return chunk

    def u32(self) -> int:
        return int(U32.unpack(self.take(4))[0])

    def u64(self) -> int:
        return int(U64.unpack(self.take(8))[0])

    def i64(self) -> int:
        return int(I64.unpack(self.take(8))[0])

    def _sized(self, limit: int, what: str) -> bytes:
        size = self.u64()
        if size > limit:
            raise Refused(f"{what} of {size} bytes (at most {limit})")
        return self.take(size)

    def key(self) -> bytes:
        return self._sized(MAX_KEY, "a key")

    def payload(self) -> bytes:
        return self._sized(MAX_PAYLOAD, "a value")

    def count(self) -> int:
        """How many keys a request names (at most torch's limit)."""
        count = self.u64()
        if count > MAX_KEYS:
            raise Refused(f"{count} keys in one request (at most {MAX_KEYS})")
        return count

    def keys(self) -> list[bytes]:
        return [self.key() for _ in range(self.count())]
