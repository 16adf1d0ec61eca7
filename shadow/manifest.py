"""Session manifests, the index, session-id rules and the on-disk block layout.

Store layout::

    {root}/index.json                      sessions, for discovery (written last)
    {root}/{session_id}/manifest.json      the authoritative description of a session
    {root}/{session_id}/head.json          its newest generation (see shadow.freshness)
    {root}/{session_id}/seg-000003-<token>.k_packed.bin ...   segments (immutable)

A segment's file names carry a random token, so no segment is ever written twice under
one name, even by a writer that lost track of what was committed (format 1 named
segment 0 ``k_packed.bin`` and later ones ``seg-000003.k_packed.bin``; still read).

Blob layout ("block-major"): a segment holds one blob per tensor of
:data:`gpu_cache.TENSOR_NAMES`. Inside a blob, blocks follow one another; block ``i``
occupies bytes ``[i * B, (i + 1) * B)`` where ``B`` is the tensor's bytes per block,
and is stored as the C-contiguous array ``[num_layers, block_size, num_kv_heads,
...]`` (the cache's 5D tensor with the block axis taken out). So every block is one
contiguous byte range with its own checksum, and new blocks append.

A manifest names the segments it uses and, per block, its segment, byte offsets,
per-tensor checksums and, with a key, the block's MAC (:func:`shadow.auth.block_mac`)
and the random nonce its one-time MAC key was derived with;
bytes in a segment that no block references are garbage left by removed blocks,
reclaimed by compaction.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import secrets
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gpu_cache import TENSOR_NAMES, CacheIdentity, CacheIdentityError, InvalidNameError
from gpu_cache.calibration import key_offset_digest
from gpu_cache.format_specs import FORMATS, tensor_specs
from gpu_cache.ids import MAX_NAME_LENGTH, validate_name
from shadow._chunk_index import ChunkSection
from shadow._errors import CorruptShadowError, InvalidSessionIdError
from shadow._fields import (
    FieldError,
    int_field,
    list_field,
    mapping_field,
    number_field,
    parse_identity,
    per_tensor_field,
    validate_label,
)
from shadow.auth import sign, verify
from shadow.records import BlockRecord, SegmentRecord, segment_name

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_KEY",
    "MAX_SESSION_ID_LENGTH",
    "BlockRecord",
    "Manifest",
    "SegmentRecord",
    "SessionInfo",
    "block_dtypes",
    "block_nbytes",
    "block_shapes",
    "checksum",
    "manifest_key",
    "new_segment_token",
    "parse_identity",
    "segment_files",
    "segment_name",
    "validate_label",
    "validate_session_id",
]

FORMAT_NAME = "contextkit-shadow"
#: Version of the manifest format; readers refuse newer versions. 2: segment names carry
#: a random token (never reused), block records a MAC (with a key).
FORMAT_VERSION = 2
INDEX_KEY = "index.json"
MAX_SESSION_ID_LENGTH = MAX_NAME_LENGTH
#: Checksum algorithm of block slices (zlib CRC-32, several GB/s, catches torn writes).
CHECKSUM = "crc32"
SEGMENT_KINDS = ("base", "incremental", "compaction")
_TOKEN_HEX = 16  # segment tokens: 64 random bits
_TOKEN_IN_NAME = re.compile(f"seg-[0-9]{{6}}-([0-9a-f]{{{_TOKEN_HEX}}})\\.{TENSOR_NAMES[0]}\\.bin")
_FieldError = FieldError
_int, _number, _mapping, _list = int_field, number_field, mapping_field, list_field
_per_tensor = per_tensor_field
_NUMPY_OF = {torch.uint8: np.uint8, torch.int8: np.int8, torch.float16: np.float16,
             torch.float32: np.float32}


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


def segment_files(session_id: str, segment_id: int, token: str = "") -> dict[str, str]:
    """Store keys of a segment's blobs: ``{session}/seg-000003-<token>.k_packed.bin``...

    Without a token, the names format 1 used (segment 0: ``k_packed.bin``...).
    """
    if token:
        stem = f"{segment_name(segment_id, token)}."
    else:
        stem = "" if segment_id == 0 else f"seg-{segment_id:06d}."
    return {name: f"{session_id}/{stem}{name}.bin" for name in TENSOR_NAMES}


def block_shapes(identity: CacheIdentity) -> dict[str, tuple[int, ...]]:
    """Per tensor, the shape of one block in a blob (``[L, BS, ...]``), in the identity's
    codec (:func:`gpu_cache.format_specs.tensor_specs`; fp16/native norms are empty)."""
    lead = (identity.num_layers, identity.block_size)
    return {name: (*lead, *shape) for name, (shape, _) in tensor_specs(identity).items()}


def block_dtypes(identity: CacheIdentity) -> dict[str, np.dtype[Any]]:
    """Per tensor, the numpy dtype of a block in the identity's codec."""
    return {name: np.dtype(_NUMPY_OF[dtype])
            for name, (_, dtype) in tensor_specs(identity).items()}


