"""Keys of authenticated shadows: where the MAC key comes from, and how to describe it.

A shadow's manifests and index carry an HMAC-SHA256 over their whole content when a
key is configured. The key is per deployment: every writer and every reader of a store
must hold the same one. It comes from configuration (``ShadowConfig.auth_key``, a
recovery argument) or, when none is given, from the environment variable
:data:`KEY_ENV` (``CONTEXTKIT_SHADOW_KEY``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

from shadow._errors import TamperedShadowError, UnauthenticatedShadowError

__all__ = ["KEY_ENV", "MAC_ALG", "canonical", "describe_auth", "key_id", "resolve_key",
           "sign", "verify"]

#: Environment variable holding the shadow MAC key (any non-empty string).
KEY_ENV = "CONTEXTKIT_SHADOW_KEY"
MAC_ALG = "hmac-sha256"
#: Prefixed to every MACed document, with its kind, so a MAC of one kind of document
#: (a manifest) is never valid for another (the index).
_DOMAIN = b"contextkit-shadow mac v1\n"


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
    return f"authenticated (HMAC-SHA256, key fingerprint {key_id(key)})"


def key_id(key: bytes) -> str:
    """A short public fingerprint of ``key``: the first 8 hex digits of its SHA-256."""
    return hashlib.sha256(key).hexdigest()[:8]


def canonical(doc: Any) -> bytes:
    """The bytes a MAC covers: sorted keys, no whitespace, ASCII only.

    Computed from the parsed document, so key order and whitespace in the stored file do
    not matter, and what is checked is exactly what is then read.
    """
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _mac(doc: dict[str, Any], key: bytes, kind: str) -> str:
    message = _DOMAIN + kind.encode() + b"\n" + canonical(doc)
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign(doc: dict[str, Any], key: bytes, kind: str) -> dict[str, str]:
    """The ``mac`` entry of ``doc`` (which must not hold one): HMAC-SHA256 of its
    canonical form under ``key``, for a document of ``kind`` (``manifest``, ``index``)."""
    return {"alg": MAC_ALG, "key_id": key_id(key), "value": _mac(doc, key, kind)}


def verify(doc: dict[str, Any], key: bytes | None, kind: str, where: str) -> bool:
    """Check and remove ``doc["mac"]``; returns whether ``doc`` was authenticated.

    Runs before any other field of ``doc`` is looked at.

    Raises:
        TamperedShadowError: a key is configured and the MAC is missing, malformed, of
            another key, or does not match the content.
        UnauthenticatedShadowError: no key is configured but ``doc`` carries a MAC.
    """
    mac = doc.pop("mac", None)
    if key is None:
        if mac is not None:
            raise UnauthenticatedShadowError(
                f"{where}: this shadow is authenticated; set {KEY_ENV} (the key its writer "
                "used) to read it")
        return False
    if mac is None:
        raise TamperedShadowError(
            f"{where} carries no MAC but a shadow key is configured (written without a key, "
            f"or its MAC was stripped); refused - delete it, or unset {KEY_ENV} if the "
            "deployment is unauthenticated")
    value = mac.get("value") if isinstance(mac, dict) else None
    if not isinstance(mac, dict) or mac.get("alg") != MAC_ALG or not isinstance(value, str):
        raise TamperedShadowError(f"{where} has a malformed MAC entry; refused")
    if not hmac.compare_digest(_mac(doc, key, kind), value):
        theirs = mac.get("key_id")
        if isinstance(theirs, str) and theirs != key_id(key):
            raise TamperedShadowError(
                f"{where} was signed with another key (fingerprint {theirs!r}, this reader "
                f"has {key_id(key)!r}); refused - set {KEY_ENV} to the writer's key")
        raise TamperedShadowError(
            f"{where}: MAC does not match its content (modified after it was written); "
            "refused - restore the session from a trusted copy or delete it")
    return True
