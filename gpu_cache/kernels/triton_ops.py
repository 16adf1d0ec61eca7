"""Triton kernels over the packed TQ4 cache, and their launchers.

Importing this module imports Triton; :mod:`gpu_cache.kernels.ops` does so lazily.
The kernels run on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (set before
Triton is first imported), which is how CPU CI tests them.

Kernels:

- :func:`_quantize_kv_kernel`: fused norm -> rotate -> nearest centroid -> length
  correction -> pack of new K and V rows, stored straight into their cache slots.
  The two row-halves of ``R`` are applied separately, so the low-nibble and
  high-nibble coordinates come out as two contiguous ``[D/2]`` tiles and packing
  is one ``lo | hi << 4``.
- :func:`_decode_kernel`: paged split-K decode attention. One program per
  (sequence, KV head, split) serves the whole GQA group of query heads, so each
  packed K/V byte is read once per group. Scores are taken against codebook values
  in the rotated domain, the softmax is online (base 2), and V is accumulated in
  the rotated domain as two halves.
- :func:`_merge_kernel`: one program per (sequence, query head) merges the splits'
  partials and rotates the result back (``acc @ R``) in the same pass, so a decode
  step is three launches (query rotation, decode, merge) whatever the split count.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any

import torch
import triton
import triton.language as tl

from gpu_cache.kernels.decode_config import CUDA_DECODE, EXACT_DECODE, DecodeConfig

if TYPE_CHECKING:
    from gpu_cache.codec import TQ4Codec

__all__ = [
    "CUDA_DECODE",
    "EXACT_DECODE",
    "INTERPRETED",
    "LAST_COMPILED",
    "MAX_SPLITS",
    "DecodeConfig",
    "default_decode",
    "pick_num_splits",
    "quantize_into_cache_triton",
    "tq4_decode_attention_triton",
]

#: True when Triton was imported with TRITON_INTERPRET=1: kernels run on CPU tensors.
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

#: The compiled kernels of the last decode launch (``"decode"``, ``"merge"``; Triton's
#: ``CompiledKernel``, ``None`` when interpreted): ``bench kernel`` reports their
#: registers and spills.
LAST_COMPILED: dict[str, Any] = {}

#: Most split-K partitions :func:`pick_num_splits` picks.
MAX_SPLITS = 256

_LOG2E = 1.4426950408889634
#: fp32 ``tl.dot`` precision. "ieee" is exact fp32 FMA; on CUDA "tf32x3" keeps fp32
#: accuracy (three TF32 MMAs) while using the tensor cores.
_CUDA_DOT_PRECISION = "tf32x3"

_rotation_t_cache: weakref.WeakKeyDictionary[TQ4Codec, torch.Tensor] = (
    weakref.WeakKeyDictionary()
)


def default_decode(device: torch.device) -> DecodeConfig:
    """The launch :func:`tq4_decode_attention_triton` uses on ``device`` unless told."""
    return CUDA_DECODE if device.type == "cuda" and not INTERPRETED else EXACT_DECODE


def _dot_precision(device: torch.device) -> str:
    return _CUDA_DOT_PRECISION if device.type == "cuda" and not INTERPRETED else "ieee"


_query_rotation_cache: weakref.WeakKeyDictionary[TQ4Codec, dict[float, torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)


def _query_rotation(codec: TQ4Codec, scale: float) -> torch.Tensor:
    """``R.T * scale * log2(e)`` (cached per codec and scale): one matmul rotates and
    scales the queries into the kernel's base-2 score domain."""
    per_scale = _query_rotation_cache.setdefault(codec, {})
    if scale not in per_scale:
        per_scale[scale] = (codec.rotation.T * (scale * _LOG2E)).contiguous()
    return per_scale[scale]


def _rotation_t(codec: TQ4Codec, device: torch.device) -> torch.Tensor:
    """``R.T`` contiguous on ``device`` (cached per codec): row-halves load coalesced."""
    cached = _rotation_t_cache.get(codec)
    if cached is None or cached.device != device:
        cached = codec.rotation.T.contiguous().to(device)
        _rotation_t_cache[codec] = cached
    return cached


