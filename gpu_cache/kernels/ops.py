"""Public kernel entry points: validate inputs, then run Triton or the torch path.

Backends:

- ``"auto"``: Triton when the tensors are on CUDA and Triton is installed; on CPU the
  fused decode kernel of :mod:`gpu_cache.kernels.cpu_decode` for
  :func:`tq4_decode_attention` when its compiled op is built, the torch path for
  everything else.
- ``"cpu"``: the fused CPU decode kernel (CPU tensors only); other entry points run
  the torch path.
- ``"triton"``: always Triton. CPU tensors only work when ``TRITON_INTERPRET=1`` was
  set before Triton was first imported (that is how CPU CI runs the kernels).
- ``"torch"``: the chunked torch path of :mod:`gpu_cache.kernels.torch_ops`.

Triton is imported lazily, so ``import gpu_cache`` never imports it.

Every function takes ONE layer of the 5D cache (SPEC 1.3), e.g. ``k_packed[layer]``:
packed uint8 ``[NB, BS, Hkv, D/2]`` and float32 norms ``[NB, BS, Hkv]``.
"""

from __future__ import annotations

import importlib.util
import math
from types import ModuleType
from typing import TYPE_CHECKING, Literal

import torch

from gpu_cache._errors import CodecInputError
from gpu_cache.kernels import cpu_decode, torch_ops

if TYPE_CHECKING:
    from gpu_cache.codec import TQ4Codec

__all__ = ["Backend", "quantize_into_cache", "tq4_decode_attention", "tq4_extend_attention"]

Backend = Literal["auto", "triton", "torch", "cpu"]
_BACKENDS = ("auto", "triton", "torch", "cpu")
_INDEX_DTYPES = (torch.int32, torch.int64)


# ------------------------------------------------------------------ backends
def _triton_ops() -> ModuleType:
    """Import :mod:`gpu_cache.kernels.triton_ops` (and so Triton) on first use."""
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError(
            "backend='triton' needs the triton package: pip install 'contextkit[triton]', "
            "or use backend='torch'"
        )
    from gpu_cache.kernels import triton_ops

    return triton_ops


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(_BACKENDS)}; got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "cpu":
        if device.type != "cpu":
            raise CodecInputError(
                f"backend='cpu' got tensors on {device}; move them to the CPU or use "
                "backend='auto'"
            )
        return "cpu"
    if backend == "auto":
        cuda_ready = device.type == "cuda" and importlib.util.find_spec("triton") is not None
        if cuda_ready:
            return "triton"
        return "cpu" if device.type == "cpu" and cpu_decode.fused_available() else "torch"
    if device.type != "cuda" and not _triton_ops().INTERPRETED:
        raise CodecInputError(
            f"backend='triton' got tensors on {device}; Triton runs on CUDA tensors, or on CPU "
            "only when TRITON_INTERPRET=1 is set before triton is first imported. Move the "
            "tensors to CUDA, set the variable, or use backend='torch'"
        )
    return "triton"


