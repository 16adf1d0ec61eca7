"""Torch path of the TQ4 attention kernels, used where there is no CUDA device.

Works on the packed cache directly, a chunk of blocks at a time, and never builds a
dequantized copy of the whole cache:

- queries are rotated once (``q @ R.T``) and attention runs in the rotated domain,
  where a cached vector is ``norm * c[idx]``: one table gather per packed byte;
- scores and the value sum use an online softmax over chunks, so only one chunk of
  codebook values is alive at a time;
- the value accumulator is rotated back once at the end (``acc @ R``).

Internally vectors use a "pair" layout ``[..., D/2, 2]`` that matches the packed
bytes: element ``(j, 0)`` is rotated coordinate ``j`` (low nibble), ``(j, 1)`` is
coordinate ``j + D/2`` (high nibble). A 256-entry table maps a byte straight to its
two centroid values (one int64 holding two float32), so unpacking is a single
``index_select``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gpu_cache.codec import TQ4Codec

__all__ = [
    "quantize_into_cache_torch",
    "tq4_decode_attention_torch",
    "tq4_extend_attention_torch",
]

#: Bytes of codebook values materialised per online-softmax step: 1 MiB is 256
#: tokens at Hkv=8, D=128 and stays in L2, so the gather and the matmuls that read
#: it back run from cache.
#: On an oversubscribed CPU, larger chunks win instead: every parallel torch op is
#: a thread barrier, and smaller chunks mean more of them.
CHUNK_BYTES = 1 << 20
#: Query tokens per step on the extend path (bounds the ``[H, rows, keys]`` scores).
DEFAULT_QUERY_CHUNK = 256


def _pair_table(codec: TQ4Codec, device: torch.device) -> torch.Tensor:
    """``[256]`` int64 whose bytes are the float32 pair (c[low nibble], c[high nibble]).

    Gathering one 8-byte element per packed byte and viewing the result as float32
    yields the pair layout directly; it is several times faster on CPU than
    ``index_select`` over a ``[256, 2]`` float table.
    """
    codes = torch.arange(256, device=device)
    cent = codec.centroids.to(device)
    pairs = torch.stack([cent[codes & 0xF], cent[codes >> 4]], dim=-1).contiguous()
    return pairs.view(torch.int64).view(256)


def _to_pairs(x: torch.Tensor) -> torch.Tensor:
    """Rotated vectors ``[..., D]`` -> pair layout, flattened back to ``[..., D]``."""
    half = x.shape[-1] // 2
    return torch.stack([x[..., :half], x[..., half:]], dim=-1).flatten(-2)


def _from_pairs(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_to_pairs`."""
    pairs = x.unflatten(-1, (-1, 2))
    return torch.cat([pairs[..., 0], pairs[..., 1]], dim=-1)


