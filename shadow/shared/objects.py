"""One object of the shared tier: a chunk of consecutive blocks of one prompt prefix.

An object is named by its content (:func:`chunk_path`): the model identity's digest, a
keyed tag of the tenant, and the key of the chunk's last block. Block keys chain the
whole prefix and are salted with the tenant and the identity
(:func:`gpu_cache.hashing.hash_block_tokens`), so the last key names every token of
the chunk and before it (one name, one content), and a reader that knows the prompt
computes every name it needs and finds a prefix with a few requests, never a listing.

Layout (all integers little-endian)::

    b"CKSHARED1\\n" | u32 header length | header (canonical JSON) | body | HMAC-SHA256

The header names the object's own path, the key identity, the tenant, when and by
whom it was written, each block (key, source layer, importance, pinned) and, per
block format (a *pool*: format and key offsets), the byte ranges of its tensors in
the body. The MAC covers everything before it under the deployment's key
(``CONTEXTKIT_SHADOW_KEY``), so a reader refuses (:class:`SharedObjectError`):

- a changed byte anywhere (``tampered``);
- a valid object copied to another name, another tenant's or another prefix's
  (``replayed``: the path it was written for is under the MAC);
- an object of another model, block size or codec, written by a writer of another
  identity at this identity's path (``foreign``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gpu_cache import CacheIdentity, CacheIdentityError
from gpu_cache.format_specs import TENSOR_NAMES
from shadow._errors import ShadowError

__all__ = ["MAGIC", "BlockEntry", "PoolPart", "SharedChunk", "SharedObjectError",
           "chunk_path", "decode_chunk", "encode_chunk", "model_tag", "tenant_tag"]

MAGIC = b"CKSHARED1\n"
_DOMAIN = b"contextkit shared-tier object v1\n"
_MAC_BYTES = 32
_DTYPES = {str(dt).removeprefix("torch."): dt for dt in
           (torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.float32)}


class SharedObjectError(ShadowError):
    """A shared-tier object that must not be served; ``reason`` is one of
    ``corrupt``, ``tampered``, ``replayed``, ``foreign``.

    An object's age is not a reason: a name fixes its content (every token up to the
    chunk's end, the tenant, the model), so an old object put back at its own name
    after collection is the same KV; collection, not the reader, bounds age."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def model_tag(identity: CacheIdentity) -> str:
    """The path component of a key identity: 32 hex digits of its digest."""
    return identity.digest().hex()[:32]


def tenant_tag(mac_key: bytes, tenant: str) -> str:
    """The path component of a tenant: a keyed tag (so names never spell tenants)."""
    return hmac.new(mac_key, b"tenant\0" + tenant.encode(), hashlib.sha256).hexdigest()[:24]


def chunk_path(model: str, tenant: str, last_key: bytes) -> str:
    """The object name of the chunk whose last block has key ``last_key``, for the
    :func:`model_tag` ``model`` and the :func:`tenant_tag` ``tenant``."""
    return f"{model}/t/{tenant}/{last_key.hex()}"


@dataclass(slots=True)
class BlockEntry:
    """One block of a chunk: its key and semantic label."""

    key: bytes
    source_layer: str
    importance: float
    pinned: bool = False


@dataclass(slots=True)
class PoolPart:
    """The chunk's blocks of one format (pool identity): their bytes, block-major
    (``[n, num_layers, block_size, H, ...]`` per tensor, as
    :meth:`~gpu_cache.TQGPUCache.export_blocks` gives with ``block_major=True``), and
    the pool's per-head key offsets (None: the format has none)."""

    identity: CacheIdentity
    positions: list[int]  # indexes into SharedChunk.blocks
    tensors: dict[str, torch.Tensor]
    key_offsets: torch.Tensor | None = None


@dataclass(slots=True)
class SharedChunk:
    """A decoded (or to-be-encoded) shared-tier object."""

    path: str
    identity: CacheIdentity  # the key identity (model, block size, key codec)
    tenant: str  # the objects record its keyed tag (:func:`tenant_tag`), never the name
    blocks: list[BlockEntry]
    parts: list[PoolPart]
    writer: str = ""
    written_at: float = field(default_factory=time.time)

    @property
    def keys(self) -> list[bytes]:
        return [b.key for b in self.blocks]