# ------------------------------------------------------------------ checks
def _check_tensor(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise CodecInputError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _check_devices(codec: TQ4Codec, **tensors: torch.Tensor) -> torch.device:
    """All tensors on the codec's device (which holds real data, i.e. not 'meta')."""
    device = codec.rotation.device
    if device.type == "meta":
        raise CodecInputError(
            "the codec lives on the 'meta' device, which holds no data; build it with "
            "device='cuda' or 'cpu'"
        )
    for name, x in tensors.items():
        if x.device.type == "meta":
            raise CodecInputError(
                f"{name} is a 'meta' tensor and holds no data; allocate it on {device}"
            )
        if x.device != device:
            raise CodecInputError(
                f"{name} is on {x.device} but the codec lives on {device}; move it with "
                f".to('{device}') or build the codec with device='{x.device}'"
            )
    return device


def _check_float(x: object, name: str, shape: tuple[int | None, ...], dims: str) -> torch.Tensor:
    x = _check_tensor(x, name)
    if not x.is_floating_point():
        raise CodecInputError(
            f"{name} must be a floating tensor (float32/float16/bfloat16), got {x.dtype}; "
            "cast with .float()"
        )
    _check_shape(x, name, shape, dims)
    return x


def _check_shape(x: torch.Tensor, name: str, shape: tuple[int | None, ...], dims: str) -> None:
    ok = x.dim() == len(shape) and all(
        want is None or got == want for got, want in zip(x.shape, shape, strict=True)
    )
    if not ok:
        want = ", ".join("?" if s is None else str(s) for s in shape)
        raise CodecInputError(
            f"{name} must have shape {dims} = [{want}], got {tuple(x.shape)}"
        )


def _check_index(x: object, name: str, shape: tuple[int | None, ...], dims: str) -> torch.Tensor:
    x = _check_tensor(x, name)
    if x.dtype not in _INDEX_DTYPES:
        raise CodecInputError(
            f"{name} must be int32 or int64, got {x.dtype}; convert with .to(torch.int32)"
        )
    _check_shape(x, name, shape, dims)
    return x


def _check_cache(
    k_packed: torch.Tensor,
    k_norms: torch.Tensor,
    v_packed: torch.Tensor,
    v_norms: torch.Tensor,
    codec: TQ4Codec,
) -> tuple[int, int, int]:
    """Validate one layer of the cache; returns ``(num_blocks, block_size, num_kv_heads)``."""
    k_packed = _check_tensor(k_packed, "k_packed")
    if k_packed.dim() != 4:
        raise CodecInputError(
            "k_packed must be one layer of the cache, [num_blocks, block_size, num_kv_heads, "
            f"head_dim/2]; got shape {tuple(k_packed.shape)} (index the layer: k_packed[layer])"
        )
    num_blocks, block_size, num_heads, _ = k_packed.shape
    packed_shape = (num_blocks, block_size, num_heads, codec.packed_dim)
    for name, x in (("k_packed", k_packed), ("v_packed", v_packed)):
        x = _check_tensor(x, name)
        if x.dtype != torch.uint8:
            raise CodecInputError(f"{name} must be uint8 (packed 4-bit codes), got {x.dtype}")
        _check_shape(x, name, packed_shape, "[NB, BS, Hkv, head_dim/2]")
        if x.stride(-1) != 1:
            raise CodecInputError(
                f"{name} must have a contiguous last dimension; pass a layer view of the "
                "cache or call .contiguous()"
            )
    for name, x in (("k_norms", k_norms), ("v_norms", v_norms)):
        x = _check_tensor(x, name)
        if x.dtype != torch.float32:
            raise CodecInputError(f"{name} must be float32, got {x.dtype}")
        _check_shape(x, name, packed_shape[:3], "[NB, BS, Hkv]")
    return num_blocks, block_size, num_heads


def _check_block_refs(
    block_table: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int
) -> None:
    """Lengths fit the table and every block a sequence uses exists (one host sync)."""
    capacity = block_table.shape[1] * block_size
    used_blocks = (seq_lens.long().clamp(0, capacity) + block_size - 1) // block_size
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < (
        used_blocks[:, None]
    )
    bad_ids = ((block_table < 0) | (block_table >= num_blocks)) & used
    bad_len = (seq_lens < 0) | (seq_lens > capacity)
    first_len, first_id = torch.stack(
        [_first_true(bad_len), _first_true(bad_ids.any(dim=1))]
    ).tolist()
    if first_len >= 0:
        raise CodecInputError(
            f"seq_lens[{first_len}] = {int(seq_lens[first_len])} does not fit its block table "
            f"row ({block_table.shape[1]} blocks x {block_size} tokens = {capacity}); "
            "give every sequence enough blocks or shorten seq_lens"
        )
    if first_id >= 0:
        raise CodecInputError(
            f"block_table row {first_id} refers to a block outside 0..{num_blocks - 1}; "
            "pass block ids of this cache layer"
        )


def _first_true(mask: torch.Tensor) -> torch.Tensor:
    """Index of the first True in 1-D ``mask``, or -1 (as a 0-d int64 tensor)."""
    idx = torch.arange(mask.numel(), device=mask.device)
    big = torch.full_like(idx, mask.numel())
    first = torch.where(mask, idx, big).min() if mask.numel() else big.new_tensor(0)
    return torch.where(first >= mask.numel(), -1, first)


def _check_query(query: object, num_kv_heads: int, codec: TQ4Codec, dims: str) -> torch.Tensor:
    """A float ``[N, Hq, D]`` query whose head count is a multiple of the cache's KV heads."""
    query = _check_float(query, "query", (None, None, codec.head_dim), dims)
    if query.shape[1] % num_kv_heads:
        raise CodecInputError(
            f"query has {query.shape[1]} heads, not a multiple of the cache's {num_kv_heads} KV "
            "heads; pass the model's query heads for this layer"
        )
    return query


def _centered(key: torch.Tensor, key_offset: torch.Tensor | None,
              codec: TQ4Codec) -> torch.Tensor:
    """``key - key_offset`` broadcast over tokens (``key_offset`` ``[Hkv, D]``)."""
    if key_offset is None:
        return key
    _check_float(key_offset, "key_offset", (key.shape[1], codec.head_dim), "[Hkv, D]")
    if key_offset.device != key.device:
        raise CodecInputError(f"key_offset is on {key_offset.device} but key is on "
                              f"{key.device}; use cache.key_offset(layer)")
    return key - key_offset.to(key.dtype)


def _default_scale(scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _cpu_decode_batch(
    query: torch.Tensor,
    k_packed: torch.Tensor,
    k_norms: torch.Tensor,
    v_packed: torch.Tensor,
    v_norms: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    codec: TQ4Codec,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused CPU kernel, one sequence at a time: float32 ``[B, Hq, D]``, ``[B, Hq]``."""
    if k_packed.stride() != v_packed.stride():
        k_packed, v_packed = k_packed.contiguous(), v_packed.contiguous()
    if k_norms.stride() != v_norms.stride():
        k_norms, v_norms = k_norms.contiguous(), v_norms.contiguous()
    outs, lses = [], []
    for b, seq_len in enumerate(seq_lens.tolist()):
        out, lse = cpu_decode.decode_attention(
            query[b].float().contiguous(), k_packed, k_norms, v_packed, v_norms,
            block_table[b].to(torch.int32).contiguous(), 0, int(seq_len), codec.rotation,
            codec.centroids, scale)
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


# ------------------------------------------------------------------ entry points
def quantize_into_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_packed: torch.Tensor,
    k_norms: torch.Tensor,
    v_packed: torch.Tensor,
    v_norms: torch.Tensor,
    codec: TQ4Codec,
    backend: Backend = "auto",
    check_bounds: bool = True,
    key_offset: torch.Tensor | None = None,
) -> None:
    """Encode new K/V rows straight into their cache slots (fused rotate+quantize+pack).

    Args:
        key, value: ``[T, Hkv, D]`` float tensors of the new tokens.
        slot_mapping: ``[T]`` int32/int64 slots ``block_idx * block_size + pos``;
            negative entries are skipped (padding).
        k_packed, v_packed: uint8 ``[NB, BS, Hkv, D/2]``; k_norms, v_norms: float32
            ``[NB, BS, Hkv]`` (one layer), written in place.
        codec: the cache's codec.
        backend: "auto", "triton" or "torch".
        check_bounds: verify that no slot lies beyond the cache (one host sync).
        key_offset: ``[Hkv, D]`` per-head key offset of this layer (the cache's
            :meth:`~gpu_cache.TQGPUCache.key_offset`), subtracted before encoding.

    Raises:
        CodecInputError: wrong dtype, shape or device, or a slot beyond the cache.
    """
    num_blocks, block_size, num_heads = _check_cache(k_packed, k_norms, v_packed, v_norms, codec)
    key = _check_float(key, "key", (None, num_heads, codec.head_dim), "[T, Hkv, D]")
    num_tokens = key.shape[0]
    value = _check_float(value, "value", (num_tokens, num_heads, codec.head_dim), "[T, Hkv, D]")
    slot_mapping = _check_index(slot_mapping, "slot_mapping", (num_tokens,), "[T]")
    device = _check_devices(codec, key=key, value=value, slot_mapping=slot_mapping,
                            k_packed=k_packed, k_norms=k_norms, v_packed=v_packed,
                            v_norms=v_norms)
    key = _centered(key, key_offset, codec)
    num_slots = num_blocks * block_size
    if check_bounds and num_tokens and int(slot_mapping.max()) >= num_slots:
        raise CodecInputError(
            f"slot_mapping holds slot {int(slot_mapping.max())} but this cache layer has "
            f"{num_slots} slots ({num_blocks} blocks x {block_size}); use -1 to skip a token"
        )
    if _resolve_backend(backend, device) == "triton":
        _triton_ops().quantize_into_cache_triton(
            key.contiguous(), value.contiguous(), slot_mapping.contiguous(),
            k_packed, k_norms, v_packed, v_norms, codec,
        )
        return
    torch_ops.quantize_into_cache_torch(key, value, slot_mapping, k_packed, k_norms, v_packed,
                                        v_norms, codec)


def tq4_decode_attention(
    query: torch.Tensor,
    k_packed: torch.Tensor,
    k_norms: torch.Tensor,
    v_packed: torch.Tensor,
    v_norms: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    codec: TQ4Codec,
    scale: float | None = None,
    backend: Backend = "auto",
    num_splits: int | None = None,
    check_bounds: bool = True,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One decode step of paged attention read straight from the packed cache.

    Args:
        query: ``[B, Hq, D]``; ``Hq`` a multiple of ``Hkv`` (GQA: head ``h`` reads KV
            head ``h // (Hq // Hkv)``).
        k_packed, v_packed: uint8 ``[NB, BS, Hkv, D/2]``; k_norms, v_norms: float32
            ``[NB, BS, Hkv]`` (one layer).
        block_table: ``[B, max_blocks]`` int32/int64 block ids per sequence.
        seq_lens: ``[B]`` int32/int64 tokens per sequence (``0`` gives zeros).
        codec: the cache's codec.
        scale: softmax scale, default ``1/sqrt(D)``.
        backend: "auto", "triton", "torch" or "cpu" ("auto" on CPU tensors: the fused
            kernel of :mod:`gpu_cache.kernels.cpu_decode`).
        num_splits: Triton split-K factor (``None``: chosen from the block-table width).
        check_bounds: verify seq_lens against the table and block ids against the
            cache. It costs one host sync; callers whose tables come from the cache
            itself may turn it off in the per-layer decode loop.
        return_lse: also return the log-sum-exp of the scaled scores, float32
            ``[B, Hq]`` (``-inf`` for an empty sequence), so that the result can be
            merged with attention over other keys (a full-precision recent window).

    Returns:
        ``[B, Hq, D]`` in ``query``'s dtype; with ``return_lse``, ``(out, lse)``.

    Raises:
        CodecInputError: wrong dtype, shape or device; a sequence longer than its
            block-table row; a block id outside the cache.
    """
    num_blocks, block_size, num_kv_heads = _check_cache(k_packed, k_norms, v_packed, v_norms,
                                                        codec)
    query = _check_query(query, num_kv_heads, codec, "[B, Hq, D]")
    batch = query.shape[0]
    block_table = _check_index(block_table, "block_table", (batch, None), "[B, max_blocks]")
    seq_lens = _check_index(seq_lens, "seq_lens", (batch,), "[B]")
    device = _check_devices(codec, query=query, k_packed=k_packed, k_norms=k_norms,
                            v_packed=v_packed, v_norms=v_norms, block_table=block_table,
                            seq_lens=seq_lens)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 or None, got {num_splits}")
    if check_bounds:
        _check_block_refs(block_table, seq_lens, num_blocks, block_size)
    scale = _default_scale(scale, codec.head_dim)
    if batch == 0:
        empty = torch.empty_like(query)
        return (empty, torch.empty(query.shape[:2], device=device)) if return_lse else empty
    resolved = _resolve_backend(backend, device)
    if resolved == "triton":
        res = _triton_ops().tq4_decode_attention_triton(
            query, k_packed, k_norms, v_packed, v_norms, block_table.contiguous(),
            seq_lens.contiguous(), codec, scale, num_splits=num_splits, return_lse=True,
        )
    elif resolved == "cpu":
        res = _cpu_decode_batch(query, k_packed, k_norms, v_packed, v_norms, block_table,
                                seq_lens, codec, scale)
    else:
        res = torch_ops.tq4_decode_attention_torch(
            query, k_packed, k_norms, v_packed, v_norms, block_table, seq_lens, codec, scale,
            return_lse=True,
        )
    assert isinstance(res, tuple)
    out, lse = res
    return (out.to(query.dtype), lse) if return_lse else out.to(query.dtype)


def tq4_extend_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_packed: torch.Tensor,
    k_norms: torch.Tensor,
    v_packed: torch.Tensor,
    v_norms: torch.Tensor,
    block_table: torch.Tensor,
    prefix_len: int,
    codec: TQ4Codec,
    scale: float | None = None,
    key_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill/extend attention: ``T`` new tokens over a packed prefix plus themselves.

    The prefix is decoded a chunk of blocks at a time (never the whole cache); the
    new tokens' own K/V are used unquantized, causally. Runs the chunked torch
    implementation on every device.

    Args:
        query: ``[T, Hq, D]`` queries of the new tokens (positions ``prefix_len + t``).
        key, value: ``[T, Hkv, D]`` their fresh K/V.
        k_packed, v_packed, k_norms, v_norms: one layer of the cache.
        block_table: ``[max_blocks]`` int32/int64 block ids of this sequence.
        prefix_len: cached tokens before the new ones.
        codec: the cache's codec; scale: softmax scale, default ``1/sqrt(D)``.
        key_offset: ``[Hkv, D]`` key offset of this layer when the cache holds
            centered keys; the fresh keys are centered the same way so that cached
            and fresh scores shift alike (softmax then cannot tell).

    Returns:
        ``[T, Hq, D]`` in ``query``'s dtype.

    Raises:
        CodecInputError: wrong dtype, shape or device; a prefix longer than the table.
    """
    num_blocks, block_size, num_kv_heads = _check_cache(k_packed, k_norms, v_packed, v_norms,
                                                        codec)
    query = _check_query(query, num_kv_heads, codec, "[T, Hq, D]")
    num_new = query.shape[0]
    kv_shape = (num_new, num_kv_heads, codec.head_dim)
    key = _check_float(key, "key", kv_shape, "[T, Hkv, D]")
    value = _check_float(value, "value", kv_shape, "[T, Hkv, D]")
    block_table = _check_index(block_table, "block_table", (None,), "[max_blocks]")
    _check_devices(codec, query=query, key=key, value=value, k_packed=k_packed,
                   k_norms=k_norms, v_packed=v_packed, v_norms=v_norms,
                   block_table=block_table)
    if int(prefix_len) < 0:
        raise CodecInputError(f"prefix_len must be >= 0, got {prefix_len}")
    key = _centered(key, key_offset, codec)
    seq_lens = torch.tensor([int(prefix_len)], device=block_table.device)
    _check_block_refs(block_table[None, :], seq_lens, num_blocks, block_size)
    out = torch_ops.tq4_extend_attention_torch(
        query, key, value, k_packed, k_norms, v_packed, v_norms, block_table, int(prefix_len),
        codec, _default_scale(scale, codec.head_dim),
    )
    return out.to(query.dtype)