def block_nbytes(identity: CacheIdentity) -> dict[str, int]:
    """Per tensor, the bytes of one block (0 for the empty norms of fp16/native)."""
    dtypes = block_dtypes(identity)
    return {name: int(np.prod(shape)) * dtypes[name].itemsize
            for name, shape in block_shapes(identity).items()}


def checksum(data: Any) -> int:
    """CRC-32 of a contiguous buffer."""
    return zlib.crc32(data)


def _token_of(files: dict[str, Any], session_id: str, segment_id: int) -> str:
    """The token a segment's file names carry ("" for format 1's names); the caller
    then checks every name against :func:`segment_files`."""
    first = files.get(TENSOR_NAMES[0])
    prefix = f"{session_id}/"
    if isinstance(first, str) and first.startswith(prefix):
        match = _TOKEN_IN_NAME.fullmatch(first[len(prefix):])
        if match is not None:
            return match.group(1)
    return ""


def new_segment_token() -> str:
    """A random token that makes a segment's file names unique: a segment is never
    rewritten under a name it (or any earlier writer) used, whatever the writer knows."""
    return secrets.token_hex(_TOKEN_HEX // 2)


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
    #: the cache's chunk index over these blocks (``chunks``, ``block_hops``; see
    #: :mod:`shadow._chunk_index`)
    chunk_index: ChunkSection = field(default_factory=ChunkSection)
    #: whether the manifest read carried a MAC that checked out (not stored)
    authenticated: bool = False
    #: block records that could not be read: manifest position -> why (not stored; the
    #: other records, other tenants' included, are recovered)
    bad_records: dict[int, str] = field(default_factory=dict)
    #: why this manifest is older than the newest generation recorded for its session,
    #: when the reader accepted that (not stored; see :mod:`shadow.freshness`)
    rollback: str | None = None

    def positions(self) -> list[int]:
        """Each of :attr:`blocks`' position among all the records the manifest holds."""
        if not self.bad_records:
            return list(range(len(self.blocks)))
        total = len(self.blocks) + len(self.bad_records)
        return [i for i in range(total) if i not in self.bad_records]

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

    def to_json(self, key: bytes | None = None) -> bytes:
        """The manifest file; with ``key``, it carries a MAC over its whole content."""
        doc: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "session_id": self.session_id,
            "identity": self.identity.to_dict(),
            "generation": self.generation,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "checksum": CHECKSUM,
            "layout": "block-major [num_layers, block_size, num_kv_heads, ...] per block",
            "tensors": {n: {"dtype": block_dtypes(self.identity)[n].name, "block_bytes": b,
                            "block_shape": list(block_shapes(self.identity)[n])}
                        for n, b in self.block_nbytes.items()},
            "next_segment": self.next_segment,
            "key_offsets": (base64.b64encode(self.key_offsets).decode()
                            if self.key_offsets is not None else None),
            "segments": [s.to_dict() for s in self.segments],
            "blocks": [b.to_dict() for b in self.blocks],
            **self.chunk_index.to_doc(),
        }
        if key is not None:
            doc["mac"] = sign(doc, key, "manifest")
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str = "manifest", *,
                  key: bytes | None = None) -> Manifest:
        """Authenticate, parse and validate a manifest; nothing is trusted before the MAC.

        Every field is type- and range-checked here, so a manifest that parses can be
        recovered without surprises (no allocation happens before this returns).

        Args:
            raw: the file's bytes.
            where: names the file in errors.
            key: the MAC key; ``None`` reads unauthenticated manifests only.

        Raises:
            TamperedShadowError: ``key`` is given and the MAC is missing or wrong.
            UnauthenticatedShadowError: no ``key`` but the manifest carries a MAC.
            CorruptShadowError: not JSON, another format, a newer version, missing
                or malformed fields, or segments/offsets that do not add up.
            CacheIdentityError: the identity names fields this contextkit does not know.
        """
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise CorruptShadowError(
                f"{where} is not valid JSON ({str(exc).splitlines()[0][:80]}); the session "
                "cannot be recovered - delete it or restore it from a backup") from None
        if not isinstance(doc, dict):
            raise CorruptShadowError(f"{where} is not a {FORMAT_NAME} manifest")
        authenticated = verify(doc, key, "manifest", where)
        if doc.get("format") != FORMAT_NAME:
            raise CorruptShadowError(f"{where} is not a {FORMAT_NAME} manifest")
        version = doc.get("format_version")
        if type(version) is not int or not 1 <= version <= FORMAT_VERSION:
            raise CorruptShadowError(f"{where} has format_version {version!r:.20}; this "
                                     f"contextkit reads up to {FORMAT_VERSION} - upgrade "
                                     "contextkit")
        identity = doc.get("identity")
        codec = identity.get("codec") if isinstance(identity, dict) else None
        if isinstance(codec, str) and codec not in FORMATS:
            raise CorruptShadowError(f"{where} stores blocks in format {codec[:20]!r}, which this "
                                     f"contextkit does not know (it reads {', '.join(FORMATS)}); "
                                     "upgrade contextkit to recover the session, or delete it")
        try:
            manifest = cls._parse(doc, where)
        except CacheIdentityError:
            raise
        except CorruptShadowError:
            raise
        except InvalidSessionIdError as exc:
            raise CorruptShadowError(f"{where} names an invalid session: {exc}") from None
        except KeyError as exc:
            raise CorruptShadowError(f"{where} is missing field {exc}; the session cannot be "
                                     "recovered - delete it or restore it from a backup") \
                from None
        except (TypeError, ValueError, IndexError, binascii.Error) as exc:
            raise CorruptShadowError(f"{where} has a malformed field ({exc}); the session "
                                     "cannot be recovered - delete it or restore it from a "
                                     "backup") from None
        manifest.authenticated = authenticated
        return manifest

    @classmethod
    def _parse(cls, doc: dict[str, Any], where: str) -> Manifest:
        identity = parse_identity(doc["identity"])
        if doc.get("checksum", CHECKSUM) != CHECKSUM:
            raise CorruptShadowError(f"{where} uses checksum {doc['checksum']!r:.20}; only "
                                     f"{CHECKSUM!r} is known")
        session_id = validate_session_id(doc["session_id"])
        next_segment = _int(doc["next_segment"], "next_segment", 0, 1 << 40)
        segments = []
        for i, raw_seg in enumerate(_list(doc["segments"], "segments")):
            seg = _mapping(raw_seg, f"segments[{i}]")
            seg_id = _int(seg["id"], f"segments[{i}].id", 0, max(0, next_segment - 1))
            files = _mapping(seg["files"], f"segments[{i}].files")
            token = _token_of(files, session_id, seg_id)
            own = segment_files(session_id, seg_id, token)
            if files != own:
                raise _FieldError(f"segments[{i}].files must be this session's own blobs "
                                  f"{sorted(own.values())}")
            kind = seg.get("kind", "incremental")
            if kind not in SEGMENT_KINDS:
                raise _FieldError(f"segments[{i}].kind must be one of {SEGMENT_KINDS}")
            segments.append(SegmentRecord(
                segment_id=seg_id, files=dict(files), kind=kind, token=token,
                num_blocks=_int(seg["num_blocks"], f"segments[{i}].num_blocks", 0, 1 << 40)))
        if len({s.segment_id for s in segments}) != len(segments):
            raise _FieldError("segments lists a segment id twice")
        blocks, bad = _parse_records(_list(doc["blocks"], "blocks"), identity.block_size)
        raw_offsets = doc.get("key_offsets")
        if raw_offsets is not None and not isinstance(raw_offsets, str):
            raise _FieldError("key_offsets must be base64 text or null")
        manifest = cls(session_id=session_id, identity=identity,
                       generation=_int(doc["generation"], "generation", 0),
                       segments=segments, blocks=blocks, next_segment=next_segment,
                       bad_records=bad,
                       created_at=_number(doc["created_at"], "created_at", 0.0, 1e12),
                       updated_at=_number(doc["updated_at"], "updated_at", 0.0, 1e12),
                       key_offsets=(base64.b64decode(raw_offsets, validate=True)
                                    if raw_offsets else None),
                       chunk_index=ChunkSection.from_doc(doc, blocks, identity.block_size))
        manifest._check_consistent(where)
        want = manifest.identity
        if manifest.key_offsets is not None and (
                len(manifest.key_offsets) != 4 * want.num_layers * want.num_kv_heads * want.head_dim
                or key_offset_digest(manifest.key_offsets_tensor()) != want.key_offset_digest):
            raise CorruptShadowError(f"{where} holds key offsets that do not match its identity "
                                     "(key_offset_digest); the session cannot be trusted")
        if manifest.key_offsets is None and want.key_offset_digest:
            raise CorruptShadowError(f"{where} names key offsets in its identity but does not "
                                     "carry them; the session cannot be rebuilt")
        return manifest

    def _check_consistent(self, where: str) -> None:
        """Offsets within their segments, one slot per block (positions are those of
        :meth:`positions`: the manifest's)."""
        sizes = self.block_nbytes
        by_id = {s.segment_id: s for s in self.segments}
        slots: set[tuple[int, int]] = set()
        for i, b in zip(self.positions(), self.blocks, strict=True):
            seg = by_id.get(b.segment_id)
            if seg is None:
                raise CorruptShadowError(f"{where}: block {i} names segment {b.segment_id}, "
                                         "which the manifest does not list")
            index = b.offsets[TENSOR_NAMES[0]] // sizes[TENSOR_NAMES[0]]
            for name in TENSOR_NAMES:
                off = b.offsets[name]
                if not sizes[name]:  # the empty norms of fp16/native: no bytes, offset 0
                    if off:
                        raise CorruptShadowError(f"{where}: block {i} has offset {off} in "
                                                 f"{name}, which holds no bytes")
                    continue
                if off < 0 or off % sizes[name] or off // sizes[name] >= seg.num_blocks:
                    raise CorruptShadowError(f"{where}: block {i} has offset {off} in "
                                             f"{name}, outside segment {seg.segment_id}")
                if off // sizes[name] != index:
                    raise CorruptShadowError(f"{where}: block {i} has offsets that name "
                                             "different blocks in different tensors")
            if (b.segment_id, index) in slots:
                raise CorruptShadowError(f"{where}: block {i} reuses the bytes of another "
                                         f"block (segment {b.segment_id}, slot {index})")
            slots.add((b.segment_id, index))

    def info(self) -> SessionInfo:
        return SessionInfo(session_id=self.session_id, generation=self.generation,
                           num_blocks=len(self.blocks), num_bytes=self.num_bytes,
                           updated_at=self.updated_at, identity=self.identity,
                           authenticated=self.authenticated)


def _parse_records(raw: list[Any], block_size: int) -> tuple[list[BlockRecord], dict[int, str]]:
    """The block records that parse, and why each of the others does not.

    One malformed record costs that block only: the session's other blocks (other
    tenants' included) are still recovered.
    """
    blocks: list[BlockRecord] = []
    bad: dict[int, str] = {}
    for i, item in enumerate(raw):
        what = f"blocks[{i}]"
        try:
            blocks.append(BlockRecord.from_dict(item, block_size, what))
        except KeyError as exc:
            bad[i] = f"{what} is missing field {exc}"
        except (TypeError, ValueError) as exc:
            bad[i] = f"{what} is malformed ({str(exc)[:160]})"
    return blocks, bad


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
    authenticated: bool = False  # its manifest carried a MAC that checked out

    def to_dict(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "generation": self.generation,
                "num_blocks": self.num_blocks, "num_bytes": self.num_bytes,
                "updated_at": self.updated_at,
                "identity": self.identity.to_dict() if self.identity else None,
                "error": self.error, "authenticated": self.authenticated}
