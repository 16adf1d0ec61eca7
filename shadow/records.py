"""The records of a session's manifest: one per segment, one per block.

A :class:`SegmentRecord` names an immutable set of four blobs; a :class:`BlockRecord`
carries a block's semantic metadata and where its bytes are (segment, offsets,
checksums, MAC). :mod:`shadow.manifest` holds them; the chunk index reads block records.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpu_cache import InvalidNameError
from gpu_cache.ids import validate_tenant
from shadow._fields import (
    FieldError,
    int_field,
    list_field,
    mapping_field,
    number_field,
    per_tensor_field,
    validate_label,
)
from shadow.auth import BLOCK_MAC_HEX, BLOCK_NONCE_HEX

__all__ = ["BlockRecord", "SegmentRecord", "segment_name"]

_KEY_HEX = 64  # block keys are SHA-256 digests
_MAC = re.compile(f"[0-9a-f]{{{BLOCK_MAC_HEX}}}")
_NONCE = re.compile(f"[0-9a-f]{{{BLOCK_NONCE_HEX}}}")
_FieldError = FieldError
_int, _number, _mapping, _list = int_field, number_field, mapping_field, list_field
_per_tensor = per_tensor_field


def segment_name(segment_id: int, token: str = "") -> str:
    """A segment's name: ``seg-000003-<token>``; without a token (format 1), the legacy
    ``seg-000003`` (whose segment 0 had the plain base names)."""
    return f"seg-{segment_id:06d}-{token}" if token else f"seg-{segment_id:06d}"



@dataclass(slots=True)
class SegmentRecord:
    """One immutable set of four blobs, written once under names never used before."""

    segment_id: int
    files: dict[str, str]
    num_blocks: int
    kind: str = "incremental"  # "base", "incremental" or "compaction"
    token: str = ""  # random, part of the file names ("" in format 1)

    @property
    def name(self) -> str:
        """The segment's unique name (what block MACs bind a block's position to)."""
        return segment_name(self.segment_id, self.token)

    def to_dict(self) -> dict[str, Any]:
        # the token is not stored apart: the file names carry it (one source of truth)
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
    #: :func:`shadow.auth.block_mac` of its bytes (with a key; ``None`` unsigned)
    mac: str | None = None
    #: the random nonce (hex) the MAC's one-time key was derived with (with a key)
    mac_nonce: str | None = None

    def to_dict(self) -> dict[str, Any]:
        doc = {"key": self.key, "source_layer": self.source_layer,
               "importance": self.importance, "token_range": list(self.token_range),
               "tenant": self.tenant, "pinned": self.pinned, "num_tokens": self.num_tokens,
               "segment": self.segment_id, "offsets": self.offsets,
               "checksums": self.checksums}
        if self.mac is not None:
            doc["mac"] = self.mac
        if self.mac_nonce is not None:
            doc["mac_nonce"] = self.mac_nonce
        return doc

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], block_size: int | None = None,
                  what: str = "block") -> BlockRecord:
        """Parse one record, checking every field's type and range.

        Raises:
            ValueError: (a private subclass) naming the bad field.
            KeyError: a missing field.
        """
        data = _mapping(data, what)
        key = data["key"]
        if key is not None:
            if not isinstance(key, str) or len(key) != _KEY_HEX:
                raise _FieldError(f"{what}.key must be {_KEY_HEX} hex digits or null")
            try:
                bytes.fromhex(key)
            except ValueError:
                raise _FieldError(f"{what}.key is not hex") from None
        tr = _list(data["token_range"], f"{what}.token_range")
        if len(tr) != 2:
            raise _FieldError(f"{what}.token_range must be [start, end]")
        start = _int(tr[0], f"{what}.token_range[0]")
        end = _int(tr[1], f"{what}.token_range[1]", start)
        try:
            tenant = validate_tenant(data["tenant"])
        except InvalidNameError as exc:
            raise _FieldError(f"{what}.tenant: {exc}") from None
        pinned = data["pinned"]
        if not isinstance(pinned, bool):
            raise _FieldError(f"{what}.pinned must be true or false, got {pinned!r:.40}")
        mac = data.get("mac")
        if mac is not None and (not isinstance(mac, str) or not _MAC.fullmatch(mac)):
            raise _FieldError(f"{what}.mac must be {BLOCK_MAC_HEX} hex digits")
        nonce = data.get("mac_nonce")
        if nonce is not None and (not isinstance(nonce, str) or not _NONCE.fullmatch(nonce)):
            raise _FieldError(f"{what}.mac_nonce must be {BLOCK_NONCE_HEX} hex digits")
        return cls(key=key, source_layer=validate_label(data["source_layer"],
                                                        f"{what}.source_layer"),
                   importance=_number(data["importance"], f"{what}.importance", 0.0, 1.0),
                   token_range=(start, end), tenant=tenant, pinned=pinned,
                   num_tokens=_int(data["num_tokens"], f"{what}.num_tokens", 0,
                                   block_size if block_size is not None else 1 << 62),
                   segment_id=_int(data["segment"], f"{what}.segment"),
                   offsets=_per_tensor(data["offsets"], f"{what}.offsets", 1 << 62),
                   checksums=_per_tensor(data["checksums"], f"{what}.checksums",
                                         0xFFFFFFFF), mac=mac, mac_nonce=nonce)

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
