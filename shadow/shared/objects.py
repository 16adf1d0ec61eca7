"""One object of the shared tier: a chunk of consecutive blocks of one prompt prefix.

An object is named by its content (:func:`chunk_path`): the model identity's digest, a
keyed tag of the tenant, and the key of the chunk's last block. Block keys chain the
whole prefix and are salted with the tenant and the identity
(:func:`gpu_cache.hashing.hash_block_tokens`), so the last key names every token of
the chunk and before it (one name, one content), and a reader that knows the prompt
computes every name it needs and finds a prefix with a few requests, never a listing.

A *span object* (:func:`span_path`) holds the blocks of one labelled span (a
document, a memory, a turn) for chunk reuse on another replica: it is named by the
span's content key (:func:`gpu_cache.chunks.chunk_key`: tenant, model, label and
token ids, never its position), and its header's ``span`` field says where in those
blocks the span lies and where it was computed (:class:`SpanRecord`).

Layout (all integers little-endian)::

    b"CKSHARED2\\n" | u32 header length | header (canonical JSON) | header MAC | body
    | HMAC-SHA256

The header names the object's own path, the key identity, the tenant, when and by
whom it was written, each block (key, source layer, importance, pinned) and, per
block format (a *pool*: format and key offsets), the byte ranges of its tensors in
the body. The last MAC covers everything before it under the deployment's key
(``CONTEXTKIT_SHADOW_KEY``); the header MAC covers the header alone, so a collector
authenticates what it keeps by reading the header only. A reader refuses
(:class:`SharedObjectError`):

- a changed byte anywhere (``tampered``);
- a valid object copied to another name, another tenant's or another prefix's
  (``replayed``: the path it was written for is under the MAC);
- an object of another model, block size or codec, written by a writer of another
  identity at this identity's path (``foreign``);
- a header that does not describe its body exactly, every field checked, version
  included (``corrupt``: a writer with the key running other code);
- an object larger than its name allows (``oversize``), before reading it
  (:func:`max_object_bytes`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from gpu_cache import CacheIdentity, CacheIdentityError
from gpu_cache.calibration import key_offset_digest
from gpu_cache.format_specs import FORMATS, TENSOR_NAMES, tensor_specs
from shadow._errors import ShadowError

__all__ = ["MAC_BYTES", "MAGIC", "MAX_HEADER_BYTES", "MAX_LEASE_BYTES", "MAX_SPAN_BLOCKS",
           "PREFIX_BYTES", "VERSION", "BlockEntry", "Lease", "ObjectHeader", "PoolPart",
           "SharedChunk", "SharedObjectError", "SpanRecord", "assemble_object", "check_reader",
           "check_span_name", "chunk_path", "decode_chunk", "decode_lease", "encode_chunk",
           "encode_lease", "header_bound", "header_length", "max_object_bytes", "model_tag",
           "object_bytes", "parse_header", "read_header", "span_path", "split_object",
           "tenant_tag"]

MAGIC = b"CKSHARED2\n"
#: The header ``version`` this code writes and reads.
VERSION = 2
_DOMAIN = b"contextkit shared-tier object v2\n"
_HEADER_DOMAIN = b"contextkit shared-tier header v2\n"
MAC_BYTES = 32
#: Magic and header length: the first bytes of every object.
PREFIX_BYTES = len(MAGIC) + 4
#: No header is longer: a collector, which knows no writer's chunk size, reads at most
#: this much of an object.
MAX_HEADER_BYTES = 1 << 20
#: Longest text field (the path, the writer, a layer's name).
MAX_TEXT = 512
#: Most blocks a span object holds (longer spans are not shared).
MAX_SPAN_BLOCKS = 64
#: Most hops a span object may record (readers stop reusing far sooner).
_MAX_HOPS = 1024
_DTYPES = {str(dt).removeprefix("torch."): dt for dt in
           (torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.float32)}
_HEADER_FIELDS = {"version", "path", "identity", "tenant", "writer", "written_at", "blocks",
                  "parts"}
_BLOCK_FIELDS = {"key", "layer", "importance", "pinned"}
_PART_FIELDS = {"identity", "positions", "tensors", "key_offsets"}
_SPAN_FIELDS = {"content", "label", "position", "length", "hops"}


class SharedObjectError(ShadowError):
    """A shared-tier object that must not be served; ``reason`` is one of
    ``corrupt``, ``tampered``, ``replayed``, ``foreign``, ``oversize``.

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


