"""Session manifests, the index, session-id rules and the on-disk block layout.

Store layout::

    {root}/index.json                      sessions, for discovery (written last)
    {root}/{session_id}/manifest.json      the authoritative description of a session
    {root}/{session_id}/k_packed.bin ...   segment 0: the first shadow
    {root}/{session_id}/seg-000003.k_packed.bin ...   later segments (immutable)

Blob layout ("block-major"): a segment holds one blob per tensor of
:data:`gpu_cache.TENSOR_NAMES`. Inside a blob, blocks follow one another; block ``i``
occupies bytes ``[i * B, (i + 1) * B)`` where ``B`` is the tensor's bytes per block,
and is stored as the C-contiguous array ``[num_layers, block_size, num_kv_heads,
...]`` (the cache's 5D tensor with the block axis taken out). So every block is one
contiguous byte range with its own checksum, and new blocks append.

A manifest names the segments it uses and, per block, its segment, byte offsets and
per-tensor checksums; bytes in a segment that no block references are garbage left by
removed blocks, reclaimed by compaction.
"""

from __future__ import annotations

import base64
import json
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gpu_cache import TENSOR_NAMES, CacheIdentity, CacheIdentityError, InvalidNameError
from gpu_cache.calibration import key_offset_digest
from gpu_cache.ids import MAX_NAME_LENGTH, validate_name
from shadow._errors import CorruptShadowError, InvalidSessionIdError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_KEY",
    "MAX_SESSION_ID_LENGTH",
    "BlockRecord",
    "Manifest",
    "SegmentRecord",
    "SessionInfo",
    "block_shapes",
    "checksum",
    "manifest_key",
    "segment_files",
    "validate_session_id",
]

FORMAT_NAME = "contextkit-shadow"
#: Version of the manifest format; readers refuse newer versions.
FORMAT_VERSION = 1
INDEX_KEY = "index.json"
MAX_SESSION_ID_LENGTH = MAX_NAME_LENGTH
#: Checksum algorithm of block slices (zlib CRC-32, several GB/s, catches torn writes).
CHECKSUM = "crc32"
_NUMPY_DTYPES = {"k_packed": np.uint8, "v_packed": np.uint8,
                 "k_norms": np.float32, "v_norms": np.float32}


def validate_session_id(session_id: object) -> str:
    """Return ``session_id`` if it is a safe single path component.

    The rule is :func:`gpu_cache.ids.validate_name`'s, the same as for tenants.

    Raises:
        InvalidSessionIdError: not 1-128 characters of letters, digits and ``_.:@-``
            starting with a letter or digit, ``..``, or a reserved name (``index.json``).
    """
    try:
        return validate_name(session_id, "session id")
    except InvalidNameError as exc:
        raise InvalidSessionIdError(str(exc)) from None


def manifest_key(session_id: str) -> str:
    return f"{validate_session_id(session_id)}/manifest.json"


def segment_files(session_id: str, segment_id: int) -> dict[str, str]:
    """Store keys of a segment's blobs; segment 0 uses the plain base names."""
    stem = "" if segment_id == 0 else f"seg-{segment_id:06d}."
    return {name: f"{session_id}/{stem}{name}.bin" for name in TENSOR_NAMES}


def block_shapes(identity: CacheIdentity) -> dict[str, tuple[int, ...]]:
    """Per tensor, the shape of one block in a blob (``[L, BS, H, ...]``)."""
    base = (identity.num_layers, identity.block_size, identity.num_kv_heads)
    packed = (*base, identity.head_dim // 2)
    return {"k_packed": packed, "k_norms": base, "v_packed": packed, "v_norms": base}


def block_dtypes() -> dict[str, Any]:
    return dict(_NUMPY_DTYPES)


def block_nbytes(identity: CacheIdentity) -> dict[str, int]:
    """Per tensor, the bytes of one block."""
    return {name: int(np.prod(shape)) * np.dtype(_NUMPY_DTYPES[name]).itemsize
            for name, shape in block_shapes(identity).items()}


def checksum(data: Any) -> int:
    """CRC-32 of a contiguous buffer."""
    return zlib.crc32(data)


@dataclass(slots=True)
class SegmentRecord:
    """One immutable set of four blobs."""

    segment_id: int
    files: dict[str, str]
    num_blocks: int
    kind: str = "incremental"  # "base", "incremental" or "compaction"

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.segment_id, "files": self.files, "num_blocks": self.num_blocks,
                "kind": self.kind}