def _gather_chunk(
    packed: torch.Tensor,
    norms: torch.Tensor,
    block_ids: torch.Tensor,
    num_tokens: int,
    table: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit codebook values and norms of ``num_tokens`` tokens from ``block_ids``.

    Returns:
        values float32 ``[H, num_tokens, D]`` (pair layout) and norms ``[H, num_tokens]``.
    """
    num_heads, packed_dim = packed.shape[2], packed.shape[3]
    chunk = packed.index_select(0, block_ids).view(-1, num_heads, packed_dim)[:num_tokens]
    codes = torch.empty(num_heads, num_tokens, packed_dim, dtype=torch.int32,
                        device=packed.device)
    codes.copy_(chunk.permute(1, 0, 2))  # head-major, widened for index_select, one pass
    values = table.index_select(0, codes.view(-1)).view(torch.float32)
    chunk_norms = norms.index_select(0, block_ids).view(-1, num_heads)[:num_tokens].T
    return values.view(num_heads, num_tokens, 2 * packed_dim), chunk_norms


def quantize_into_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_packed: torch.Tensor,
    k_norms: torch.Tensor,
    v_packed: torch.Tensor,
    v_norms: torch.Tensor,
    codec: TQ4Codec,
) -> None:
    """Encode ``key``/``value`` ``[T, H, D]`` with ``codec.encode`` into their slots.

    ``codec.encode`` uses its fused CPU kernels for large batches. Slots below zero
    are skipped. No validation (see ``ops.quantize_into_cache``).
    """
    block_size = k_packed.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_idx, pos = slots // block_size, slots % block_size
    for src, packed_out, norms_out in ((key, k_packed, k_norms), (value, v_packed, v_norms)):
        enc = codec.encode(src[keep])
        packed_out[block_idx, pos] = enc.packed
        norms_out[block_idx, pos] = enc.norms


def _chunk_blocks(packed: torch.Tensor, chunk_blocks: int | None) -> int:
    if chunk_blocks is not None:
        return max(1, chunk_blocks)
    _, block_size, num_heads, packed_dim = packed.shape
    return max(1, CHUNK_BYTES // (block_size * num_heads * 2 * packed_dim * 4))


class _OnlineSoftmax:
    """Running max / sum / weighted value sum for rows ``[H, R]`` of queries."""

    def __init__(self, num_heads: int, num_rows: int, dim: int, device: torch.device):
        self.m = torch.full((num_heads, num_rows, 1), float("-inf"), device=device)
        self.l = torch.zeros((num_heads, num_rows, 1), device=device)
        self.acc = torch.zeros((num_heads, num_rows, dim), device=device)

    def update(
        self,
        scores: torch.Tensor,
        values: torch.Tensor,
        value_norms: torch.Tensor | None = None,
    ) -> None:
        """Fold in ``scores`` ``[H, R, N]`` (``-inf`` = masked) over ``values`` ``[H, N, D]``.

        ``value_norms`` ``[H, N]`` scale the values; they are applied to the
        probabilities (``H*R*N`` multiplies) rather than to the values (``H*N*D``).
        """
        # Callers order chunks so that every row has seen an unmasked score by its
        # first update (a decode chunk is never empty; an extend query sees the
        # prefix, or suffix chunk 0, first), so m_new is finite.
        m_new = torch.maximum(self.m, scores.amax(dim=-1, keepdim=True))
        alpha = torch.exp(self.m - m_new)
        probs = torch.exp(scores - m_new)
        self.l = self.l * alpha + probs.sum(dim=-1, keepdim=True)
        weights = probs if value_norms is None else probs * value_norms[:, None, :]
        self.acc = self.acc * alpha + torch.bmm(weights, values)
        self.m = m_new

    def result(self) -> torch.Tensor:
        """Normalised output ``[H, R, D]``; rows that saw no key are zero."""
        return self.acc / self.l.clamp_min(torch.finfo(torch.float32).tiny)

    def lse(self) -> torch.Tensor:
        """Log-sum-exp of the scores ``[H, R]`` (``-inf`` for rows that saw no key)."""
        return (self.m + torch.log(self.l))[..., 0]


def tq4_decode_attention_torch(
    query: torch.Tensor,
    k_packed: torch.Tensor,
    k_norms: torch.Tensor,
    v_packed: torch.Tensor,
    v_norms: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    codec: TQ4Codec,
    scale: float,
    chunk_blocks: int | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Paged decode attention over one layer of the packed cache (no validation).

    Args:
        query: ``[B, Hq, D]``.
        k_packed, v_packed: uint8 ``[NB, BS, Hkv, D/2]``.
        k_norms, v_norms: float32 ``[NB, BS, Hkv]``.
        block_table: ``[B, max_blocks]``; seq_lens: ``[B]``.
        codec: the codec the cache was written with.
        scale: softmax scale.
        chunk_blocks: cache blocks per online-softmax step (default: ~``CHUNK_BYTES``).
        return_lse: also return the log-sum-exp of the scaled scores.

    Returns:
        float32 ``[B, Hq, D]``, plus the log-sum-exp ``[B, Hq]`` (``-inf`` for an
        empty sequence) with ``return_lse``.
    """
    batch, num_q_heads, dim = query.shape
    block_size, num_kv_heads = k_packed.shape[1], k_packed.shape[2]
    group = num_q_heads // num_kv_heads
    device = query.device
    table = _pair_table(codec, device)
    chunk_blocks = _chunk_blocks(k_packed, chunk_blocks)
    q_rot = _to_pairs(query.float() @ codec.rotation.T) * scale
    out = torch.zeros(batch, num_q_heads, dim, device=device)
    lse = torch.full((batch, num_q_heads), float("-inf"), device=device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        q = q_rot[b].view(num_kv_heads, group, dim)
        state = _OnlineSoftmax(num_kv_heads, group, dim, device)
        num_blocks = -(-seq_len // block_size)
        block_ids = block_table[b, :num_blocks].long()
        for first in range(0, num_blocks, chunk_blocks):
            ids = block_ids[first : first + chunk_blocks]
            num_tokens = min(ids.numel() * block_size, seq_len - first * block_size)
            keys, key_norms = _gather_chunk(k_packed, k_norms, ids, num_tokens, table)
            values, value_norms = _gather_chunk(v_packed, v_norms, ids, num_tokens, table)
            scores = torch.bmm(q, keys.transpose(1, 2)) * key_norms[:, None, :]
            state.update(scores, values, value_norms)
        out[b] = state.result().reshape(num_q_heads, dim)
        lse[b] = state.lse().reshape(num_q_heads)
    out = _from_pairs(out) @ codec.rotation
    return (out, lse) if return_lse else out


def tq4_extend_attention_torch(
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
    scale: float,
    chunk_blocks: int | None = None,
    query_chunk: int = DEFAULT_QUERY_CHUNK,
) -> torch.Tensor:
    """Attention of ``T`` new tokens over a packed prefix plus their own fresh K/V.

    The prefix is decoded a chunk of blocks at a time (never the whole cache); the
    fresh suffix is used unquantized, causally masked.

    Args:
        query: ``[T, Hq, D]``; key, value: ``[T, Hkv, D]`` fresh K/V of the same tokens.
        k_packed, v_packed, k_norms, v_norms: one layer of the cache.
        block_table: ``[max_blocks]`` block ids of the prefix.
        prefix_len: number of cached tokens before the new ones.
        codec, scale: as for :func:`tq4_decode_attention_torch`.

    Returns:
        float32 ``[T, Hq, D]``.
    """
    num_new, num_q_heads, dim = query.shape
    block_size, num_kv_heads = k_packed.shape[1], k_packed.shape[2]
    group = num_q_heads // num_kv_heads
    device = query.device
    table = _pair_table(codec, device)
    chunk_blocks = _chunk_blocks(k_packed, chunk_blocks)
    rot_t = codec.rotation.T
    # [T, Hkv, G, D] -> [Hkv, T, G, D]: row r = t * G + g of head h's query block.
    q_rot = (_to_pairs(query.float() @ rot_t) * scale).view(num_new, num_kv_heads, group, dim)
    q_rot = q_rot.permute(1, 0, 2, 3)
    k_new = _to_pairs(key.float() @ rot_t).permute(1, 0, 2)  # [Hkv, T, D]
    v_new = _to_pairs(value.float() @ rot_t).permute(1, 0, 2)
    num_blocks = -(-prefix_len // block_size)
    block_ids = block_table[:num_blocks].long()
    out = torch.empty(num_kv_heads, num_new, group, dim, device=device)
    positions = torch.arange(num_new, device=device)
    for q0 in range(0, num_new, query_chunk):
        q1 = min(q0 + query_chunk, num_new)
        rows = (q1 - q0) * group
        q = q_rot[:, q0:q1].reshape(num_kv_heads, rows, dim)
        state = _OnlineSoftmax(num_kv_heads, rows, dim, device)
        for first in range(0, num_blocks, chunk_blocks):
            ids = block_ids[first : first + chunk_blocks]
            num_tokens = min(ids.numel() * block_size, prefix_len - first * block_size)
            keys, key_norms = _gather_chunk(k_packed, k_norms, ids, num_tokens, table)
            values, value_norms = _gather_chunk(v_packed, v_norms, ids, num_tokens, table)
            scores = torch.bmm(q, keys.transpose(1, 2)) * key_norms[:, None, :]
            state.update(scores, values, value_norms)
        # Fresh suffix, causal: query token t sees new tokens 0..t.
        for k0 in range(0, q1, query_chunk):
            k1 = min(k0 + query_chunk, q1)
            scores = torch.bmm(q, k_new[:, k0:k1].transpose(1, 2))
            allowed = positions[k0:k1][None, :] <= positions[q0:q1][:, None]  # [Tq, Tk]
            allowed = allowed.repeat_interleave(group, dim=0)  # rows are t * G + g
            state.update(scores.masked_fill(~allowed, float("-inf")), v_new[:, k0:k1])
        out[:, q0:q1] = state.result().view(num_kv_heads, q1 - q0, group, dim)
    out = out.permute(1, 0, 2, 3).reshape(num_new, num_q_heads, dim)
    return _from_pairs(out) @ codec.rotation
