"""Block formats: encode K/V rows into a cache's tensors and decode them back.

The formats themselves (names, per-side encodings, tensor shapes and sizes) are
:mod:`gpu_cache.format_specs`, re-exported here; this module holds the kernels' side:
tq4 through the fused quantizer, tq5 (``k5v4``'s keys) and int8 through the codec's
rotation, fp16/native as plain copies. Key offsets (``TQGPUCache.key_offsets``) apply to
the keys of every format: encode ``k - mu[layer]``, decode ``+ mu[layer]``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from gpu_cache._errors import CodecInputError
from gpu_cache.codebook import lloyd_max_codebook
from gpu_cache.codec import TQ4Encoded
from gpu_cache.format_specs import (
    FORMATS,
    PRECISION_RANK,
    TENSOR_NAMES,
    VECTOR_DTYPES,
    bytes_per_token_head,
    check_format,
    check_head_dim,
    format_sides,
    has_scale,
    head_dim_multiple,
    side_width,
    tensor_specs,
)
from gpu_cache.kernels import cpu_fused, quantize_into_cache

if TYPE_CHECKING:
    from gpu_cache._storage import LayerView
    from gpu_cache.codec import TQ4Codec

__all__ = [
    "FORMATS",
    "PRECISION_RANK",
    "TENSOR_NAMES",
    "bytes_per_token_head",
    "check_format",
    "check_head_dim",
    "decode_blocks",
    "decode_layer_into",
    "encode_into",
    "head_dim_multiple",
    "tensor_specs",
    "warm_up",
]

_INT8_MAX = 127.0


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
    sides = format_sides(fmt)
    dest = view.k_packed
    heads, dim = dest.shape[-2], codec.head_dim
    num_slots = dest.shape[0] * dest.shape[1]
    for name, t, side in (("k_packed", view.k_packed, sides[0]),
                          ("v_packed", view.v_packed, sides[1])):
        want_dtype, width = VECTOR_DTYPES[side], side_width(side, dim)
        if t.dtype != want_dtype or t.dim() != 4 or t.shape[-1] != width:
            raise CodecInputError(f"{name} must be a {want_dtype} [NB, BS, H, {width}] view "
                                  f"for format {fmt}, got {t.dtype} {tuple(t.shape)}")
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
    pairs = ((kf, view.k_packed, view.k_norms, sides[0]),
             (vf, view.v_packed, view.v_norms, sides[1]))
    for x, packed, norms, side in pairs:
        flat = packed.view(-1, heads, packed.shape[-1])
        if has_scale(side):
            q, scale = _SIDE_ENCODERS[side](x, codec)
            flat.index_copy_(0, slots, q)
            norms.view(-1, heads).index_copy_(0, slots, scale)
        else:
            flat.index_copy_(0, slots, x.to(VECTOR_DTYPES[side]))


def _int8_encode(x: torch.Tensor, codec: TQ4Codec) -> tuple[torch.Tensor, torch.Tensor]:
    r = codec.rotate(x.to(codec.device)).to(x.device)
    scale = r.abs().amax(dim=-1) / _INT8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(r / safe.unsqueeze(-1)).clamp_(-_INT8_MAX, _INT8_MAX)
    q = torch.where(scale.unsqueeze(-1) > 0, q, torch.zeros_like(q))
    return q.to(torch.int8), scale.to(torch.float32)


def _tq4_encode(x: torch.Tensor, codec: TQ4Codec) -> tuple[torch.Tensor, torch.Tensor]:
    enc = codec.encode(x.to(codec.device))
    return enc.packed.to(x.device), enc.norms.to(x.device)


_TQ5_BITS = 5
_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


def _tq5_book(codec: TQ4Codec) -> tuple[torch.Tensor, torch.Tensor]:
    """(centroids, boundaries) of the 5-bit codebook at the codec's D, on its device."""
    return _book_tensors(codec.head_dim, str(codec.device))