@dataclass(slots=True)
class BlockRecord:
    """A block of a shadowed session: semantic metadata plus where its bytes are."""

    key: str | None  # hex content key; None for blocks still being filled
    source_layer: str
    importance: float
    token_range: tuple[int, int]
    tenant: str
    pinned: bool
    num_tokens: int
    segment_id: int
    offsets: dict[str, int]
    checksums: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "source_layer": self.source_layer,
                "importance": self.importance, "token_range": list(self.token_range),
                "tenant": self.tenant, "pinned": self.pinned, "num_tokens": self.num_tokens,
                "segment": self.segment_id, "offsets": self.offsets,
                "checksums": self.checksums}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BlockRecord:
        key = data["key"]
        if key is not None:
            bytes.fromhex(key)  # ValueError on garbage
        tr = data["token_range"]
        offsets = {n: int(data["offsets"][n]) for n in TENSOR_NAMES}
        checksums = {n: int(data["checksums"][n]) for n in TENSOR_NAMES}
        return cls(key=key, source_layer=str(data["source_layer"]),
                   importance=float(data["importance"]), token_range=(int(tr[0]), int(tr[1])),
                   tenant=str(data["tenant"]), pinned=bool(data["pinned"]),
                   num_tokens=int(data["num_tokens"]), segment_id=int(data["segment"]),
                   offsets=offsets, checksums=checksums)

    def meta_for_import(self) -> dict[str, object]:
        """The metadata dict :meth:`gpu_cache.TQGPUCache.import_blocks` takes."""
        meta: dict[str, object] = {
            "source_layer": self.source_layer, "importance": self.importance,
            "token_range": self.token_range, "tenant_slug": self.tenant,
            "num_tokens": self.num_tokens,
        }
        if self.key is not None:
            meta["key"] = bytes.fromhex(self.key)
        return meta