# --------------------------------------------------------------------- quantize
@triton.jit
def _encode_tile(
    x_ptrs,
    keep,
    rot_lo,
    rot_hi,
    bounds_ptr,
    cent_ptr,
    packed_ptrs,
    norm_ptrs,
    HALF_DIM: tl.constexpr,
    LOG2_LEVELS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Encode rows ``[BLOCK_T, D]`` at ``x_ptrs`` into ``packed_ptrs``/``norm_ptrs``."""
    x = tl.load(x_ptrs, mask=keep[:, None], other=0.0).to(tl.float32)
    norm = tl.sqrt(tl.sum(x * x, axis=1))
    unit = x / tl.where(norm > 0.0, norm, 1.0)[:, None]
    # r = u @ R.T, as the two halves r[:, :D/2] and r[:, D/2:].
    r_lo = tl.dot(unit, rot_lo, input_precision=DOT_PRECISION)
    r_hi = tl.dot(unit, rot_hi, input_precision=DOT_PRECISION)
    # Nearest centroid = number of decision boundaries strictly below r, as in
    # torch.bucketize(right=False): a branch-free binary search over the sorted
    # boundaries, LOG2_LEVELS steps of one table gather each.
    idx_lo = tl.zeros(r_lo.shape, dtype=tl.int32)
    idx_hi = tl.zeros(r_hi.shape, dtype=tl.int32)
    for step in tl.static_range(LOG2_LEVELS):
        half = (1 << (LOG2_LEVELS - 1)) >> step
        idx_lo += tl.where(r_lo > tl.load(bounds_ptr + idx_lo + (half - 1)), half, 0)
        idx_hi += tl.where(r_hi > tl.load(bounds_ptr + idx_hi + (half - 1)), half, 0)
    c_lo = tl.load(cent_ptr + idx_lo)
    c_hi = tl.load(cent_ptr + idx_hi)
    recon = tl.sqrt(tl.sum(c_lo * c_lo, axis=1) + tl.sum(c_hi * c_hi, axis=1))
    stored = tl.where(norm > 0.0, norm / recon, 0.0)
    packed = (idx_lo | (idx_hi << 4)).to(tl.uint8)
    tl.store(packed_ptrs, packed, mask=keep[:, None])
    tl.store(norm_ptrs, stored, mask=keep)


@triton.jit
def _quantize_kv_kernel(
    key_ptr,
    value_ptr,
    slot_ptr,
    k_packed_ptr,
    k_norms_ptr,
    v_packed_ptr,
    v_norms_ptr,
    rot_t_ptr,
    bounds_ptr,
    cent_ptr,
    num_tokens,
    num_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kpb,
    stride_kpp,
    stride_kph,
    stride_knb,
    stride_knp,
    stride_knh,
    stride_vpb,
    stride_vpp,
    stride_vph,
    stride_vnb,
    stride_vnp,
    stride_vnh,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_DIM: tl.constexpr,
    LOG2_LEVELS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(T, BLOCK_T),)``: BLOCK_T tokens, every head, K and V.

    ``R`` is loaded once per program and reused for all heads of K and V.
    """
    pid_t = tl.program_id(0)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_p = tl.arange(0, HALF_DIM)
    slots = tl.load(slot_ptr + offs_t, mask=offs_t < num_tokens, other=-1).to(tl.int64)
    keep = slots >= 0
    slots = tl.where(keep, slots, 0)
    block_idx = slots // BLOCK_SIZE
    pos = slots % BLOCK_SIZE
    # R.T is [D, D]; its first/second column halves are the R row-halves, transposed.
    rot_lo = tl.load(rot_t_ptr + offs_d[:, None] * HEAD_DIM + offs_p[None, :])
    rot_hi = tl.load(rot_t_ptr + offs_d[:, None] * HEAD_DIM + HALF_DIM + offs_p[None, :])
    rows = offs_t.to(tl.int64)
    k_rows = key_ptr + rows[:, None] * stride_kt + offs_d[None, :]
    v_rows = value_ptr + rows[:, None] * stride_vt + offs_d[None, :]
    k_slot = block_idx * stride_kpb + pos * stride_kpp
    v_slot = block_idx * stride_vpb + pos * stride_vpp
    k_norm_slot = block_idx * stride_knb + pos * stride_knp
    v_norm_slot = block_idx * stride_vnb + pos * stride_vnp

    for head in range(num_heads):
        _encode_tile(
            k_rows + head * stride_kh, keep, rot_lo, rot_hi, bounds_ptr, cent_ptr,
            k_packed_ptr + (k_slot + head * stride_kph)[:, None] + offs_p[None, :],
            k_norms_ptr + k_norm_slot + head * stride_knh,
            HALF_DIM, LOG2_LEVELS, DOT_PRECISION,
        )
        _encode_tile(
            v_rows + head * stride_vh, keep, rot_lo, rot_hi, bounds_ptr, cent_ptr,
            v_packed_ptr + (v_slot + head * stride_vph)[:, None] + offs_p[None, :],
            v_norms_ptr + v_norm_slot + head * stride_vnh,
            HALF_DIM, LOG2_LEVELS, DOT_PRECISION,
        )


def quantize_into_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_packed: torch.Tensor,
    k_norms: torch.Tensor,
    v_packed: torch.Tensor,
    v_norms: torch.Tensor,
    codec: TQ4Codec,
) -> None:
    """Launch :func:`_quantize_kv_kernel` (no validation; see ``ops.quantize_into_cache``).

    Args:
        key, value: ``[T, H, D]`` (last dim contiguous).
        slot_mapping: ``[T]``; slots below zero are skipped.
        k_packed, v_packed: uint8 ``[NB, BS, H, D/2]``; k_norms, v_norms: ``[NB, BS, H]``.
    """
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    device = key.device
    # tl.dot needs >= 16 rows; the interpreter's cost is per program, so it gets more.
    block_t = 64 if INTERPRETED else 16
    grid = (triton.cdiv(num_tokens, block_t),)
    _quantize_kv_kernel[grid](
        key, value, slot_mapping,
        k_packed, k_norms, v_packed, v_norms,
        _rotation_t(codec, device), codec.boundaries, codec.centroids,
        num_tokens, num_heads,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_packed.stride(0), k_packed.stride(1), k_packed.stride(2),
        k_norms.stride(0), k_norms.stride(1), k_norms.stride(2),
        v_packed.stride(0), v_packed.stride(1), v_packed.stride(2),
        v_norms.stride(0), v_norms.stride(1), v_norms.stride(2),
        BLOCK_SIZE=k_packed.shape[1],
        HEAD_DIM=head_dim,
        HALF_DIM=head_dim // 2,
        LOG2_LEVELS=codec.bits,
        BLOCK_T=block_t,
        DOT_PRECISION=_dot_precision(device),
        num_warps=4,
    )