@functools.cache
def _book_tensors(head_dim: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    cb = lloyd_max_codebook(head_dim, _TQ5_BITS)
    return (torch.tensor(cb.centroids, dtype=torch.float32, device=device),
            torch.tensor(cb.boundaries, dtype=torch.float32, device=device))


def _tq5_encode(x: torch.Tensor, codec: TQ4Codec) -> tuple[torch.Tensor, torch.Tensor]:
    """TurboQuant at 5 bits: ``[..., D]`` to packed ``[..., 5D/8]`` and length-corrected
    norms ``[...]`` (the tq4 recipe with a finer codebook)."""
    centroids, boundaries = _tq5_book(codec)
    x = x.to(codec.device, torch.float32)
    signs = codec.hadamard_signs
    if signs is not None and codec.fused_cpu(x.device, x.numel() // codec.head_dim):
        lead = x.shape[:-1]
        flat = x.reshape(-1, codec.head_dim).contiguous()
        packed = torch.empty(flat.shape[0], codec.head_dim * 5 // 8, dtype=torch.uint8)
        stored = torch.empty(flat.shape[0], dtype=torch.float32)
        cpu_fused.encode5_into(flat.numpy(), signs.numpy(), boundaries.numpy(),
                               centroids.numpy(), packed.numpy(), stored.numpy())
        return packed.reshape(*lead, -1), stored.reshape(lead)
    norms = torch.linalg.vector_norm(x, dim=-1)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    idx = torch.bucketize(codec.rotate(x / safe.unsqueeze(-1)), boundaries)
    recon = torch.linalg.vector_norm(centroids[idx], dim=-1)
    stored = torch.where(norms > 0, norms / recon, torch.zeros_like(norms))
    low = codec.pack((idx & 0xF).to(torch.uint8))
    high = (idx >> 4).to(torch.uint8).reshape(*idx.shape[:-1], -1, 8)
    high = (high << _BIT_SHIFTS.to(high.device)).sum(dim=-1).to(torch.uint8)
    return torch.cat([low, high], dim=-1), stored


def _tq5_decode(packed: torch.Tensor, norms: torch.Tensor, codec: TQ4Codec) -> torch.Tensor:
    centroids, _ = _tq5_book(codec)
    signs = codec.hadamard_signs
    if signs is not None and codec.fused_cpu(packed.device, norms.numel()):
        lead = packed.shape[:-1]
        out = torch.empty(norms.numel(), codec.head_dim, dtype=torch.float32)
        cpu_fused.decode5_into(packed.reshape(-1, packed.shape[-1]).contiguous().numpy(),
                               norms.reshape(-1).contiguous().numpy(), signs.numpy(),
                               centroids.numpy(), out.numpy())
        return out.reshape(*lead, codec.head_dim)
    half = codec.head_dim // 2
    low = codec.unpack(packed[..., :half]).long()
    high = (packed[..., half:, None] >> _BIT_SHIFTS.to(packed.device)) & 1
    idx = low | (high.reshape(*packed.shape[:-1], -1).long() << 4)
    return codec.unrotate(centroids[idx] * norms.unsqueeze(-1))


_SIDE_ENCODERS = {"tq4": _tq4_encode, "tq5": _tq5_encode, "int8": _int8_encode}


# ---------------------------------------------------------------------- decode
def _exported_side(fmt: str, exported: Mapping[str, torch.Tensor], side_name: str, side: str,
                   head_dim: int) -> torch.Tensor:
    """The ``*_packed`` tensor of one side, checked against the format."""
    name = f"{side_name}_packed"
    packed = exported[name]
    want_dtype, width = VECTOR_DTYPES[side], side_width(side, head_dim)
    if packed.dtype != want_dtype or packed.dim() != 5 or packed.shape[-1] != width:
        raise CodecInputError(f"{name} must be {want_dtype} [L, n, BS, H, {width}] for "
                              f"format {fmt}, got {packed.dtype} {tuple(packed.shape)}; it "
                              "was exported from a cache of another format")
    return packed


def _decode_side(side: str, packed: torch.Tensor, norms: torch.Tensor,
                 codec: TQ4Codec) -> torch.Tensor:
    """One side's stored vectors as float32 ``[..., D]`` on the codec's device."""
    dev = codec.device
    packed = packed.to(dev)
    if side == "tq4":
        return codec.decode(TQ4Encoded(packed, norms.to(dev)))
    if side == "tq5":
        return _tq5_decode(packed, norms.to(dev, torch.float32), codec)
    if side == "int8":
        return codec.unrotate(packed.float() * norms.to(dev, torch.float32).unsqueeze(-1))
    return packed.float()


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
    out = []
    for side_name, side in zip(("k", "v"), format_sides(fmt), strict=True):
        packed = _exported_side(fmt, exported, side_name, side, codec.head_dim)
        out.append(_decode_side(side, packed, exported[f"{side_name}_norms"], codec))
    k, v = out
    dev = codec.device
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


def decode_layer_into(fmt: str, exported: Mapping[str, torch.Tensor], layer: int,
                      codec: TQ4Codec, out: torch.Tensor, k_rows: torch.Tensor,
                      v_rows: torch.Tensor, key_offsets: torch.Tensor | None = None) -> None:
    """Decode one layer of exported blocks straight into rows of ``out``, in place.

    The load path of a paged KV cache: ``out`` is one layer of pages viewed as rows
    of ``D`` values, and each token-head of the blocks lands in its page row without
    an intermediate K/V tensor. On the CPU, with the fused kernels, into a float32
    contiguous ``out``, that is one pass over the packed bytes; otherwise the layer is
    decoded as :func:`decode_blocks` does and copied by index.

    Args:
        fmt: the format of the cache the blocks come from.
        exported: :meth:`TQGPUCache.export_blocks` output (``[L, n, block_size, H, ...]``).
        layer: the layer to decode.
        codec: the cache's codec.
        out: ``[num_rows, D]`` destination (any float dtype; float32 contiguous on the
            CPU takes the fused path).
        k_rows: int64 ``[n * block_size * H]``, the row of ``out`` of each token-head's
            key, in the blocks' order (block, token, head).
        v_rows: the same for the values.
        key_offsets: ``[L, H, D]`` the cache's key offsets, added back to the keys.

    Raises:
        CodecInputError: unknown format, tensors of another format's layout, or rows
            of the wrong shape.
    """
    fmt = check_format(fmt)
    dim = codec.head_dim
    if out.dim() != 2 or out.shape[1] != dim:
        raise CodecInputError(f"out must be [num_rows, D={dim}], got {tuple(out.shape)}")
    signs = codec.hadamard_signs
    for side_name, side, rows in zip(("k", "v"), format_sides(fmt), (k_rows, v_rows), strict=True):
        packed = _exported_side(fmt, exported, side_name, side, dim)[layer]
        norms = exported[f"{side_name}_norms"][layer]
        num = packed.shape[0] * packed.shape[1] * packed.shape[2]
        if rows.dim() != 1 or rows.shape[0] != num or rows.dtype != torch.int64:
            raise CodecInputError(f"{side_name}_rows must be int64 [{num}] (block, token, "
                                  f"head order), got {rows.dtype} {tuple(rows.shape)}")
        mu = key_offsets[layer] if side_name == "k" and key_offsets is not None else None
        if (signs is not None and side in ("tq4", "tq5", "int8") and out.device.type == "cpu"
                and out.dtype == torch.float32 and out.is_contiguous()
                and codec.fused_cpu(packed.device, num)):
            flat = packed.reshape(num, -1).cpu().contiguous().numpy()
            scales = norms.reshape(num).to("cpu", torch.float32).contiguous().numpy()
            where = {"dest": rows.cpu().contiguous().numpy(),  # offsets default to none
                     "offsets": None if mu is None
                     else mu.to("cpu", torch.float32).contiguous().numpy()}
            if side == "int8":
                cpu_fused.decode8_into(flat, scales, signs.numpy(), out.numpy(), **where)
            else:
                decode = cpu_fused.decode_into if side == "tq4" else cpu_fused.decode5_into
                decode(flat, scales, signs.numpy(), _book(side, codec).numpy(), out.numpy(),
                       **where)
            continue
        x = _decode_side(side, packed, norms, codec)
        if mu is not None:
            x = x + mu.to(x.device, torch.float32)
        out.index_copy_(0, rows.to(out.device), x.reshape(num, dim).to(out.device, out.dtype))


def _book(side: str, codec: TQ4Codec) -> torch.Tensor:
    """The centroids of a TurboQuant side encoding (tq4 or tq5) at the codec's D."""
    return codec.centroids if side == "tq4" else _tq5_book(codec)[0]


def warm_up(codec: TQ4Codec) -> None:
    """Run every fused CPU kernel once at the codec's D (numba compiles them on first
    use, or loads its on-disk cache), so that no request pays for it."""
    x = torch.randn(512, codec.head_dim, device=codec.device)
    codec.decode(codec.encode(x))
    _tq5_decode(*_tq5_encode(x, codec), codec)
    signs = codec.hadamard_signs
    if signs is not None and codec.fused_cpu(x.device, x.shape[0]):
        q = torch.zeros(x.shape, dtype=torch.int8)
        cpu_fused.decode8_into(q.numpy(), torch.ones(x.shape[0]).numpy(), signs.numpy(),
                               torch.empty(x.shape).numpy())
