"""The checks every field read from a manifest goes through, and the one rule for labels.

Used by :mod:`shadow.manifest` (reading) and :mod:`shadow.writer` (so that nothing is
written that a reader would refuse). Every check runs before anything is sized or
allocated from the value; the identity's sizes are bounded far above any real model, so
a manifest can never make recovery allocate more than a real cache would.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from gpu_cache import TENSOR_NAMES, CacheIdentity

__all__ = ["MAX_BLOCK_BYTES", "MAX_IDENTITY", "MAX_LABEL_LENGTH", "FieldError",
           "check_seconds", "parse_identity", "validate_label"]

#: Longest label (a block's ``source_layer``, a model id) a manifest may hold.
MAX_LABEL_LENGTH = 1024
#: Upper bounds of the identity's sizes (a real model: <= 128 layers, <= 128 KV heads,
#: head_dim <= 576, blocks <= 1024 tokens). A manifest beyond them is refused before
#: anything is sized from it: ``head_dim`` alone sizes a ``[d, d]`` float64 rotation.
MAX_IDENTITY = {"num_layers": 1024, "num_kv_heads": 1024, "head_dim": 1024,
                "block_size": 4096}
#: Largest block (all layers, K and V) an identity may describe: 1 GiB.
MAX_BLOCK_BYTES = 1 << 30


class FieldError(ValueError):
    """A malformed manifest field; the caller adds where and what to do."""


def check_seconds(name: str, value: object, *, positive: bool = False) -> None:
    """A duration must be a finite number, > 0 (``positive``) or >= 0: NaN would compare
    false everywhere and silently disable what it times, infinity overflows a timer.

    Raises:
        ValueError: one line saying what to give.
    """
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value) and (value > 0 if positive else value >= 0))
    if not ok:
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound}, got {value!r}")


def validate_label(value: object, what: str = "label") -> str:
    """Return ``value`` if it is a label a manifest can hold and read back.

    A label is 1-1024 printable characters (:meth:`str.isprintable`): no control
    characters (NUL, newline), no format or zero-width characters, no line or paragraph
    separators, no lone surrogates. Layer names (:mod:`contextkit.prompt.layers`) are a
    subset of labels.

    Raises:
        FieldError: (a ``ValueError``) naming ``what`` and the rule.
    """
    if not isinstance(value, str) or not value or len(value) > MAX_LABEL_LENGTH \
            or not value.isprintable():
        raise FieldError(f"{what} must be a label of 1-{MAX_LABEL_LENGTH} printable "
                         f"characters (no control, zero-width or separator characters), "
                         f"got {value!r:.40}")
    return value


def int_field(value: object, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(value) is not int:  # bool is not an int here, nor is 1.0
        raise FieldError(f"{what} must be an integer, got {value!r:.40}")
    if not lo <= value <= hi:
        raise FieldError(f"{what} = {value} is outside [{lo}, {hi}]")
    return value


def number_field(value: object, what: str, lo: float, hi: float) -> float:
    if type(value) not in (int, float):
        raise FieldError(f"{what} must be a number, got {value!r:.40}")
    number = float(value)  # type: ignore[arg-type]
    if not math.isfinite(number) or not lo <= number <= hi:
        raise FieldError(f"{what} = {number} is outside [{lo}, {hi}]")
    return number


def text_field(value: object, what: str, *, empty: bool = False) -> str:
    if empty and value == "":
        return ""
    return validate_label(value, what)


def mapping_field(value: object, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise FieldError(f"{what} must be an object, got {type(value).__name__}")
    return value


def list_field(value: object, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise FieldError(f"{what} must be a list, got {type(value).__name__}")
    return value


def per_tensor_field(value: object, what: str, hi: int) -> dict[str, int]:
    data = mapping_field(value, what)
    if set(data) != set(TENSOR_NAMES):
        raise FieldError(f"{what} must name exactly {list(TENSOR_NAMES)}")
    return {n: int_field(data[n], f"{what}.{n}", 0, hi) for n in TENSOR_NAMES}


def parse_identity(value: object) -> CacheIdentity:
    """A manifest's identity, every field type- and range-checked first.

    Raises:
        FieldError: a field of the wrong type or out of range (sizes beyond
            :data:`MAX_IDENTITY`, or blocks beyond :data:`MAX_BLOCK_BYTES`).
        CacheIdentityError: unknown fields (a newer contextkit wrote it).
    """
    data = mapping_field(value, "identity")
    checked: dict[str, Any] = {}
    for f in dataclasses.fields(CacheIdentity):
        if f.name not in data:
            continue
        v = data[f.name]
        if f.name in MAX_IDENTITY:
            checked[f.name] = int_field(v, f"identity.{f.name}", 1, MAX_IDENTITY[f.name])
        elif f.name in ("rotation_seed", "schema_version"):
            checked[f.name] = int_field(v, f"identity.{f.name}", 0, (1 << 64) - 1)
        elif f.name == "model_id":
            checked[f.name] = text_field(v, "identity.model_id")
        else:
            checked[f.name] = text_field(v, f"identity.{f.name}", empty=True)
    unknown = set(data) - {f.name for f in dataclasses.fields(CacheIdentity)}
    checked.update({k: data[k] for k in unknown})  # from_dict names them
    try:
        identity = CacheIdentity.from_dict(checked)
    except ValueError as exc:  # __post_init__: odd head_dim, unknown codec
        raise FieldError(f"identity: {exc}") from None
    if identity.bytes_per_block > MAX_BLOCK_BYTES:
        raise FieldError(f"identity describes blocks of {identity.bytes_per_block:,} bytes, "
                         f"more than the {MAX_BLOCK_BYTES:,} a shadow may hold")
    return identity
