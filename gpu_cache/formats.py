"""Block formats: how one block's K/V bytes are stored.

A cache holds blocks of one format (its identity's ``codec``); a store that mixes
precisions keeps one cache per format. Every format fills the same four tensors
(:data:`TENSOR_NAMES`), laid out ``[num_layers, num_blocks, block_size, ...]``:

========  =========================  ========  ==========================  ============
format    ``*_packed`` per token     dtype     ``*_norms`` per token       bytes/token-
          and head                             and head                    head (D=64)
========  =========================  ========  ==========================  ============
tq4       D/2 (two 4-bit codes)      uint8     1 float32 (norm)            36
int8      D (rotated, absmax)        int8      1 float32 (scale)           68
fp16      D                          float16   none (trailing dim 0)       128
native    D                          float32   none (trailing dim 0)       256
========  =========================  ========  ==========================  ============

``int8`` rotates with the cache's TQ4 rotation (same seed) so outliers spread over
the coordinates, then stores ``round(r / s)`` with ``s = max|r| / 127`` per vector.
Key offsets (``TQGPUCache.key_offsets``) apply to the keys of every format: encode
``k - mu[layer]``, decode ``+ mu[layer]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gpu_cache._errors import CodecInputError
from gpu_cache.codec import TQ4Encoded
from gpu_cache.kernels import quantize_into_cache

if TYPE_CHECKING:
    from gpu_cache._storage import LayerView
    from gpu_cache.codec import TQ4Codec
    from gpu_cache.identity import CacheIdentity

__all__ = [
    "FORMATS",
    "PRECISION_RANK",
    "TENSOR_NAMES",
    "bytes_per_token_head",
    "check_format",
    "decode_blocks",
    "encode_into",
    "tensor_specs",
]

#: Known formats, lowest precision first.
FORMATS: tuple[str, ...] = ("tq4", "int8", "fp16", "native")
#: Precision order (higher is more exact).
PRECISION_RANK: dict[str, int] = {fmt: rank for rank, fmt in enumerate(FORMATS)}

#: The four tensors of a tier, in the order moves and shadows handle them.
TENSOR_NAMES = ("k_packed", "k_norms", "v_packed", "v_norms")

_VECTOR_DTYPES: dict[str, torch.dtype] = {
    "tq4": torch.uint8, "int8": torch.int8, "fp16": torch.float16, "native": torch.float32}
_INT8_MAX = 127.0


def check_format(fmt: object) -> str:
    """Return ``fmt`` if it names a known format.

    Raises:
        CodecInputError: (a ValueError) one line naming the known formats.
    """
    if not isinstance(fmt, str) or fmt not in PRECISION_RANK:
        raise CodecInputError(f"unknown KV format {fmt!r}; use one of {', '.join(FORMATS)}")
    return fmt


def _has_scale(fmt: str) -> bool:
    return fmt in ("tq4", "int8")


def bytes_per_token_head(fmt: str, head_dim: int) -> int:
    """Stored bytes of one token's key (or value) vector in one head."""
    fmt = check_format(fmt)
    if fmt == "tq4":
        return head_dim // 2 + 4
    if fmt == "int8":
        return head_dim + 4
    return head_dim * _VECTOR_DTYPES[fmt].itemsize


