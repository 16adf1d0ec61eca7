"""Keys of authenticated shadows: where the MAC key comes from, what it covers, and how
to describe it.

With a key configured, a shadow's manifests, ``index.json`` and each session's
``head.json`` carry an HMAC-SHA256 over their whole content, and every block record
carries a MAC over the block's bytes (:func:`block_mac`): a Poly1305 tag of its tensor
slices under a one-time key, HMAC-SHA256 of the key, the cache identity, the session, the
block's tenant and content key, its position (segment and slot) and a random nonce
stored in the record. Recovery checks it before the block is imported, so a writer of
the store who rewrites a block's bytes (and forges its CRC-32) gets the block skipped,
never served.

Why this is a MAC: HMAC-SHA256 is a PRF, so each one-time key (Poly1305's ``r`` and
``s``) is uniformly random to anyone without the key; the 128-bit nonce makes every
derivation input unique, so each one-time key tags exactly one byte string (a reused
record keeps its nonce, tag and bytes), which is Poly1305's one-time security condition:
a forgery of an ``L``-byte block succeeds with probability at most
``8 * ceil((L + 32) / 16) / 2**106`` per attempt (~2**-88 for a 560 KB block). A block
moved to another tenant, content key, session, cache identity, segment or slot derives
another one-time key and fails. Poly1305 runs at several GB/s per core where SHA-256
runs at ~1-1.5, so checking every block keeps up with the disk.

The key is per deployment: every writer and every reader of a store must hold the same
one. It comes from configuration (``ShadowConfig.auth_key``, a recovery argument) or,
when none is given, from the environment variable :data:`KEY_ENV`
(``CONTEXTKIT_SHADOW_KEY``): any UTF-8 text, e.g. ``openssl rand -hex 32``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import json
import os
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shadow._errors import InvalidKeyError, TamperedShadowError, UnauthenticatedShadowError

__all__ = ["BLOCK_MAC_HEX", "BLOCK_NONCE_BYTES", "BLOCK_NONCE_HEX", "KEY_ENV", "KEY_STEP",
           "MAC_ALG", "BlockBinding", "block_mac", "block_mac_key", "canonical",
           "describe_auth", "key_id", "new_block_nonces", "resolve_key", "sign", "verify"]

#: Environment variable holding the shadow MAC key (any non-empty string).
KEY_ENV = "CONTEXTKIT_SHADOW_KEY"
MAC_ALG = "hmac-sha256"
#: Prefixed to every MACed document, with its kind, so a MAC of one kind of document
#: (a manifest) is never valid for another (the index).
_DOMAIN = b"contextkit-shadow mac v1\n"
#: Prefixed to the input of every block's one-time key derivation (v2: Poly1305 tags;
#: v1 was HMAC-SHA256 over SHA-256 digests, never released).
_BLOCK_DOMAIN = b"contextkit-shadow block mac v2 poly1305\n"
#: Hex digits of a block MAC kept in a record: a 128-bit Poly1305 tag.
BLOCK_MAC_HEX = 32
#: Bytes (and hex digits) of the random nonce each block record carries with its MAC.
BLOCK_NONCE_BYTES = 16
BLOCK_NONCE_HEX = 2 * BLOCK_NONCE_BYTES
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
    return (f"authenticated (HMAC-SHA256 of manifests, Poly1305 of every block's bytes, key "
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


def new_block_nonces(n: int) -> list[bytes]:
    """``n`` fresh random nonces, one per block record written."""
    raw = secrets.token_bytes(n * BLOCK_NONCE_BYTES)
    return [raw[i:i + BLOCK_NONCE_BYTES] for i in range(0, len(raw), BLOCK_NONCE_BYTES)]


def block_mac_key(key: bytes, binding: BlockBinding, nonce: bytes) -> bytes:
    """The one-time Poly1305 key of one block record: HMAC-SHA256 under ``key`` of the
    domain tag, the binding (canonical JSON) and the record's nonce."""
    if len(nonce) != BLOCK_NONCE_BYTES:
        raise ValueError(f"a block nonce is {BLOCK_NONCE_BYTES} bytes, got {len(nonce)}")
    message = _BLOCK_DOMAIN + binding.encode() + b"\n" + nonce
    return hmac.new(key, message, hashlib.sha256).digest()


def _bytes_view(data: Any) -> memoryview:
    """``data`` (a C-contiguous buffer) as flat bytes; an empty one as ``b""``."""
    view = memoryview(data)
    return view.cast("B") if view.nbytes else memoryview(b"")


@functools.cache
def _poly1305() -> Any:
    try:
        from cryptography.hazmat.primitives.poly1305 import Poly1305
    except ImportError:
        raise ImportError("block MACs of authenticated shadows need the 'cryptography' "
                          "package: pip install 'contextkit[shadow]'") from None
    return Poly1305


def block_mac(key: bytes, binding: BlockBinding, nonce: bytes, slices: Sequence[Any]) -> str:
    """The MAC of one block, as :data:`BLOCK_MAC_HEX` hex digits: Poly1305 under
    :func:`block_mac_key` of the slices' lengths (little-endian 64-bit each) followed by
    the slices themselves (contiguous buffers, in :data:`gpu_cache.TENSOR_NAMES` order).

    The lengths make the encoding unambiguous: no two lists of slices feed the same bytes.
    """
    views = [_bytes_view(s) for s in slices]
    mac = _poly1305()(block_mac_key(key, binding, nonce))
    mac.update(struct.pack(f"<{len(views)}Q", *(v.nbytes for v in views)))
    for view in views:
        mac.update(view)
    return bytes(mac.finalize()).hex()