def span_path(model: str, tenant: str, content: bytes) -> str:
    """The object name of the span whose content key is ``content``."""
    return f"{model}/t/{tenant}/span-{content.hex()}"


@dataclass(frozen=True, slots=True)
class SpanRecord:
    """Where a span object's span lies: tokens ``position % block_size ..`` of its
    blocks, ``length`` long, computed at ``position``, ``hops`` moves from a full
    computation (:class:`gpu_cache.chunks.ChunkEntry`'s fields)."""

    content: bytes  # its content key (the object's name)
    label: str
    position: int
    length: int
    hops: int = 0


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
    span: SpanRecord | None = None  # a span object's span (None: a prefix chunk)

    @property
    def keys(self) -> list[bytes]:
        return [b.key for b in self.blocks]


@dataclass(slots=True)
class ObjectHeader:
    """A header every field of which was checked (:func:`parse_header`).

    ``parts`` keep their tensor specs (dtype, shape, offset, nbytes) as checked;
    ``body_bytes`` is the body's exact length."""

    path: str
    identity: CacheIdentity
    tenant: str  # the tenant's keyed tag
    writer: str
    written_at: float
    blocks: list[BlockEntry]
    parts: list[tuple[CacheIdentity, list[int], dict[str, Any]]]
    body_bytes: int
    span: SpanRecord | None = None


def header_bound(chunk_blocks: int) -> int:
    """The longest header of a chunk of ``chunk_blocks`` blocks (text fields bounded)."""
    return min(MAX_HEADER_BYTES, 16384 + 8192 * max(1, chunk_blocks))


def _block_bytes(identity: CacheIdentity, codec: str) -> int:
    """Bytes of one block in format ``codec``; 0 when the format cannot hold it."""
    try:
        specs = tensor_specs(_Layout(codec, identity.num_kv_heads, identity.head_dim))
    except ValueError:
        return 0
    per_token = sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs.values())
    return identity.num_layers * identity.block_size * per_token


@dataclass(frozen=True, slots=True)
class _Layout:
    codec: str
    num_kv_heads: int
    head_dim: int


def max_object_bytes(identity: CacheIdentity, chunk_blocks: int) -> int:
    """The largest legal object of ``chunk_blocks`` blocks of ``identity``: its longest
    header, every block in the widest format, one set of key offsets per block."""
    widest = max(_block_bytes(identity, fmt) for fmt in FORMATS)
    offsets = identity.num_layers * identity.num_kv_heads * identity.head_dim * 4
    body = chunk_blocks * (widest + offsets)
    return PREFIX_BYTES + header_bound(chunk_blocks) + MAC_BYTES + body + MAC_BYTES


