"""Cache identity: everything that must match for cached bytes to be reusable."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, NoReturn

from gpu_cache._errors import CacheIdentityError
from gpu_cache.format_specs import FORMATS, bytes_per_token_head, head_dim_multiple

__all__ = ["CODECS", "SCHEMA_VERSION", "CacheIdentity"]

#: Block codecs = :data:`gpu_cache.format_specs.FORMATS`: "tq4" (4-bit packed nibbles +
#: float32 norms), "k5v4" (5-bit keys, tq4 values), "int8" (rotated int8 + float32
#: scales), "fp16" and "native" (float32 K/V as the model computed them, for exactness
#: checks); see :mod:`gpu_cache.format_specs`.
CODECS = FORMATS

#: Version of the block layout and metadata schema. Bump on any incompatible change.
SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class CacheIdentity:
    """What produced a cache: model, KV shape, block size, codec and rotation seed.

    Two caches can exchange blocks (prefix hits, shadows, recovery) only when their
    identities are equal. The digest salts every block key, so blocks of another
    identity can never match by accident.
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    codec: str = "tq4"
    rotation_seed: int = 0
    tokenizer_id: str = ""
    key_offset_digest: str = ""
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        """Check every field's type and range (a shadow's identity is read from data).

        Raises:
            CacheIdentityError: one line naming the field, what it must be and what it is.
        """
        if not isinstance(self.model_id, str) or not self.model_id:
            _bad("model_id", "a non-empty str", self.model_id)
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "schema_version"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                _bad(name, "a positive int", value)
        if self.head_dim % 2:
            _bad("head_dim", "even for 4-bit packing", self.head_dim)
        if not isinstance(self.codec, str) or self.codec not in CODECS:
            _bad("codec", f"one of {CODECS}", self.codec)
        if self.head_dim % head_dim_multiple(self.codec):
            _bad("head_dim", f"divisible by {head_dim_multiple(self.codec)} for codec "
                 f"{self.codec}", self.head_dim)
        if not _is_int(self.rotation_seed) or not 0 <= self.rotation_seed < 2**64:
            _bad("rotation_seed", "an int in [0, 2**64)", self.rotation_seed)
        for name in ("tokenizer_id", "key_offset_digest"):
            if not isinstance(getattr(self, name), str):
                _bad(name, "a str", getattr(self, name))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CacheIdentity:
        """Rebuild an identity from data (a manifest's ``identity`` object).

        Raises:
            CacheIdentityError: not an object, unknown or missing fields, or a field of
                the wrong type or range (named, with what to do).
        """
        if not isinstance(data, dict):
            raise CacheIdentityError(
                f"identity must be a JSON object, got {type(data).__name__}; the data is "
                "damaged - discard it and let the cache recompute")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise CacheIdentityError(
                f"identity has unknown fields {sorted(unknown)}; it was written by a newer "
                "contextkit - upgrade contextkit to read it"
            )
        try:
            return cls(**data)
        except TypeError as exc:
            raise CacheIdentityError(f"identity is incomplete: {exc}") from exc
        except CacheIdentityError as exc:
            raise CacheIdentityError(
                f"identity is invalid: {exc}; the data is damaged or was written by another "
                "tool - discard it and let the cache recompute") from None

    def digest(self) -> bytes:
        """SHA-256 over the canonical JSON form; the root of every block key."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).digest()

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V, in the codec's format
        (:func:`gpu_cache.format_specs.bytes_per_token_head`)."""
        per_token_head = bytes_per_token_head(self.codec, self.head_dim)
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * per_token_head

    def check_compatible(self, other: CacheIdentity, what: str = "data") -> None:
        """Raise CacheIdentityError naming every field where ``other`` differs."""
        if other == self:
            return
        diffs = [
            f"{f.name}: expected {getattr(self, f.name)!r}, got {getattr(other, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        raise CacheIdentityError(
            f"{what} was produced for a different cache identity ({'; '.join(diffs)}). "
            "Use a cache built for the same model, codec, block size and schema, or "
            "discard the data and let the cache recompute."
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bad(name: str, expected: str, value: object) -> NoReturn:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    raise CacheIdentityError(f"CacheIdentity.{name} must be {expected}, got "
                             f"{type(value).__name__} {shown}")