@dataclass(slots=True)
class Manifest:
    """Authoritative description of a shadowed session (``manifest.json``)."""

    session_id: str
    identity: CacheIdentity
    generation: int
    segments: list[SegmentRecord]
    blocks: list[BlockRecord]
    next_segment: int
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    #: the cache's per-head key offsets (float32 ``[L, H, D]``, little-endian), if any
    key_offsets: bytes | None = None

    def key_offsets_tensor(self) -> torch.Tensor | None:
        """The key offsets as a tensor, for building a cache of this identity."""
        if self.key_offsets is None:
            return None
        i = self.identity
        flat = np.frombuffer(self.key_offsets, dtype="<f4").copy()
        return torch.from_numpy(flat).reshape(i.num_layers, i.num_kv_heads, i.head_dim)

    @property
    def block_nbytes(self) -> dict[str, int]:
        return block_nbytes(self.identity)

    @property
    def bytes_per_block(self) -> int:
        return sum(self.block_nbytes.values())

    @property
    def num_bytes(self) -> int:
        """Bytes of the live blocks (what a recovery reads)."""
        return len(self.blocks) * self.bytes_per_block

    @property
    def stored_bytes(self) -> int:
        """Bytes of every referenced segment, garbage included."""
        return sum(s.num_blocks for s in self.segments) * self.bytes_per_block

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "session_id": self.session_id,
            "identity": self.identity.to_dict(),
            "generation": self.generation,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "checksum": CHECKSUM,
            "layout": "block-major [num_layers, block_size, num_kv_heads, ...] per block",
            "tensors": {n: {"dtype": np.dtype(_NUMPY_DTYPES[n]).name, "block_bytes": b,
                            "block_shape": list(block_shapes(self.identity)[n])}
                        for n, b in self.block_nbytes.items()},
            "next_segment": self.next_segment,
            "key_offsets": (base64.b64encode(self.key_offsets).decode()
                            if self.key_offsets is not None else None),
            "segments": [s.to_dict() for s in self.segments],
            "blocks": [b.to_dict() for b in self.blocks],
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str = "manifest") -> Manifest:
        """Parse and validate a manifest.

        Raises:
            CorruptShadowError: not JSON, another format, a newer version, missing
                or malformed fields, or segments/offsets that do not add up.
            CacheIdentityError: the identity block itself is unreadable.
        """
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptShadowError(
                f"{where} is not valid JSON ({exc}); the session cannot be recovered - "
                "delete it or restore it from a backup") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise CorruptShadowError(f"{where} is not a {FORMAT_NAME} manifest")
        version = doc.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise CorruptShadowError(f"{where} has format_version {version!r}; this contextkit "
                                     f"reads up to {FORMAT_VERSION} - upgrade contextkit")
        try:
            identity = CacheIdentity.from_dict(doc["identity"])
            if doc.get("checksum", CHECKSUM) != CHECKSUM:
                raise CorruptShadowError(f"{where} uses checksum {doc['checksum']!r}; only "
                                         f"{CHECKSUM!r} is known")
            segments = [SegmentRecord(segment_id=int(s["id"]),
                                      files={n: str(s["files"][n]) for n in TENSOR_NAMES},
                                      num_blocks=int(s["num_blocks"]),
                                      kind=str(s.get("kind", "incremental")))
                        for s in doc["segments"]]
            blocks = [BlockRecord.from_dict(b) for b in doc["blocks"]]
            manifest = cls(session_id=validate_session_id(doc["session_id"]), identity=identity,
                           generation=int(doc["generation"]), segments=segments, blocks=blocks,
                           next_segment=int(doc["next_segment"]),
                           created_at=float(doc["created_at"]),
                           updated_at=float(doc["updated_at"]),
                           key_offsets=(base64.b64decode(doc["key_offsets"], validate=True)
                                        if doc.get("key_offsets") else None))
        except CacheIdentityError:
            raise
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            if isinstance(exc, CorruptShadowError):
                raise
            raise CorruptShadowError(f"{where} is missing or has malformed fields "
                                     f"({type(exc).__name__}: {exc})") from None
        manifest._check_consistent(where)
        offsets = manifest.key_offsets_tensor() if manifest.key_offsets is not None else None
        want = manifest.identity
        if manifest.key_offsets is not None and (
                len(manifest.key_offsets) != 4 * want.num_layers * want.num_kv_heads * want.head_dim
                or key_offset_digest(offsets) != want.key_offset_digest):
            raise CorruptShadowError(f"{where} holds key offsets that do not match its identity "
                                     "(key_offset_digest); the session cannot be trusted")
        if manifest.key_offsets is None and want.key_offset_digest:
            raise CorruptShadowError(f"{where} names key offsets in its identity but does not "
                                     "carry them; the session cannot be rebuilt")
        return manifest

    def _check_consistent(self, where: str) -> None:
        sizes = self.block_nbytes
        by_id = {s.segment_id: s for s in self.segments}
        for i, b in enumerate(self.blocks):
            seg = by_id.get(b.segment_id)
            if seg is None:
                raise CorruptShadowError(f"{where}: block {i} names segment {b.segment_id}, "
                                         "which the manifest does not list")
            for name in TENSOR_NAMES:
                off = b.offsets[name]
                if off < 0 or off % sizes[name] or off // sizes[name] >= seg.num_blocks:
                    raise CorruptShadowError(f"{where}: block {i} has offset {off} in "
                                             f"{name}, outside segment {seg.segment_id}")

    def info(self) -> SessionInfo:
        return SessionInfo(session_id=self.session_id, generation=self.generation,
                           num_blocks=len(self.blocks), num_bytes=self.num_bytes,
                           updated_at=self.updated_at, identity=self.identity)


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """What discovery reports about a shadowed session."""

    session_id: str
    generation: int
    num_blocks: int
    num_bytes: int
    updated_at: float
    identity: CacheIdentity | None = None
    error: str | None = None  # why the session's manifest could not be read

    def to_dict(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "generation": self.generation,
                "num_blocks": self.num_blocks, "num_bytes": self.num_bytes,
                "updated_at": self.updated_at,
                "identity": self.identity.to_dict() if self.identity else None,
                "error": self.error}