def _canonical(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _mac(mac_key: bytes, domain: bytes, *data: bytes | memoryview) -> bytes:
    h = hmac.new(mac_key, domain, hashlib.sha256)
    for part in data:
        h.update(part)
    return h.digest()


def assemble_object(header: dict[str, Any] | bytes, body: bytes | memoryview,
                    mac_key: bytes) -> bytes:
    """An object's bytes from its header (a document, or JSON text signed as it is) and
    body, both MACs included: what :func:`encode_chunk` writes. Any header can be
    signed by a holder of the key, so readers check every field."""
    doc = header if isinstance(header, bytes) else _canonical(header)
    prefix = MAGIC + struct.pack("<I", len(doc))
    signed = b"".join([prefix, doc, _mac(mac_key, _HEADER_DOMAIN, prefix, doc), body])
    return signed + _mac(mac_key, _DOMAIN, signed)


def split_object(data: bytes | bytearray | memoryview) -> tuple[dict[str, Any], memoryview]:
    """The header document (unchecked) and the body of an object's bytes (no MAC
    check; tests and tools).

    Raises:
        SharedObjectError: ``corrupt``: not an object, or a header that is not JSON.
    """
    view = memoryview(data)
    doc = read_header(view)
    start = PREFIX_BYTES + header_length(view) + MAC_BYTES
    return doc, view[start:len(view) - MAC_BYTES]


def encode_chunk(chunk: SharedChunk, mac_key: bytes) -> bytes:
    """The object's bytes, MACs included."""
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
    header = {
        "version": VERSION, "path": chunk.path, "identity": chunk.identity.to_dict(),
        "tenant": tenant_tag(mac_key, chunk.tenant), "writer": chunk.writer,
        "written_at": chunk.written_at,
        "blocks": [{"key": b.key.hex(), "layer": b.source_layer,
                    "importance": b.importance, "pinned": b.pinned} for b in chunk.blocks],
        "parts": parts}
    if chunk.span is not None:
        sp = chunk.span
        header["span"] = {"content": sp.content.hex(), "label": sp.label,
                          "position": sp.position, "length": sp.length, "hops": sp.hops}
    try:
        return assemble_object(header, b"".join(body), mac_key)
    except ValueError as exc:  # NaN or inf in the header: JSON has neither
        raise ValueError(f"{chunk.path}: cannot encode the header ({exc})") from None


def header_length(first: bytes | bytearray | memoryview) -> int:
    """The header length an object's first :data:`PREFIX_BYTES` bytes declare.

    Raises:
        SharedObjectError: ``corrupt``: not an object, or a header longer than
            :data:`MAX_HEADER_BYTES`.
    """
    view = memoryview(first)
    if len(view) < PREFIX_BYTES or bytes(view[:len(MAGIC)]) != MAGIC:
        raise SharedObjectError("corrupt", "not a contextkit shared-tier object (v2)")
    (n,) = struct.unpack_from("<I", view, len(MAGIC))
    if n > MAX_HEADER_BYTES:
        raise SharedObjectError("corrupt", f"a header of {n} bytes (at most "
                                f"{MAX_HEADER_BYTES})")
    return int(n)


def read_header(data: bytes | bytearray | memoryview, mac_key: bytes | None = None
                ) -> dict[str, Any]:
    """The header document of an object's first bytes (at least the header and its
    MAC), unchecked; with ``mac_key``, its header MAC verified.

    Raises:
        SharedObjectError: ``corrupt`` (cut short, not JSON, not an object) or
            ``tampered`` (the header MAC does not match).
    """
    view = memoryview(data)
    n = header_length(view)
    end = PREFIX_BYTES + n
    if len(view) < end + MAC_BYTES:
        raise SharedObjectError("corrupt", "the object's header is cut short")
    if mac_key is not None and not hmac.compare_digest(
            _mac(mac_key, _HEADER_DOMAIN, view[:end]), bytes(view[end:end + MAC_BYTES])):
        raise SharedObjectError("tampered", "header MAC mismatch (changed, or written with "
                                "another key)")
    try:
        doc = json.loads(bytes(view[PREFIX_BYTES:end]), parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise SharedObjectError("corrupt", "the object's header is not JSON") from None
    if not isinstance(doc, dict):
        raise SharedObjectError("corrupt", "the object's header is not a JSON object")
    return doc


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _fail(what: str) -> SharedObjectError:
    return SharedObjectError("corrupt", f"bad header: {what}")


def _int(value: object, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _fail(f"{what} must be an int in [{lo}, {hi}], got {value!r:.80}")
    return value


def _number(value: object, what: str, lo: float, hi: float) -> float:
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not math.isfinite(value) or not lo <= value <= hi):
        raise _fail(f"{what} must be a number in [{lo}, {hi}], got {value!r:.80}")
    return float(value)


def _text(value: object, what: str, *, empty: bool = True) -> str:
    if not isinstance(value, str) or len(value) > MAX_TEXT or (not empty and not value):
        raise _fail(f"{what} must be a str of at most {MAX_TEXT} characters, got "
                    f"{value!r:.80}")
    return value


def _dict(value: object, what: str, fields: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict) or set(value) != fields:
        got = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise _fail(f"{what} must be an object with fields {sorted(fields)}, got {got!r:.120}")
    return value


def _identity(value: object, what: str) -> CacheIdentity:
    try:
        return CacheIdentity.from_dict(value)  # type: ignore[arg-type]
    except (CacheIdentityError, TypeError, ValueError) as exc:
        raise _fail(f"{what}: {exc}") from None


def parse_header(doc: dict[str, Any]) -> ObjectHeader:
    """Check every field of a header document against the layout :func:`encode_chunk`
    writes: types, ranges, each part's tensors (dtype and shape of its format, byte
    count, within the body) and that the parts hold every block once.

    Raises:
        SharedObjectError: ``corrupt``, naming the first field that is wrong.
    """
    spans = isinstance(doc, dict) and "span" in doc  # a span object's header
    doc = _dict(doc, "the header", _HEADER_FIELDS | {"span"} if spans else _HEADER_FIELDS)
    version = _int(doc["version"], "version", 0, 1 << 31)
    if version != VERSION:
        raise _fail(f"version {version}: this contextkit reads version {VERSION}; upgrade "
                    "every replica to the same release")
    path = _text(doc["path"], "path", empty=False)
    identity = _identity(doc["identity"], "identity")
    tenant = _text(doc["tenant"], "tenant", empty=False)
    writer = _text(doc["writer"], "writer")
    written_at = _number(doc["written_at"], "written_at", 0.0, 1e12)
    raw_blocks = doc["blocks"]
    if not isinstance(raw_blocks, list) or len(raw_blocks) > 1 << 16:
        raise _fail("blocks must be a list")
    blocks = []
    for i, raw in enumerate(raw_blocks):
        b = _dict(raw, f"block {i}", _BLOCK_FIELDS)
        key = b["key"]
        if not isinstance(key, str) or len(key) != 64:
            raise _fail(f"block {i} key must be 64 hex digits")
        try:
            key_bytes = bytes.fromhex(key)
        except ValueError:
            raise _fail(f"block {i} key must be 64 hex digits") from None
        if not isinstance(b["pinned"], bool):
            raise _fail(f"block {i} pinned must be true or false")
        blocks.append(BlockEntry(key_bytes, _text(b["layer"], f"block {i} layer", empty=False),
                                 _number(b["importance"], f"block {i} importance", 0.0, 1.0),
                                 b["pinned"]))
    raw_parts = doc["parts"]
    if not isinstance(raw_parts, list) or len(raw_parts) > max(1, len(blocks)):
        raise _fail("parts must be a list, at most one per block")
    parts = []
    seen: set[int] = set()
    body_end = 0
    for i, raw in enumerate(raw_parts):
        p = _dict(raw, f"part {i}", _PART_FIELDS)
        ident = _identity(p["identity"], f"part {i} identity")
        if (ident.model_id, ident.num_layers, ident.num_kv_heads, ident.head_dim,
                ident.block_size, ident.rotation_seed) != (
                identity.model_id, identity.num_layers, identity.num_kv_heads,
                identity.head_dim, identity.block_size, identity.rotation_seed):
            raise _fail(f"part {i} is of another model's shape")
        positions = p["positions"]
        if not isinstance(positions, list) or not positions:
            raise _fail(f"part {i} positions must be a non-empty list")
        for pos in positions:
            _int(pos, f"part {i} position", 0, len(blocks) - 1)
            if pos in seen:
                raise _fail(f"part {i}: block {pos} is in two places")
            seen.add(pos)
        n = len(positions)
        try:
            specs = tensor_specs(ident)
        except ValueError as exc:
            raise _fail(f"part {i}: {exc}") from None
        tensors = _dict(p["tensors"], f"part {i} tensors", set(TENSOR_NAMES))
        lead = [ident.num_layers, ident.block_size]
        for name in TENSOR_NAMES:
            trailing, dtype = specs[name]
            spec = _dict(tensors[name], f"part {i} {name}",
                         {"dtype", "shape", "offset", "nbytes"})
            want = str(dtype).removeprefix("torch.")
            if spec["dtype"] != want or spec["shape"] != [*lead, *trailing]:
                raise _fail(f"part {i} {name} must be {want} {[*lead, *trailing]}, got "
                            f"{spec['dtype']!r:.20} {spec['shape']!r:.80}")
            body_end = max(body_end, _range(spec, f"part {i} {name}",
                                            n * math.prod(spec["shape"]) * dtype.itemsize))
        offsets = p["key_offsets"]
        if (offsets is None) != (not ident.key_offset_digest):
            raise _fail(f"part {i} key_offsets must be given exactly when its identity "
                        "names a key_offset_digest")
        if offsets is not None:
            spec = _dict(offsets, f"part {i} key_offsets", {"shape", "offset", "nbytes"})
            shape = [ident.num_layers, ident.num_kv_heads, ident.head_dim]
            if spec["shape"] != shape:
                raise _fail(f"part {i} key_offsets must be {shape}")
            body_end = max(body_end, _range(spec, f"part {i} key_offsets",
                                            math.prod(shape) * 4))
        parts.append((ident, list(positions), p))
    if len(seen) != len(blocks):
        raise _fail(f"the parts hold {len(seen)} of {len(blocks)} blocks")
    span = _span(doc["span"], len(blocks), identity.block_size) if "span" in doc else None
    return ObjectHeader(path, identity, tenant, writer, written_at, blocks, parts, body_end,
                        span)


def check_reader(header: ObjectHeader, path: str, tag: str, identity: CacheIdentity) -> None:
    """An authenticated header is what a reader of ``path`` for the tenant whose keyed
    tag is ``tag`` and for ``identity`` may serve.

    Raises:
        SharedObjectError: ``replayed`` (written for another name or tenant),
            ``corrupt`` (a span object away from its content's name) or ``foreign``
            (another model, block size or key codec).
    """
    if header.path != path:
        raise SharedObjectError("replayed", f"{path}: the object was written as "
                                f"{header.path!r}")
    if header.tenant != tag:
        raise SharedObjectError("replayed", f"{path}: the object is another tenant's")
    check_span_name(path, header.span)
    theirs = header.identity
    if theirs != identity:
        raise SharedObjectError("foreign", f"{path}: written for {theirs.model_id} "
                                f"(block {theirs.block_size}, {theirs.codec}), this server "
                                f"is {identity.model_id} (block {identity.block_size}, "
                                f"{identity.codec})")


def check_span_name(path: str, span: SpanRecord | None) -> None:
    """A span object lies at its content's name, and only a span object there.

    Raises:
        SharedObjectError: ``corrupt``.
    """
    named = path.rsplit("/", 1)[-1]
    if named.startswith("span-") != (span is not None) or (
            span is not None and named != f"span-{span.content.hex()}"):
        raise SharedObjectError("corrupt", f"{path}: a span object must lie at its "
                                "content's name, and only there")


def _span(value: object, num_blocks: int, block_size: int) -> SpanRecord:
    """A span object's ``span`` field, checked: its blocks hold the span exactly."""
    d = _dict(value, "span", _SPAN_FIELDS)
    content = d["content"]
    if not isinstance(content, str) or len(content) != 64:
        raise _fail("span content must be 64 hex digits")
    try:
        raw = bytes.fromhex(content)
    except ValueError:
        raise _fail("span content must be 64 hex digits") from None
    position = _int(d["position"], "span position")
    length = _int(d["length"], "span length", 1, MAX_SPAN_BLOCKS * block_size)
    touched = -(-(position % block_size + length) // block_size)
    if num_blocks != touched:
        raise _fail(f"a span of {length} tokens at {position} lies in {touched} blocks, "
                    f"the object holds {num_blocks}")
    return SpanRecord(raw, _text(d["label"], "span label", empty=False), position, length,
                      _int(d["hops"], "span hops", 0, _MAX_HOPS))


def _range(spec: dict[str, Any], what: str, nbytes: int) -> int:
    offset = _int(spec["offset"], f"{what} offset")
    if _int(spec["nbytes"], f"{what} nbytes") != nbytes:
        raise _fail(f"{what} must be {nbytes} bytes, got {spec['nbytes']}")
    return offset + nbytes


def object_bytes(header_len: int, header: ObjectHeader) -> int:
    """The exact size of an object whose header is ``header_len`` bytes long."""
    return PREFIX_BYTES + header_len + MAC_BYTES + header.body_bytes + MAC_BYTES


def decode_chunk(data: bytes | bytearray | memoryview, mac_key: bytes, *, path: str,
                 identity: CacheIdentity, tenant: str) -> SharedChunk:
    """Verify and decode an object read from ``path`` for ``tenant``.

    Args:
        tenant: the reader's tenant (the object records only its keyed tag).
        identity: the reader's key identity: the object must be of the same model,
            tokenizer, block size and key codec.

    Raises:
        SharedObjectError: corrupt, tampered, replayed or foreign (see the
            module's docstring); nothing of the object is returned.
    """
    view = memoryview(data)
    if len(view) < PREFIX_BYTES + 2 * MAC_BYTES:
        raise SharedObjectError("corrupt", f"{path}: {len(view)} bytes, too short")
    signed, tag = view[:-MAC_BYTES], view[-MAC_BYTES:]
    if not hmac.compare_digest(_mac(mac_key, _DOMAIN, signed), bytes(tag)):
        raise SharedObjectError("tampered", f"{path}: MAC mismatch (changed, or written "
                                "with another key)")
    try:
        header = parse_header(read_header(signed, mac_key))
    except SharedObjectError as exc:
        raise SharedObjectError(exc.reason, f"{path}: {exc}") from None
    check_reader(header, path, tenant_tag(mac_key, tenant), identity)
    theirs = header.identity
    body = signed[PREFIX_BYTES + header_length(signed) + MAC_BYTES:]
    if len(body) != header.body_bytes:
        raise SharedObjectError("corrupt", f"{path}: a body of {len(body)} bytes, its header "
                                f"describes {header.body_bytes}")
    parts = [_decode_part(ident, positions, doc, body)
             for ident, positions, doc in header.parts]
    for part in parts:
        if key_offset_digest(part.key_offsets) != part.identity.key_offset_digest:
            raise SharedObjectError("corrupt", f"{path}: key offsets that do not match "
                                    "their identity's digest")
        if part.key_offsets is not None and not torch.isfinite(part.key_offsets).all():
            raise SharedObjectError("corrupt", f"{path}: key offsets that are not finite")
    return SharedChunk(path, theirs, tenant, header.blocks, parts, writer=header.writer,
                       written_at=header.written_at, span=header.span)


def _decode_part(ident: CacheIdentity, positions: list[int], doc: dict[str, Any],
                 body: memoryview) -> PoolPart:
    tensors = {}
    for name in TENSOR_NAMES:
        spec = doc["tensors"][name]
        tensors[name] = _tensor(body, spec, [len(positions), *spec["shape"]], spec["dtype"])
    offsets = None
    if doc["key_offsets"] is not None:
        spec = doc["key_offsets"]
        offsets = _tensor(body, spec, spec["shape"], "float32")
    return PoolPart(ident, positions, tensors, offsets)


def _tensor(body: memoryview, spec: dict[str, Any], shape: list[int],
            dtype: str) -> torch.Tensor:
    start, n = spec["offset"], spec["nbytes"]  # checked by parse_header
    raw = (torch.frombuffer(bytearray(body[start:start + n]), dtype=torch.uint8) if n
           else torch.empty(0, dtype=torch.uint8))
    return raw.view(_DTYPES[dtype]).reshape(shape)


# ---------------------------------------------------------------------- leases
_LEASE_DOMAIN = b"contextkit shared-tier lease v2\n"
#: No lease is longer (a writer's lease names every chunk its DDR tier holds).
MAX_LEASE_BYTES = 32 << 20


@dataclass(slots=True)
class Lease:
    """A writer's lease: the chunks it holds (names, tenants sealed per name) until
    ``expires_at``."""

    writer: str
    expires_at: float
    chunks: list[str]
    tenants: dict[str, str]


def encode_lease(lease: Lease, mac_key: bytes, path: str) -> bytes:
    """A lease's bytes: JSON with a MAC over it and the name it is written at."""
    doc = {"writer": lease.writer, "expires_at": lease.expires_at,
           "chunks": sorted(lease.chunks), "tenants": lease.tenants}
    mac = _mac(mac_key, _LEASE_DOMAIN, path.encode() + b"\0", _canonical(doc)).hex()
    return _canonical({**doc, "mac": mac})


def decode_lease(data: bytes | bytearray, mac_key: bytes, path: str) -> Lease:
    """A lease read from ``path``, its MAC and every field checked.

    Raises:
        SharedObjectError: ``corrupt`` (not a lease, a field of the wrong type, a
            time that is not finite) or ``tampered`` (no MAC, or another's).
    """
    try:
        doc = json.loads(bytes(data), parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise SharedObjectError("corrupt", f"{path}: a lease that is not JSON") from None
    doc = _dict(doc, "a lease", {"writer", "expires_at", "chunks", "tenants", "mac"})
    mac = doc.pop("mac")
    want = _mac(mac_key, _LEASE_DOMAIN, path.encode() + b"\0", _canonical(doc)).hex()
    if not isinstance(mac, str) or not hmac.compare_digest(mac, want):
        raise SharedObjectError("tampered", f"{path}: lease MAC mismatch")
    chunks, tenants = doc["chunks"], doc["tenants"]
    if (not isinstance(chunks, list) or not all(isinstance(c, str) for c in chunks)
            or not isinstance(tenants, dict)
            or not all(isinstance(v, str) for v in tenants.values())):
        raise _fail("a lease's chunks must be names and its tenants sealed text")
    return Lease(_text(doc["writer"], "writer"),
                 _number(doc["expires_at"], "expires_at", 0.0, 1e12), chunks, tenants)
