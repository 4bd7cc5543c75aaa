"""One family of errors, so a user can catch everything phalanx raises on purpose.

Messages follow "what is wrong — what to do".
"""

from __future__ import annotations


class PhalanxError(RuntimeError):
    """Base class of every error phalanx raises deliberately."""


class ConfigurationError(PhalanxError, ValueError):
    """A value the user passed (argument, environment variable) cannot work."""


class ReducerError(PhalanxError):
    """The gradient reducer saw a state that would give wrong gradients or a hang."""
