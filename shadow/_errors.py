"""Typed errors raised by shadow. Every message says what to do about it."""

from __future__ import annotations

__all__ = [
    "BlobNotFoundError",
    "BlobTooLargeError",
    "CorruptShadowError",
    "InvalidKeyError",
    "InvalidSessionIdError",
    "RollbackShadowError",
    "ShadowError",
    "ShadowStoreError",
    "TamperedShadowError",
    "UnauthenticatedShadowError",
]


class ShadowError(Exception):
    """Base class of every error shadow raises on purpose."""


class InvalidSessionIdError(ShadowError, ValueError):
    """A session id that could escape the store root or is not a plain name."""


class InvalidKeyError(ShadowError, ValueError):
    """A MAC key that cannot be used (not valid UTF-8 text); the message names where it
    came from."""


class ShadowStoreError(ShadowError, RuntimeError):
    """A store URL that cannot be used, or a store operation that failed."""


class BlobNotFoundError(ShadowStoreError, FileNotFoundError):
    """An object the store does not hold."""


class BlobTooLargeError(ShadowError, ValueError):
    """An object larger than the reader allows (:meth:`ShadowStore.get_limited`); nothing
    of it was read. ``size`` is its size when the store said (else -1)."""

    def __init__(self, message: str, size: int = -1) -> None:
        super().__init__(message)
        self.size = size


class CorruptShadowError(ShadowError, ValueError):
    """A manifest or index that is not valid JSON or misses required fields."""


class TamperedShadowError(CorruptShadowError):
    """A manifest or index whose MAC does not match its content under the configured key.

    Someone (or something) changed it after it was written, or it was written with
    another key; the session is refused and nothing of it is imported.
    """


class RollbackShadowError(TamperedShadowError):
    """A manifest older than the newest generation the store records for its session.

    ``head.json`` (written after every commit) or ``index.json`` name a later generation:
    an older copy of the manifest was put back (a replay, or a restore from a backup).
    Its MAC may check out; it is still refused unless the operator accepts the older
    state (``accept_rollback=True``, ``contextkit recover --accept-rollback``).
    """


class UnauthenticatedShadowError(ShadowError, PermissionError):
    """Authentication is required but missing: an unsigned manifest read with a key, a
    signed one read without a key, or an ``s3://`` store recovered without a key and
    without ``allow_unauthenticated``."""
