"""Typed errors raised by shadow. Every message says what to do about it."""

from __future__ import annotations

__all__ = [
    "BlobNotFoundError",
    "CorruptShadowError",
    "InvalidSessionIdError",
    "ShadowError",
    "ShadowStoreError",
    "TamperedShadowError",
    "UnauthenticatedShadowError",
]


class ShadowError(Exception):
    """Base class of every error shadow raises on purpose."""


class InvalidSessionIdError(ShadowError, ValueError):
    """A session id that could escape the store root or is not a plain name."""


class ShadowStoreError(ShadowError, RuntimeError):
    """A store URL that cannot be used, or a store operation that failed."""


class BlobNotFoundError(ShadowStoreError, FileNotFoundError):
    """An object the store does not hold."""


class CorruptShadowError(ShadowError, ValueError):
    """A manifest or index that is not valid JSON or misses required fields."""


class TamperedShadowError(CorruptShadowError):
    """A manifest or index whose MAC does not match its content under the configured key.

    Someone (or something) changed it after it was written, or it was written with
    another key; the session is refused and nothing of it is imported.
    """


class UnauthenticatedShadowError(ShadowError, PermissionError):
    """Authentication is required but missing: an unsigned manifest read with a key, a
    signed one read without a key, or an ``s3://`` store recovered without a key and
    without ``allow_unauthenticated``."""
