"""Pure float32 torch references for the TQ4 cache kernels.

Clear rather than fast: every function here spells the math out step by step and
is what the Triton kernels and the torch path are tested against. Nothing in this
module is used on a hot path.

Shapes (one layer of the 5D cache, SPEC 1.3):

- packed K/V: uint8 ``[num_blocks, block_size, num_kv_heads, head_dim/2]``
- norms K/V: float32 ``[num_blocks, block_size, num_kv_heads]``
- slot ``s`` is ``block_idx * block_size + pos``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gpu_cache.codec import TQ4Codec

__all__ = [
    "dequantize_cache_ref",
    "encode_ref",
    "extend_attention_ref",
    "paged_decode_attention_ref",
    "quantize_into_cache_ref",
]


def encode_ref(x: torch.Tensor, codec: TQ4Codec) -> tuple[torch.Tensor, torch.Tensor]:
    """TQ4-encode ``x`` ``[..., D]``: packed uint8 ``[..., D/2]`` and stored norms ``[...]``.

    Step by step: norm, unit vector, rotate (``u @ R.T``), nearest centroid
    (``bucketize`` against the decision boundaries), length-corrected norm
    (``||x|| / ||c[idx]||``), split-half packing (low nibble ``j``, high ``j + D/2``).
    """
    x = x.float()
    half = codec.head_dim // 2
    norms = torch.linalg.vector_norm(x, dim=-1)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    rotated = (x / safe.unsqueeze(-1)) @ codec.rotation.T
    idx = torch.bucketize(rotated, codec.boundaries)
    recon_norm = torch.linalg.vector_norm(codec.centroids[idx], dim=-1)
    stored = torch.where(norms > 0, norms / recon_norm, torch.zeros_like(norms))
    packed = (idx[..., :half] | (idx[..., half:] << 4)).to(torch.uint8)
    return packed, stored


def quantize_into_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_packed: torch.Tensor,
    k_norms: torch.Tensor,
    v_packed: torch.Tensor,
    v_norms: torch.Tensor,
    codec: TQ4Codec,
) -> None:
    """Encode ``key``/``value`` ``[T, H, D]`` into the cache slots ``slot_mapping`` ``[T]``.

    Slots below zero are skipped (vLLM's padding convention). Writes in place.
    """
    block_size = k_packed.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_idx, pos = slots // block_size, slots % block_size
    for src, packed_out, norms_out in ((key, k_packed, k_norms), (value, v_packed, v_norms)):
        packed, norms = encode_ref(src[keep], codec)
        packed_out[block_idx, pos] = packed
        norms_out[block_idx, pos] = norms


def dequantize_cache_ref(
    packed: torch.Tensor, norms: torch.Tensor, codec: TQ4Codec
) -> torch.Tensor:
    """Decode a whole layer: packed ``[NB, BS, H, D/2]`` + norms -> float32 ``[NB, BS, H, D]``."""
    idx = torch.cat([packed & 0xF, packed >> 4], dim=-1).long()
    rotated = codec.centroids[idx] * norms.unsqueeze(-1)
    return rotated @ codec.rotation


def _gather_sequence(
    cache: torch.Tensor, block_ids: torch.Tensor, length: int
) -> torch.Tensor:
    """Tokens ``[length, H, D]`` of one sequence from ``cache`` ``[NB, BS, H, D]``."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = cache[block_ids[:num_blocks].long()]
    return blocks.reshape(-1, *cache.shape[2:])[:length]


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of ``query`` ``[Tq, Hq, D]`` over ``keys``/``values`` ``[Tk, Hkv, D]``.

    ``mask`` ``[Tq, Tk]`` (True = may attend). With no key at all the output is zero.
    """
    group = query.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), keys) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if keys.shape[0] == 0:
        return torch.zeros_like(query, dtype=torch.float32)
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, values)


def paged_decode_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One decode step of paged attention over a float cache.

    Args:
        query: ``[B, Hq, D]``.
        key_cache, value_cache: float ``[NB, BS, Hkv, D]``.
        block_table: ``[B, max_blocks]`` block ids per sequence.
        seq_lens: ``[B]`` tokens per sequence; ``0`` gives a zero output.
        scale: softmax scale.

    Returns:
        float32 ``[B, Hq, D]``; query head ``h`` reads KV head ``h // (Hq // Hkv)``.
    """
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    for b in range(query.shape[0]):
        length = int(seq_lens[b])
        keys = _gather_sequence(key_cache, block_table[b], length)
        values = _gather_sequence(value_cache, block_table[b], length)
        out[b] = _attend(query[b : b + 1], keys, values, scale)[0]
    return out


def extend_attention_ref(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_len: int,
    scale: float,
) -> torch.Tensor:
    """Attention of ``T`` new tokens of one sequence over its cached prefix and themselves.

    Args:
        query: ``[T, Hq, D]`` queries of the new tokens (positions ``prefix_len + t``).
        key, value: ``[T, Hkv, D]`` fresh (unquantized) K/V of the new tokens.
        key_cache, value_cache: float ``[NB, BS, Hkv, D]``.
        block_table: ``[max_blocks]`` block ids of the sequence's prefix.
        prefix_len: cached tokens before the new ones.
        scale: softmax scale.

    Returns:
        float32 ``[T, Hq, D]``; causal within the new tokens, full over the prefix.
    """
    num_new = query.shape[0]
    prefix_k = _gather_sequence(key_cache, block_table, prefix_len)
    prefix_v = _gather_sequence(value_cache, block_table, prefix_len)
    keys = torch.cat([prefix_k.float(), key.float()], dim=0)
    values = torch.cat([prefix_v.float(), value.float()], dim=0)
    q_pos = torch.arange(num_new, device=query.device)[:, None] + prefix_len
    k_pos = torch.arange(prefix_len + num_new, device=query.device)[None, :]
    return _attend(query, keys, values, scale, mask=k_pos <= q_pos)
