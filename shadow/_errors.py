"""Typed errors raised by shadow. Every message says what to do about it."""

from __future__ import annotations

__all__ = [
    "BlobNotFoundError",
    "CorruptShadowError",
    "InvalidSessionIdError",
    "ShadowError",
    "ShadowStoreError",
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