def _canonical(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _mac(mac_key: bytes, signed: bytes) -> bytes:
    return hmac.new(mac_key, _DOMAIN + signed, hashlib.sha256).digest()


def encode_chunk(chunk: SharedChunk, mac_key: bytes) -> bytes:
    """The object's bytes, MAC included."""
    body: list[bytes] = []
    offset = 0

    def add(t: torch.Tensor) -> dict[str, Any]:
        nonlocal offset
        raw = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
        body.append(raw)
        rng = {"offset": offset, "nbytes": len(raw)}
        offset += len(raw)
        return rng

    parts = []
    for part in chunk.parts:
        tensors = {}
        for name in TENSOR_NAMES:
            t = part.tensors[name]
            if t.shape[0] != len(part.positions):
                raise ValueError(f"{name} holds {t.shape[0]} blocks, the part "
                                 f"{len(part.positions)}")
            tensors[name] = {"dtype": str(t.dtype).removeprefix("torch."),
                             "shape": list(t.shape[1:]), **add(t)}
        offsets = None
        if part.key_offsets is not None:
            offsets = {"shape": list(part.key_offsets.shape),
                       **add(part.key_offsets.to(torch.float32))}
        parts.append({"identity": part.identity.to_dict(), "positions": part.positions,
                      "tensors": tensors, "key_offsets": offsets})
    header = _canonical({
        "version": 1, "path": chunk.path, "identity": chunk.identity.to_dict(),
        "tenant": tenant_tag(mac_key, chunk.tenant), "writer": chunk.writer,
        "written_at": chunk.written_at,
        "blocks": [{"key": b.key.hex(), "layer": b.source_layer,
                    "importance": b.importance, "pinned": b.pinned} for b in chunk.blocks],
        "parts": parts})
    signed = b"".join([MAGIC, struct.pack("<I", len(header)), header, *body])
    return signed + _mac(mac_key, signed)


def read_header(data: bytes | memoryview) -> dict[str, Any]:
    """The header of an object's first bytes (no MAC check: for collection only)."""
    view = memoryview(data)
    if bytes(view[:len(MAGIC)]) != MAGIC or len(view) < len(MAGIC) + 4:
        raise SharedObjectError("corrupt", "not a contextkit shared-tier object")
    (n,) = struct.unpack_from("<I", view, len(MAGIC))
    start = len(MAGIC) + 4
    if len(view) < start + n:
        raise SharedObjectError("corrupt", "the object's header is cut short")
    try:
        doc = json.loads(bytes(view[start:start + n]))
    except ValueError:
        raise SharedObjectError("corrupt", "the object's header is not JSON") from None
    if not isinstance(doc, dict):
        raise SharedObjectError("corrupt", "the object's header is not a JSON object")
    return doc


def header_bytes_needed(first: bytes | memoryview) -> int:
    """How many leading bytes hold the header (from at least its first 14)."""
    (n,) = struct.unpack_from("<I", memoryview(first), len(MAGIC))
    return len(MAGIC) + 4 + int(n)


def decode_chunk(data: bytes, mac_key: bytes, *, path: str, identity: CacheIdentity,
                 tenant: str) -> SharedChunk:
    """Verify and decode an object read from ``path`` for ``tenant``.

    Args:
        tenant: the reader's tenant (the object records only its keyed tag).
        identity: the reader's key identity: the object must be of the same model,
            tokenizer, block size and key codec.

    Raises:
        SharedObjectError: corrupt, tampered, replayed or foreign (see the
            module's docstring); nothing of the object is returned.
    """
    if len(data) < len(MAGIC) + 4 + _MAC_BYTES:
        raise SharedObjectError("corrupt", f"{path}: {len(data)} bytes, too short")
    signed, tag = data[:-_MAC_BYTES], data[-_MAC_BYTES:]
    if not hmac.compare_digest(_mac(mac_key, signed), tag):
        raise SharedObjectError("tampered", f"{path}: MAC mismatch (changed, or written "
                                "with another key)")
    doc = read_header(signed)
    body = memoryview(signed)[header_bytes_needed(signed):]
    if doc.get("path") != path:
        raise SharedObjectError("replayed", f"{path}: the object was written as "
                                f"{doc.get('path')!r}")
    if doc.get("tenant") != tenant_tag(mac_key, tenant):
        raise SharedObjectError("replayed", f"{path}: the object is another tenant's")
    try:
        theirs = CacheIdentity.from_dict(doc["identity"])
    except (KeyError, CacheIdentityError) as exc:
        raise SharedObjectError("corrupt", f"{path}: bad identity ({exc})") from None
    if theirs != identity:
        raise SharedObjectError("foreign", f"{path}: written for {theirs.model_id} "
                                f"(block {theirs.block_size}, {theirs.codec}), this server "
                                f"is {identity.model_id} (block {identity.block_size}, "
                                f"{identity.codec})")
    written_at = float(doc.get("written_at", 0.0))
    try:
        blocks = [BlockEntry(bytes.fromhex(b["key"]), str(b["layer"]),
                             float(b["importance"]), bool(b["pinned"])) for b in doc["blocks"]]
        parts = [_decode_part(p, body, identity) for p in doc["parts"]]
    except (KeyError, TypeError, ValueError, CacheIdentityError) as exc:
        raise SharedObjectError("corrupt", f"{path}: bad header ({exc})") from None
    return SharedChunk(path, theirs, tenant, blocks, parts,
                       writer=str(doc.get("writer", "")), written_at=written_at)


def _decode_part(doc: dict[str, Any], body: memoryview, base: CacheIdentity) -> PoolPart:
    ident = CacheIdentity.from_dict(doc["identity"])
    if (ident.model_id, ident.num_layers, ident.num_kv_heads, ident.head_dim,
            ident.block_size, ident.rotation_seed) != (
            base.model_id, base.num_layers, base.num_kv_heads, base.head_dim,
            base.block_size, base.rotation_seed):
        raise ValueError("a part of another model's shape")
    positions = [int(i) for i in doc["positions"]]
    tensors = {}
    for name in TENSOR_NAMES:
        spec = doc["tensors"][name]
        tensors[name] = _tensor(body, spec, [len(positions), *spec["shape"]], spec["dtype"])
    offsets = None
    if doc.get("key_offsets") is not None:
        spec = doc["key_offsets"]
        offsets = _tensor(body, spec, spec["shape"], "float32")
    return PoolPart(ident, positions, tensors, offsets)


def _tensor(body: memoryview, spec: dict[str, Any], shape: Sequence[int],
            dtype: str) -> torch.Tensor:
    start, n = int(spec["offset"]), int(spec["nbytes"])
    if start < 0 or start + n > len(body) or dtype not in _DTYPES:
        raise ValueError("a tensor outside the body")
    raw = (torch.frombuffer(bytearray(body[start:start + n]), dtype=torch.uint8) if n
           else torch.empty(0, dtype=torch.uint8))
    return raw.view(_DTYPES[dtype]).reshape(list(shape))