def tensor_specs(identity: CacheIdentity) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per tensor name, its trailing shape (after ``[..., num_blocks, block_size]``) and dtype."""
    fmt = check_format(identity.codec)
    heads, dim = identity.num_kv_heads, identity.head_dim
    vec = (heads, dim // 2) if fmt == "tq4" else (heads, dim)
    norms = (heads,) if _has_scale(fmt) else (0,)
    packed_spec = (vec, _VECTOR_DTYPES[fmt])
    norms_spec = (norms, torch.float32)
    return {"k_packed": packed_spec, "k_norms": norms_spec,
            "v_packed": packed_spec, "v_norms": norms_spec}


# ---------------------------------------------------------------------- encode
def encode_into(fmt: str, k: torch.Tensor, v: torch.Tensor, token_slots: torch.Tensor,
                view: LayerView, codec: TQ4Codec, key_offset: torch.Tensor | None = None,
                *, check_bounds: bool = False) -> None:
    """Encode K/V rows of one layer into their slots of a layer view, in place.

    Args:
        fmt: the format of the view's cache (its identity's codec).
        k: keys ``[n_tokens, H, D]``, float.
        v: values, the same shape.
        token_slots: int64 ``[n_tokens]``, ``slot * block_size + pos`` into the view's
            flattened ``[num_blocks * block_size, ...]``; negative entries are skipped.
        view: one layer of a tier (:meth:`TQGPUCache.layer_view`).
        codec: the cache's codec (its rotation serves tq4 and int8).
        key_offset: ``[H, D]`` this layer's key offset, subtracted from the keys.
        check_bounds: verify that no slot lies beyond the view (one host sync).

    Raises:
        CodecInputError: unknown format, or a tensor of the wrong shape, dtype or device.
    """
    fmt = check_format(fmt)
    if fmt == "tq4":
        quantize_into_cache(k, v, token_slots, view.k_packed, view.k_norms, view.v_packed,
                            view.v_norms, codec, check_bounds=check_bounds,
                            key_offset=key_offset)
        return
    dest = view.k_packed
    heads, dim = dest.shape[-2], dest.shape[-1]
    num_slots = dest.shape[0] * dest.shape[1]
    want_dtype = _VECTOR_DTYPES[fmt]
    for name, t in (("k_packed", view.k_packed), ("v_packed", view.v_packed)):
        if t.dtype != want_dtype or t.dim() != 4:
            raise CodecInputError(f"{name} must be a {want_dtype} [NB, BS, H, D] view for "
                                  f"format {fmt}, got {t.dtype} {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 3 \
                or tuple(t.shape[1:]) != (heads, dim) or t.shape[0] != token_slots.shape[0]:
            raise CodecInputError(
                f"{name} must be a float [n_tokens={token_slots.shape[0]}, H={heads}, D={dim}] "
                f"tensor, got {getattr(t, 'dtype', type(t).__name__)} "
                f"{tuple(getattr(t, 'shape', ()))}")
    if token_slots.dim() != 1 or token_slots.dtype not in (torch.int32, torch.int64):
        raise CodecInputError(f"token_slots must be int64 [n_tokens], got {token_slots.dtype} "
                              f"{tuple(token_slots.shape)}")
    device = dest.device
    slots = token_slots.to(device, torch.int64)
    kf, vf = k.to(device, torch.float32), v.to(device, torch.float32)
    if key_offset is not None:
        if tuple(key_offset.shape) != (heads, dim):
            raise CodecInputError(f"key_offset must be [H={heads}, D={dim}], got "
                                  f"{tuple(key_offset.shape)}; use cache.key_offset(layer)")
        kf = kf - key_offset.to(device, torch.float32)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, kf, vf = slots[keep], kf[keep], vf[keep]
    if check_bounds and slots.numel() and int(slots.max()) >= num_slots:
        raise CodecInputError(f"token_slots holds slot {int(slots.max())} but this cache layer "
                              f"has {num_slots} slots; use -1 to skip a token")
    pairs = ((kf, view.k_packed, view.k_norms), (vf, view.v_packed, view.v_norms))
    for x, packed, norms in pairs:
        flat = packed.view(-1, heads, dim)
        if fmt == "int8":
            q, scale = _int8_encode(x, codec)
            flat.index_copy_(0, slots, q)
            norms.view(-1, heads).index_copy_(0, slots, scale)
        else:
            flat.index_copy_(0, slots, x.to(want_dtype))


def _int8_encode(x: torch.Tensor, codec: TQ4Codec) -> tuple[torch.Tensor, torch.Tensor]:
    r = codec.rotate(x.to(codec.device)).to(x.device)
    scale = r.abs().amax(dim=-1) / _INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(r / safe.unsqueeze(-1)).clamp_(-_INT8_MAX, _INT8_MAX)
    q = torch.where(scale.unsqueeze(-1) > 0, q, torch.zeros_like(q))
    return q.to(torch.int8), scale.to(torch.float32)


# ---------------------------------------------------------------------- decode
def decode_blocks(fmt: str, exported: dict[str, torch.Tensor], codec: TQ4Codec,
                  key_offsets: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode exported blocks to float32 keys and values.

    Args:
        fmt: the format of the cache the blocks come from.
        exported: :meth:`TQGPUCache.export_blocks` output (layer-major
            ``[L, n, block_size, H, ...]``).
        codec: the cache's codec.
        key_offsets: ``[L, H, D]`` the cache's key offsets, added back to the keys.

    Returns:
        ``(k, v)`` float32 ``[L, n, block_size, H, D]`` on ``codec.device``.

    Raises:
        CodecInputError: unknown format, or tensors of another format's layout.
    """
    fmt = check_format(fmt)
    dev = codec.device
    want_dtype = _VECTOR_DTYPES[fmt]
    for name in ("k_packed", "v_packed"):
        t = exported[name]
        if t.dtype != want_dtype or t.dim() != 5:
            raise CodecInputError(f"{name} must be {want_dtype} [L, n, BS, H, ...] for format "
                                  f"{fmt}, got {t.dtype} {tuple(t.shape)}; it was exported "
                                  "from a cache of another format")
    out = []
    for side in ("k", "v"):
        packed = exported[f"{side}_packed"].to(dev)
        if fmt == "tq4":
            x = codec.decode(TQ4Encoded(packed, exported[f"{side}_norms"].to(dev)))
        elif fmt == "int8":
            scale = exported[f"{side}_norms"].to(dev, torch.float32)
            x = codec.unrotate(packed.float() * scale.unsqueeze(-1))
        else:
            x = packed.float()
        out.append(x)
    k, v = out
    if key_offsets is not None:
        num_layers, heads, dim = k.shape[0], k.shape[3], k.shape[4]
        if tuple(key_offsets.shape) != (num_layers, heads, dim):
            raise CodecInputError(f"key_offsets must be [L={num_layers}, H={heads}, D={dim}], "
                                  f"got {tuple(key_offsets.shape)}; use cache.key_offsets")
        mu = key_offsets.to(dev, torch.float32)[:, None, None]
        # every format but native decodes into a fresh tensor: add in place there
        # (native's .float() is the exported tensor itself)
        k = k + mu if fmt == "native" else k.add_(mu)
    return k, v
