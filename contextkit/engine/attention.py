"""Attention helpers of the engine's forward pass: RoPE, flash passes, GQA folding,
log-sum-exp merging. Shapes are documented per function."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__: list[str] = []


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention ``[1, H, T, D]`` and its log-sum-exp ``[1, H, T]``."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)[:2]
        return out, lse
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        t, s = scores.shape[-2:]
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype), lse


def fold_heads(q: torch.Tensor, num_kv: int) -> torch.Tensor:
    """Queries ``[T, Hq, D]`` as ``[1, Hkv, T*G, D]``: the G query heads sharing a KV
    head become rows of one head, so K/V are read once per KV head, not per group."""
    num_new, num_q, dim = q.shape
    group = num_q // num_kv
    return q.view(num_new, num_kv, group, dim).permute(1, 0, 2, 3).reshape(
        1, num_kv, num_new * group, dim)


def unfold_heads(out: torch.Tensor, lse: torch.Tensor, num_new: int,
                 num_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fold_heads` for an attention output and its log-sum-exp:
    ``[1, Hkv, T*G, D]``, ``[1, Hkv, T*G]`` -> ``[1, Hq, T, D]``, ``[1, Hq, T]``."""
    num_kv, dim = out.shape[1], out.shape[-1]
    group = num_q // num_kv
    out = out.view(num_kv, num_new, group, dim).permute(0, 2, 1, 3).reshape(
        1, num_q, num_new, dim)
    lse = lse.view(num_kv, num_new, group).permute(0, 2, 1).reshape(1, num_q, num_new)
    return out, lse


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax attention over keys ``A + B`` from the attentions over ``A`` and ``B``
    and their log-sum-exps (outputs ``[..., D]``, lse ``[...]``; ``-inf``: no keys)."""
    top = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    return (out_a * w_a[..., None] + out_b * w_b[..., None]) / (w_a + w_b)[..., None]


def attend_with_prefix(q: torch.Tensor, k_prefix: torch.Tensor | None,
                       v_prefix: torch.Tensor | None, k_new: torch.Tensor,
                       v_new: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``T`` new queries over a visible prefix plus themselves.

    Args:
        q: ``[T, Hq, D]``; k_prefix, v_prefix: ``[P, Hkv, D]`` or None; k_new, v_new:
            ``[T, Hkv, D]``.

    Returns:
        ``[T, Hq, D]``. Prefix and causal parts run as two flash passes merged by
        their log-sum-exp, so no ``T x (P+T)`` mask is ever built.
    """
    num_new, num_q, _ = q.shape
    num_kv = k_new.shape[1]
    group = num_q // num_kv

    def heads(x: torch.Tensor) -> torch.Tensor:  # [N, Hkv, D] -> [1, Hq, N, D]
        x = x.transpose(0, 1)
        if group > 1:
            x = x.repeat_interleave(group, dim=0)
        return x[None]

    out_new, lse_new = flash_attention(q.transpose(0, 1)[None], heads(k_new), heads(v_new),
                                       True, scale)
    if k_prefix is None or v_prefix is None or k_prefix.shape[0] == 0:
        return out_new[0].transpose(0, 1)
    out_pre, lse_pre = flash_attention(fold_heads(q, num_kv), k_prefix.transpose(0, 1)[None],
                                       v_prefix.transpose(0, 1)[None], False, scale)
    out_pre, lse_pre = unfold_heads(out_pre, lse_pre, num_new, num_q)
    out = merge_partials(out_pre, lse_pre, out_new, lse_new)
    return out[0].transpose(0, 1).to(q.dtype)


#: Query rows per step of :func:`attend_positions` (bounds its mask: rows x tokens).
_ROWS_PER_STEP = 1024


def attend_positions(q: torch.Tensor, positions: torch.Tensor, k_all: torch.Tensor,
                     v_all: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of queries at scattered positions, each over every token up to its own.

    Args:
        q: ``[T, Hq, D]``; positions: ``[T]`` their positions, ascending.
        k_all, v_all: ``[N, Hkv, D]``, the tokens ``0..N`` (``N > positions[-1]``).

    Returns:
        ``[T, Hq, D]``: the fused SDPA kernel with a boolean mask (grouped-query heads
        read each K/V head once), in steps of query rows, each over the tokens up to
        its last position.
    """
    num_new, num_q, _ = q.shape
    group_heads = num_q != k_all.shape[1]
    keys, values = k_all.transpose(0, 1)[None], v_all.transpose(0, 1)[None]  # [1, Hkv, N, D]
    cols = torch.arange(k_all.shape[0], device=q.device)
    at = positions.to(q.device)
    outs = []
    for r0 in range(0, num_new, _ROWS_PER_STEP):
        r1 = min(r0 + _ROWS_PER_STEP, num_new)
        end = int(at[r1 - 1]) + 1
        seen = cols[None, :end] <= at[r0:r1, None]  # [t, end]
        out = F.scaled_dot_product_attention(
            q[r0:r1].transpose(0, 1)[None], keys[:, :, :end], values[:, :, :end],
            attn_mask=seen, scale=scale, enable_gqa=group_heads)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)
