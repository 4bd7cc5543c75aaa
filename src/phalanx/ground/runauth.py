"""The run's secret, and the signed values of the live protocol (torch-free: the launcher and
the workers both sign and check).

The job's store (torch's TCPStore) lets anyone who reaches its port read and
write any key. So every value the live-recovery protocol reads is signed: an
HMAC-SHA256, keyed by the run's secret, over the run id, the key's name and the
value. A value that fails the check (a stranger's, garbage, a value copied from
another key) is ignored, as if absent, and logged once per key. The secret never
travels through the store: the launcher makes one per run (one node) or is given
one (`PHALANX_RUN_SECRET`, or `--run-secret-file` on every node), and hands it to
its workers in their environment. Threat model: docs/reliability.md, "Who can
steer a run".
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from phalanx.errors import ConfigurationError

__all__ = ["SECRET_ENV", "RunKey", "new_secret", "read_secret_file"]

SECRET_ENV = "PHALANX_RUN_SECRET"
"""The run's secret: set by the launcher in every worker's environment (and read by the
launcher itself when the user gives one)."""

TAG_BYTES = 32
"""An HMAC-SHA256 tag."""
_SEPARATOR = b"."
_HEX_TAG = 2 * TAG_BYTES

logger = logging.getLogger("phalanx.runauth")


def new_secret() -> str:
    """A fresh secret for one run (256 bits, hex)."""
    return secrets.token_hex(32)


def read_secret_file(path: str) -> str:
    """The secret in `path` (its first line), refusing a file others may read."""
    file = Path(path)
    try:
        mode = file.stat().st_mode
        text = file.read_text().strip()
    except OSError as exc:
        raise ConfigurationError(
            f"--run-secret-file {path}: cannot read it ({exc.strerror}) — give a file this "
            "user can read, the same on every node"
        ) from exc
    if mode & 0o077:
        raise ConfigurationError(
            f"--run-secret-file {path} can be read by others (mode {mode & 0o777:o}) — "
            f"chmod 600 {path}"
        )
    if len(text) < 16:
        raise ConfigurationError(
            f"--run-secret-file {path} holds {len(text)} characters; a secret needs at least "
            "16 — write one with: openssl rand -hex 32"
        )
    return text


@dataclass
class RunKey:
    """Signs and checks the live protocol's store values for one run."""

    secret: str
    run_id: str
    _key: bytes = field(init=False, repr=False)
    _rejected: set[str] = field(default_factory=set, init=False, repr=False)
    """Keys whose bad value was already logged (once each)."""

    def __post_init__(self) -> None:
        self._key = hmac.new(
            self.secret.encode(), b"phalanx-live/" + self.run_id.encode(), hashlib.sha256
        ).digest()

    def __repr__(self) -> str:  # never print the secret
        return f"RunKey(run_id={self.run_id!r})"

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> RunKey:
        """The key the launcher handed this worker; a one-line error when there is none."""
        env = os.environ if environ is None else environ
        secret = env.get(SECRET_ENV, "")
        if not secret:
            raise ConfigurationError(
                f"live recovery needs the run's secret ({SECRET_ENV}), which phalanx launch "
                "sets in every worker — start the script with phalanx launch --live-recovery"
            )
        return cls(secret, env.get("TORCHELASTIC_RUN_ID", "none"))

    def tag(self, *parts: bytes) -> bytes:
        """The HMAC of `parts` (each length-prefixed, so no two tuples share a tag)."""
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(len(part).to_bytes(8, "little"))
            mac.update(part)
        return mac.digest()

    def sign(self, key: str, value: str | bytes) -> bytes:
        """The store value for `key`: its tag (hex), a dot, then the value."""
        data = value.encode() if isinstance(value, str) else value
        return self.tag(key.encode(), data).hex().encode() + _SEPARATOR + data

    def open(self, key: str, raw: bytes | None) -> bytes | None:
        """The value signed for `key`, or None (absent, or not signed by this run: logged
        once per key)."""
        if raw is None:
            return None
        tag, sep, data = raw.partition(_SEPARATOR)
        if sep and len(tag) == _HEX_TAG:
            try:
                expected = bytes.fromhex(tag.decode("ascii"))
            except (UnicodeDecodeError, ValueError):
                expected = b""
            if hmac.compare_digest(expected, self.tag(key.encode(), data)):
                return data
        self.reject(key, raw)
        return None

    def open_text(self, key: str, raw: bytes | None) -> str | None:
        data = self.open(key, raw)
        if data is None:
            return None
        try:
            return data.decode()
        except UnicodeDecodeError:
            self.reject(key, raw or b"")
            return None

    def reject(self, key: str, raw: bytes, why: str = "not signed with this run's secret") -> None:
        """Log once per key that its value was ignored."""
        if key in self._rejected:
            return
        self._rejected.add(key)
        shown = raw[:40]
        logger.warning(
            "phalanx live recovery: ignored %s=%r (%d bytes): %s — someone who is not part "
            "of this run can reach the store's port; keep it on a private network",
            key,
            shown,
            len(raw),
            why,
        )
