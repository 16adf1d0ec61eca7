"""Block format specs: what each format stores per block, in which dtypes and sizes.

Pure data and arithmetic (no kernels): the cache identity, tier storage and the shadow
manifest read these; :mod:`gpu_cache.formats` encodes and decodes.

A cache holds blocks of one format (its identity's ``codec``); a store that mixes
precisions keeps one cache per format. Every format fills the same four tensors
(:data:`TENSOR_NAMES`), laid out ``[num_layers, num_blocks, block_size, ...]``:

========  =========================  ========  ==========================  ============
format    ``*_packed`` per token     dtype     ``*_norms`` per token       bytes/token-
          and head                             and head                    head (D=64)
========  =========================  ========  ==========================  ============
tq4       D/2 (two 4-bit codes)      uint8     1 float32 (norm)            36
k5v4      keys 5D/8 (5-bit codes),   uint8     1 float32 (norm)            44 K, 36 V
          values D/2 (as tq4)
int8      D (rotated, absmax)        int8      1 float32 (scale)           68
fp16      D                          float16   none (trailing dim 0)       128
native    D                          float32   none (trailing dim 0)       256
========  =========================  ========  ==========================  ============

``k5v4`` spends one more bit on the keys than on the values: attention scores are
inner products with the keys, and on SmolLM2 nearly all of TQ4's error after a cache
round trip comes from its keys (docs/vllm.md has the measurement). Its keys use the same
rotation and a 5-bit Lloyd-Max codebook for the rotated coordinates, stored as a plane
of low nibbles (split-half order, as tq4) followed by a plane of the fifth bits (eight
coordinates per byte, coordinate ``j`` in bit ``j % 8`` of byte ``j // 8``); its values
are tq4. It needs ``D % 16 == 0`` (whole bytes per token-head for K and V together).

``int8`` rotates with the cache's TQ4 rotation (same seed) so outliers spread over
the coordinates, then stores ``round(r / s)`` with ``s = max|r| / 127`` per vector.
"""

from __future__ import annotations

from typing import Protocol

import torch

from gpu_cache._errors import CodecInputError

__all__ = [
    "FORMATS",
    "PRECISION_RANK",
    "TENSOR_NAMES",
    "VECTOR_DTYPES",
    "BlockLayout",
    "bytes_per_token_head",
    "check_format",
    "check_head_dim",
    "format_sides",
    "has_scale",
    "head_dim_multiple",
    "side_width",
    "tensor_specs",
]


class BlockLayout(Protocol):
    """What :func:`tensor_specs` reads of a cache identity (:class:`gpu_cache.CacheIdentity`)."""

    @property
    def codec(self) -> str: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


#: Known formats, lowest precision first.
FORMATS: tuple[str, ...] = ("tq4", "k5v4", "int8", "fp16", "native")
#: Precision order (higher is more exact).
PRECISION_RANK: dict[str, int] = {fmt: rank for rank, fmt in enumerate(FORMATS)}

#: The four tensors of a tier, in the order moves and shadows handle them.
TENSOR_NAMES = ("k_packed", "k_norms", "v_packed", "v_norms")

#: The encodings of one side (keys or values) of a block; a format is one per side.
VECTOR_DTYPES: dict[str, torch.dtype] = {
    "tq4": torch.uint8, "tq5": torch.uint8, "int8": torch.int8, "fp16": torch.float16,
    "native": torch.float32}
#: Formats whose keys and values are encoded differently: (keys, values).
MIXED_SIDES: dict[str, tuple[str, str]] = {"k5v4": ("tq5", "tq4")}


def format_sides(fmt: str) -> tuple[str, str]:
    """The encodings of a format's (keys, values)."""
    return MIXED_SIDES.get(fmt, (fmt, fmt))


def check_format(fmt: object) -> str:
    """Return ``fmt`` if it names a known format.

    Raises:
        CodecInputError: (a ValueError) one line naming the known formats.
    """
    if not isinstance(fmt, str) or fmt not in PRECISION_RANK:
        raise CodecInputError(f"unknown KV format {fmt!r}; use one of {', '.join(FORMATS)}")
    return fmt


def has_scale(side: str) -> bool:
    return side in ("tq4", "tq5", "int8")


def side_width(side: str, head_dim: int) -> int:
    """Elements of one stored vector of a side encoding."""
    if side == "tq4":
        return head_dim // 2
    if side == "tq5":
        return head_dim * 5 // 8
    return head_dim


def _side_bytes(side: str, head_dim: int) -> int:
    return (side_width(side, head_dim) * VECTOR_DTYPES[side].itemsize
            + (4 if has_scale(side) else 0))


def head_dim_multiple(fmt: str) -> int:
    """What a format asks of head_dim beyond being even (which the cache identity
    checks): a multiple of 16 for k5v4 (eight 5-bit codes in 5 bytes, whole bytes per
    token-head for K and V together), else nothing (1)."""
    return 16 if fmt == "k5v4" else 1


def check_head_dim(fmt: str, head_dim: int) -> None:
    """Raise CodecInputError when ``fmt`` cannot pack vectors of ``head_dim``."""
    if head_dim % head_dim_multiple(fmt):
        raise CodecInputError(f"format {fmt} needs a head_dim divisible by "
                              f"{head_dim_multiple(fmt)}, got {head_dim}; use tq4")


def bytes_per_token_head(fmt: str, head_dim: int) -> int:
    """Stored bytes of one token's key or value vector in one head: the mean of the
    two, which differ only for ``k5v4`` (44 and 36 at D=64, so 40)."""
    fmt = check_format(fmt)
    check_head_dim(fmt, head_dim)
    k_side, v_side = format_sides(fmt)
    return (_side_bytes(k_side, head_dim) + _side_bytes(v_side, head_dim)) // 2


def tensor_specs(identity: BlockLayout) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per tensor name, its trailing shape (after ``[..., num_blocks, block_size]``) and dtype."""
    fmt = check_format(identity.codec)
    heads, dim = identity.num_kv_heads, identity.head_dim
    check_head_dim(fmt, dim)
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, side in zip(("k", "v"), format_sides(fmt), strict=True):
        out[f"{name}_packed"] = ((heads, side_width(side, dim)), VECTOR_DTYPES[side])
        out[f"{name}_norms"] = ((heads,) if has_scale(side) else (0,), torch.float32)
    return out
