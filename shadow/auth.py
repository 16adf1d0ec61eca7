"""Keys of authenticated shadows: where the MAC key comes from, what it covers, and how
to describe it.

With a key configured, a shadow's manifests, ``index.json`` and each session's
``head.json`` carry an HMAC-SHA256 over their whole content, and every block record
carries a MAC over the block's bytes (:func:`block_mac`): the SHA-256 of each of its
tensor slices, bound to the key, the cache identity, the session, the block's tenant and
content key, and its position (segment and slot). Recovery checks it before the block is
imported, so a writer of the store who rewrites a block's bytes (and forges its CRC-32)
gets the block skipped, never served.

The key is per deployment: every writer and every reader of a store must hold the same
one. It comes from configuration (``ShadowConfig.auth_key``, a recovery argument) or,
when none is given, from the environment variable :data:`KEY_ENV`
(``CONTEXTKIT_SHADOW_KEY``): any UTF-8 text, e.g. ``openssl rand -hex 32``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpu_cache import TENSOR_NAMES
from shadow._errors import InvalidKeyError, TamperedShadowError, UnauthenticatedShadowError

__all__ = ["BLOCK_MAC_HEX", "KEY_ENV", "KEY_STEP", "MAC_ALG", "BlockBinding", "block_mac",
           "canonical", "describe_auth", "key_id", "resolve_key", "sign", "tensor_digest",
           "tensor_digests", "verify"]

#: Environment variable holding the shadow MAC key (any non-empty string).
KEY_ENV = "CONTEXTKIT_SHADOW_KEY"
MAC_ALG = "hmac-sha256"
#: Prefixed to every MACed document, with its kind, so a MAC of one kind of document
#: (a manifest) is never valid for another (the index).
_DOMAIN = b"contextkit-shadow mac v1\n"
_BLOCK_DOMAIN = b"contextkit-shadow block mac v1\n"
#: Hex digits of a block MAC kept in a record: HMAC-SHA256 truncated to 128 bits.
BLOCK_MAC_HEX = 32
#: The one documented step that makes a deployment's shadows authenticated.
KEY_STEP = f"export {KEY_ENV}=$(openssl rand -hex 32)"


def resolve_key(explicit: bytes | str | None = None) -> bytes | None:
    """The MAC key: ``explicit`` if given, else ``$CONTEXTKIT_SHADOW_KEY``, else ``None``.

    A ``str`` is UTF-8 encoded. An empty key (explicit or from the environment) counts
    as no key at all, so an exported-but-empty variable never authenticates anything.

    Raises:
        InvalidKeyError: the key (or the variable) is not valid UTF-8 text.
    """
    if explicit is not None:
        if isinstance(explicit, str):
            return _utf8(explicit, "the shadow key (ShadowConfig.auth_key, shadow.key)") or None
        return bytes(explicit) or None
    return _utf8(os.environ.get(KEY_ENV, ""), f"${KEY_ENV}") or None


def _utf8(text: str, what: str) -> bytes:
    try:
        return text.encode()
    except UnicodeEncodeError:  # lone surrogates: non-UTF-8 bytes in the environment
        raise InvalidKeyError(f"{what} is not valid UTF-8 text; set it to a UTF-8 string, e.g. "
                         f"{KEY_STEP}") from None


def describe_auth(key: bytes | None) -> str:
    """One line for status output: whether shadows are authenticated, and by which key.

    The key itself never appears; a short fingerprint (first 8 hex digits of its
    SHA-256) tells two deployments' keys apart.
    """
    if not key:
        return ("unauthenticated (unsigned: whoever can write the store can change what is "
                "recovered; fine for one machine's own file:// store - to sign manifests and "
                f"blocks: {KEY_STEP})")
    return (f"authenticated (HMAC-SHA256 of manifests and every block's bytes, key "
            f"fingerprint {key_id(key)})")


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


# ---------------------------------------------------------------------- block MACs
@dataclass(frozen=True, slots=True)
class BlockBinding:
    """What a block's MAC binds its bytes to, besides the key.

    Args:
        identity: :meth:`gpu_cache.CacheIdentity.digest` of the session's cache.
        session_id: the session whose manifest lists the block.
        tenant: the block's tenant.
        key: the block's content key (hex), ``None`` for a block still being filled.
        segment: the name of the segment holding it (``seg-000003-1a2b3c4d``: unique,
            never reused for other bytes).
        slot: its index within the segment.
    """

    identity: bytes
    session_id: str
    tenant: str
    key: str | None
    segment: str
    slot: int

    def replace(self, **changes: Any) -> BlockBinding:
        return dataclasses.replace(self, **changes)

    def encode(self) -> bytes:
        return canonical({"identity": self.identity.hex(), "session": self.session_id,
                          "tenant": self.tenant, "key": self.key, "segment": self.segment,
                          "slot": self.slot})


def tensor_digest(data: Any) -> bytes:
    """SHA-256 of one tensor slice of a block (any contiguous buffer)."""
    return hashlib.sha256(data).digest()


def tensor_digests(data: Mapping[str, Any]) -> tuple[bytes, ...]:
    """SHA-256 of each tensor slice of a block, in :data:`gpu_cache.TENSOR_NAMES` order."""
    return tuple(tensor_digest(data[name]) for name in TENSOR_NAMES)


def block_mac(key: bytes, binding: BlockBinding, digests: Sequence[bytes]) -> str:
    """The MAC of one block: HMAC-SHA256 under ``key`` of its binding and the SHA-256 of
    each of its tensor slices (:func:`tensor_digests`), as :data:`BLOCK_MAC_HEX` hex
    digits."""
    message = _BLOCK_DOMAIN + binding.encode() + b"\n" + b"".join(digests)
    return hmac.new(key, message, hashlib.sha256).hexdigest()[:BLOCK_MAC_HEX]