# ----------------------------------------------------------------------- decode
@triton.jit
def _centroids(packed, cent_ptr, table, LOOKUP: tl.constexpr, BLOCK_N: tl.constexpr,
               DOT_DTYPE: tl.constexpr):
    """Centroid values ``(low nibbles, high nibbles)`` of ``packed`` bytes ``[BLOCK_N, D/2]``
    as ``DOT_DTYPE``: loaded (L1-cached) from ``cent_ptr`` (``LOOKUP`` 0) or gathered
    from the 16-entry register ``table`` (1)."""
    low, high = (packed & 0xF).to(tl.int32), (packed >> 4).to(tl.int32)
    if LOOKUP == 1:
        rows = tl.broadcast_to(table[None, :], (BLOCK_N, 16))
        lo = tl.gather(rows, low, axis=1)
        hi = tl.gather(rows, high, axis=1)
    else:
        lo = tl.load(cent_ptr + low)
        hi = tl.load(cent_ptr + high)
    return lo.to(DOT_DTYPE), hi.to(DOT_DTYPE)


@triton.jit
def _decode_kernel(
    q_ptr,
    k_packed_ptr,
    k_norms_ptr,
    v_packed_ptr,
    v_norms_ptr,
    cent_ptr,
    block_table_ptr,
    seq_lens_ptr,
    mid_acc_ptr,
    mid_max_ptr,
    mid_sum_ptr,
    tokens_per_split,
    num_splits,
    stride_qb,
    stride_qh,
    stride_btb,
    stride_kpb,
    stride_kpp,
    stride_kph,
    stride_knb,
    stride_knp,
    stride_knh,
    stride_vpb,
    stride_vpp,
    stride_vph,
    stride_vnb,
    stride_vnp,
    stride_vnh,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    LOOKUP: tl.constexpr,
):
    """Grid ``(B, Hkv, num_splits)``; writes partial (acc, max, sum) per split.

    ``q_ptr`` holds rotated queries already multiplied by ``scale * log2(e)``, so
    the running max/sum are in base 2. ``mid_acc`` is ``[B, Hq, num_splits, D]``
    (rotated domain, unnormalised), ``mid_max``/``mid_sum`` ``[B, Hq, num_splits]``. The
    split count is a runtime argument: a sequence that grows past a split boundary
    reuses the compiled kernel. ``DOT_DTYPE`` and ``LOOKUP`` (0 load, 1 table):
    see :class:`DecodeConfig`.
    """
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_p = tl.arange(0, HALF_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    q_heads = kv_head * GROUP + offs_g
    q_rows = q_ptr + b * stride_qb + q_heads[:, None] * stride_qh + offs_p[None, :]
    q_lo = tl.load(q_rows, mask=g_mask[:, None], other=0.0).to(DOT_DTYPE)
    q_hi = tl.load(q_rows + HALF_DIM, mask=g_mask[:, None], other=0.0).to(DOT_DTYPE)
    table = tl.load(cent_ptr + tl.arange(0, 16))

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc_lo = tl.zeros([BLOCK_G, HALF_DIM], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_G, HALF_DIM], dtype=tl.float32)
    bt_row = block_table_ptr + b.to(tl.int64) * stride_btb

    for tok0 in range(start, end, BLOCK_N):
        toks = tok0 + offs_n
        n_mask = toks < end
        block_idx = tl.load(bt_row + toks // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        pos = toks % BLOCK_SIZE

        k_row = block_idx * stride_kpb + pos * stride_kpp + kv_head * stride_kph
        k_bytes = tl.load(k_packed_ptr + k_row[:, None] + offs_p[None, :],
                          mask=n_mask[:, None], other=0)
        k_norm = tl.load(k_norms_ptr + block_idx * stride_knb + pos * stride_knp
                         + kv_head * stride_knh, mask=n_mask, other=0.0)
        k_lo, k_hi = _centroids(k_bytes, cent_ptr, table, LOOKUP, BLOCK_N, DOT_DTYPE)
        scores = tl.dot(q_lo, tl.trans(k_lo), input_precision=DOT_PRECISION,
                        out_dtype=tl.float32)
        scores += tl.dot(q_hi, tl.trans(k_hi), input_precision=DOT_PRECISION,
                         out_dtype=tl.float32)
        scores = scores * k_norm[None, :]
        scores = tl.where(n_mask[None, :], scores, float("-inf"))

        # Every tile holds at least one live token, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        probs = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(probs, axis=1)

        v_row = block_idx * stride_vpb + pos * stride_vpp + kv_head * stride_vph
        v_bytes = tl.load(v_packed_ptr + v_row[:, None] + offs_p[None, :],
                          mask=n_mask[:, None], other=0)
        v_norm = tl.load(v_norms_ptr + block_idx * stride_vnb + pos * stride_vnp
                         + kv_head * stride_vnh, mask=n_mask, other=0.0)
        v_lo, v_hi = _centroids(v_bytes, cent_ptr, table, LOOKUP, BLOCK_N, DOT_DTYPE)
        weights = (probs * v_norm[None, :]).to(DOT_DTYPE)
        acc_lo = acc_lo * alpha[:, None] + tl.dot(weights, v_lo, input_precision=DOT_PRECISION,
                                                  out_dtype=tl.float32)
        acc_hi = acc_hi * alpha[:, None] + tl.dot(weights, v_hi, input_precision=DOT_PRECISION,
                                                  out_dtype=tl.float32)
        m_i = m_new

    mid_row = (b * (GROUP * tl.num_programs(1)) + q_heads).to(tl.int64) * num_splits + split
    acc_ptrs = mid_acc_ptr + mid_row[:, None] * HEAD_DIM + offs_p[None, :]
    tl.store(acc_ptrs, acc_lo, mask=g_mask[:, None])
    tl.store(acc_ptrs + HALF_DIM, acc_hi, mask=g_mask[:, None])
    tl.store(mid_max_ptr + mid_row, m_i, mask=g_mask)
    tl.store(mid_sum_ptr + mid_row, l_i, mask=g_mask)


@functools.lru_cache(maxsize=16)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pick_num_splits(
    batch: int, num_kv_heads: int, max_tokens: int, block_n: int, device: torch.device,
    per_sm: int = 8,
) -> int:
    """Splits of the context so that ``B * Hkv * splits`` programs fill the device.

    Aims at ``per_sm`` (default eight) programs per SM: each program's tile loads wait on
    the block-table load before them, so the device needs many programs in flight to
    keep HBM busy (measured on an H200: two per SM reached 107 GB/s at 32K tokens).
    Never below two ``BLOCK_N`` tiles per split, at most 256 splits (the merge reads
    every split).
    """
    if device.type == "cuda" and not INTERPRETED:
        index = device.index if device.index is not None else torch.cuda.current_device()
        num_sms = _num_sms(index)
    else:
        num_sms = 4
    wanted = triton.cdiv(per_sm * num_sms, max(1, batch * num_kv_heads))
    most = max(1, triton.cdiv(max_tokens, 2 * block_n))
    return max(1, min(wanted, most, MAX_SPLITS))


def tq4_decode_attention_triton(
    query: torch.Tensor,
    k_packed: torch.Tensor,
    k_norms: torch.Tensor,
    v_packed: torch.Tensor,
    v_norms: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    codec: TQ4Codec,
    scale: float,
    num_splits: int | None = None,
    return_lse: bool = False,
    config: DecodeConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Launch :func:`_decode_kernel` and merge its splits (no validation).

    Args:
        query: ``[B, Hq, D]``.
        k_packed, v_packed: uint8 ``[NB, BS, Hkv, D/2]``; k_norms, v_norms: ``[NB, BS, Hkv]``.
        block_table: ``[B, max_blocks]``; seq_lens: ``[B]`` (int32 or int64).
        codec: the codec the cache was written with; scale: softmax scale.
        num_splits: split-K factor; ``None`` picks one from the block-table width.
        return_lse: also return the natural-log log-sum-exp of the scaled scores.
        config: how the kernel is compiled and launched (default: :func:`default_decode`).

    Returns:
        float32 ``[B, Hq, D]``, plus the log-sum-exp ``[B, Hq]`` with ``return_lse``.
    """
    batch, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = k_packed.shape[1], k_packed.shape[2]
    group = num_q_heads // num_kv_heads
    device = query.device
    # Sizing from the table width (not seq_lens.max()) keeps the launch sync-free.
    max_tokens = max(1, block_table.shape[1] * block_size)
    cfg = config or default_decode(device)
    block_n = cfg.block_n if max_tokens >= cfg.block_n else 16
    if num_splits is None:
        num_splits = pick_num_splits(batch, num_kv_heads, max_tokens, block_n, device,
                                     cfg.splits_per_sm)
        # Whole tiles per split; the rounding may leave fewer splits than picked.
        tokens_per_split = triton.cdiv(triton.cdiv(max_tokens, num_splits), block_n) * block_n
    else:
        tokens_per_split = triton.cdiv(max_tokens, num_splits)
    num_splits = triton.cdiv(max_tokens, tokens_per_split)

    q_rot = (query.float() @ _query_rotation(codec, scale)).contiguous()
    mid_acc = torch.empty(batch, num_q_heads, num_splits, head_dim, device=device)
    mid_max = torch.empty(batch, num_q_heads, num_splits, device=device)
    mid_sum = torch.empty(batch, num_q_heads, num_splits, device=device)
    grid = (batch, num_kv_heads, num_splits)
    compiled = _decode_kernel[grid](
        q_rot, k_packed, k_norms, v_packed, v_norms, codec.centroids,
        block_table, seq_lens,
        mid_acc, mid_max, mid_sum,
        tokens_per_split, num_splits,
        q_rot.stride(0), q_rot.stride(1), block_table.stride(0),
        k_packed.stride(0), k_packed.stride(1), k_packed.stride(2),
        k_norms.stride(0), k_norms.stride(1), k_norms.stride(2),
        v_packed.stride(0), v_packed.stride(1), v_packed.stride(2),
        v_norms.stride(0), v_norms.stride(1), v_norms.stride(2),
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),  # tl.dot needs >= 16 rows
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HALF_DIM=head_dim // 2,
        BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(device),
        DOT_DTYPE=tl.float16 if cfg.fp16 else tl.float32,
        LOOKUP=("load", "table").index(cfg.lookup),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    out = torch.empty(batch, num_q_heads, head_dim, device=device)
    lse = torch.empty(batch, num_q_heads, device=device)
    block_j = triton.next_power_of_2(head_dim)
    merged = _merge_kernel[(batch * num_q_heads,)](
        mid_acc, mid_max, mid_sum, codec.rotation, out, lse, num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits),
        HEAD_DIM=head_dim,
        BLOCK_J=block_j,
        BLOCK_D=min(32, block_j),
        num_warps=4,
    )
    LAST_COMPILED["decode"], LAST_COMPILED["merge"] = compiled, merged
    return (out, lse) if return_lse else out


@triton.jit
def _merge_kernel(
    acc_ptr,
    max_ptr,
    sum_ptr,
    rot_ptr,
    out_ptr,
    lse_ptr,
    num_splits,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid ``(B * Hq,)``: merge one query head's split partials and rotate back.

    ``out = (sum_s w_s acc_s / sum_s w_s l_s) @ R`` with ``w_s = 2^(m_s - max m)``;
    splits with no tokens (``l_s = 0``) weigh nothing, and a sequence with none at all
    gets zeros and a log-sum-exp of ``-inf``. ``lse`` is in natural log.
    """
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    m = tl.load(max_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    l_s = tl.load(sum_ptr + row * num_splits + offs_s, mask=s_mask, other=0.0)
    live = l_s > 0
    m_max = tl.max(tl.where(live, m, float("-inf")), axis=0)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(live, tl.exp2(tl.where(live, m, m_ref) - m_ref), 0.0)
    den = tl.sum(w * l_s, axis=0)
    inv = tl.where(den > 0, 1.0 / tl.where(den > 0, den, 1.0), 0.0)

    offs_j = tl.arange(0, BLOCK_J)
    j_mask = offs_j < HEAD_DIM
    out = tl.zeros([BLOCK_J], dtype=tl.float32)
    for d0 in range(0, HEAD_DIM, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        acc = tl.load(acc_ptr + (row * num_splits + offs_s[:, None]) * HEAD_DIM
                      + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        v = tl.sum(acc * w[:, None], axis=0) * inv
        r = tl.load(rot_ptr + offs_d[:, None] * HEAD_DIM + offs_j[None, :],
                    mask=d_mask[:, None] & j_mask[None, :], other=0.0)
        out += tl.sum(v[:, None] * r, axis=0)
    tl.store(out_ptr + row * HEAD_DIM + offs_j, out, mask=j_mask)
    lse2 = tl.where(den > 0, m_ref + tl.log2(tl.where(den > 0, den, 1.0)), float("-inf"))
    tl.store(lse_ptr + row, lse2 * 0.6931471805599453)
