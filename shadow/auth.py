"""Keys of authenticated shadows: where the MAC key comes from, and how to describe it.

A shadow's manifests and index carry an HMAC-SHA256 over their whole content when a
key is configured. The key is per deployment: every writer and every reader of a store
must hold the same one. It comes from configuration (``ShadowConfig.auth_key``, a
recovery argument) or, when none is given, from the environment variable
:data:`KEY_ENV` (``CONTEXTKIT_SHADOW_KEY``).
"""

from __future__ import annotations

import hashlib
import os

__all__ = ["KEY_ENV", "describe_auth", "resolve_key"]

#: Environment variable holding the shadow MAC key (any non-empty string).
KEY_ENV = "CONTEXTKIT_SHADOW_KEY"


def resolve_key(explicit: bytes | str | None = None) -> bytes | None:
    """The MAC key: ``explicit`` if given, else ``$CONTEXTKIT_SHADOW_KEY``, else ``None``.

    A ``str`` is UTF-8 encoded. An empty key (explicit or from the environment) counts
    as no key at all, so an exported-but-empty variable never authenticates anything.
    """
    if explicit is not None:
        key = explicit.encode() if isinstance(explicit, str) else bytes(explicit)
        return key or None
    env = os.environ.get(KEY_ENV, "")
    return env.encode() or None


def describe_auth(key: bytes | None) -> str:
    """One line for status output: whether shadows are authenticated, and by which key.

    The key itself never appears; a short fingerprint (first 8 hex digits of its
    SHA-256) tells two deployments' keys apart.
    """
    if not key:
        return f"unauthenticated (no key; set {KEY_ENV} to sign and check manifests)"
    fingerprint = hashlib.sha256(key).hexdigest()[:8]
    return f"authenticated (HMAC-SHA256, key fingerprint {fingerprint})"
