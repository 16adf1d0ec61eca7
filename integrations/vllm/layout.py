"""vLLM's per-layer paged KV tensor as whole pages, and pages as K and V.

vLLM hands connectors one tensor per layer, logically ``[num_blocks, H, N, 2 * D]``
(``N`` = block size; RFC #42082 "standardized" views). Backends read it differently:

- CPU attention reinterprets each ``(block, head)`` page as ``[2 * N, D]`` rows:
  rows ``0..N-1`` are the keys, rows ``N..2N-1`` the values;
- GPU backends (FlashAttention, FlashInfer, Triton) split the last axis: K is
  ``[..., :D]``, V is ``[..., D:]`` (physical strides may be permuted; the views
  follow them).

A :class:`PagedLayout` gives a page view of the layer whose dim 0 is vLLM's block id,
so a load is one ``index_copy_`` per layer and a save one ``index_select`` (per
element indexing of strided K/V views is ~40x slower on CPU). Where the layer is a
contiguous tensor, ``rows`` names the row (of ``D`` values) of every token-head's key
and value, so stored blocks decode straight into their pages
(:func:`gpu_cache.formats.decode_layer_into`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["CPU_LAYOUT", "LAYOUTS", "SPLIT_LAYOUT", "PagedLayout", "probe_amx_pages"]


@dataclass(frozen=True, slots=True)
class PagedLayout:
    """How K/V ``[n, H, N, D]`` sit in the pages of one layer.

    Attributes:
        pages: layer tensor -> page view ``[num_blocks, ...]`` (a view, writable).
        join: ``(k, v)`` -> pages ``[n, ...]``.
        split: pages ``[n, ...]`` -> ``(k, v)``.
        rows: ``(block_ids [n], H, N)`` -> int64 ``(k_rows, v_rows)`` ``[n * N * H]``,
            the rows of a contiguous layer viewed as ``[-1, D]`` holding each
            token-head (order block, token, head), or None when rows do not apply.
    """

    pages: Callable[[torch.Tensor], torch.Tensor]
    join: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    split: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    rows: Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]] | None = None


def _cpu_pages(kv: torch.Tensor) -> torch.Tensor:
    num_blocks, num_heads, block_size, two_d = kv.shape
    return kv.view(num_blocks, num_heads, 2 * block_size, two_d // 2)


def _cpu_split(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    block_size = pages.shape[2] // 2
    return pages[:, :, :block_size], pages[:, :, block_size:]


def _cpu_rows(block_ids: torch.Tensor, num_heads: int, block_size: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    page = block_ids.to(torch.int64)[:, None, None]
    head = torch.arange(num_heads)[None, None, :]
    token = torch.arange(block_size)[None, :, None]
    k_rows = ((page * num_heads + head) * 2 * block_size + token).reshape(-1)
    return k_rows, k_rows + block_size


def _split_split(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = pages.shape[-1] // 2
    return pages[..., :head_dim], pages[..., head_dim:]


#: CPU_ATTN: ``[NB, H, N, 2D]`` viewed as ``[NB, H, 2N, D]``, keys first.
CPU_LAYOUT = PagedLayout(pages=_cpu_pages, join=lambda k, v: torch.cat((k, v), dim=2),
                         split=_cpu_split, rows=_cpu_rows)
#: GPU backends: K and V are the two halves of the last axis.
SPLIT_LAYOUT = PagedLayout(pages=lambda kv: kv, join=lambda k, v: torch.cat((k, v), dim=-1),
                           split=_split_split)

#: layout name -> layout; the connector picks "cpu" on vLLM's CPU platform.
LAYOUTS: dict[str, PagedLayout] = {"cpu": CPU_LAYOUT, "split": SPLIT_LAYOUT}


#: How a CPU page's key half orders its values: ``"token"`` (``[N, D]``: one row per
#: token) or ``"dim"`` (``[D, N]``: the "vec" kernels keep keys d-major so that a
#: query's dot products run along tokens). Values are token-major on every ISA.
KEY_ORDERS = ("token", "dim")


def probe_cpu_key_order(isa: str, block_size: int, head_dim: int) -> str | None:
    """Where vLLM's CPU attention writes a token's key inside a page: one of
    :data:`KEY_ORDERS`, or None for a layout neither describes. Found by writing known
    keys through vLLM's own cache kernel (``cpu_attn_reshape_and_cache``) for ``isa``.

    The connector stores and loads whole pages, so either order round-trips; moving a
    chunk's keys to other positions (chunk reuse) needs each token's key.
    """
    from vllm import _custom_ops as ops

    n, d = block_size, head_dim
    pages = torch.zeros(1, 1, 2 * n, d)
    k_half, v_half = pages.chunk(2, dim=2)
    keys = torch.arange(n * d, dtype=torch.float32).reshape(n, 1, d) + 1
    ops.cpu_attn_reshape_and_cache(keys, keys.clone(), k_half, v_half, torch.arange(n), isa)
    memory = k_half.reshape(-1)
    for order in KEY_ORDERS:
        if torch.equal(keys_by_token(memory.view(1, 1, n, d), order)[0, 0], keys[:, 0]):
            return order
    return None


def probe_amx_pages(key_order: str, block_size: int, head_dim: int) -> bool:
    """Whether :func:`gpu_cache.kernels.cpu_fused.amx_pages_into` lays float32 CPU
    pages (keys in ``key_order``) out in bfloat16 exactly as vLLM's AMX cache kernel
    (``cpu_attn_reshape_and_cache`` with ``"amx"``) writes the same K/V: checked on
    random K/V of two blocks of two heads, gathered out of order. False without numba,
    for a block size not a multiple of 32 or a head dim not one of 16 (the AMX
    kernel's tiles), or where they differ (another
    vLLM's layout): the connector then casts through vLLM's kernel."""
    import numpy as np
    from vllm import _custom_ops as ops

    from gpu_cache.kernels import cpu_fused

    n, d, heads = block_size, head_dim, 2
    if not cpu_fused.available() or n % 32 or d % 16 or key_order not in KEY_ORDERS:
        return False
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, heads, n, d, generator=gen) for _ in range(2))  # [blocks, H, N, D]
    pages = torch.zeros(3, heads, 2 * n, d)
    ids = [2, 0]
    for i, block in enumerate(ids):
        keys_by_token(pages[block:block + 1, :, :n], key_order)[0] = k[i]
        pages[block, :, n:] = v[i]
    want = torch.zeros(2, heads, 2 * n, d, dtype=torch.bfloat16)
    k_half, v_half = want.chunk(2, dim=2)
    tokens = [t.permute(0, 2, 1, 3).reshape(2 * n, heads, d).to(torch.bfloat16) for t in (k, v)]
    ops.cpu_attn_reshape_and_cache(*tokens, k_half, v_half, torch.arange(2 * n), "amx")
    got = torch.zeros_like(want)
    cpu_fused.amx_pages_into(pages.view(-1).numpy().view(np.uint32), np.array(ids),
                             got.view(torch.int16).view(-1).numpy().view(np.uint16), heads,
                             n, d, key_order == "dim")
    return torch.equal(got, want)


def keys_by_token(k: torch.Tensor, order: str) -> torch.Tensor:
    """A page's key half ``[..., N, D]`` (as :class:`PagedLayout` ``split`` gives it, or
    stored blocks of it) with one row per token; a view where the trailing ``N * D``
    values are contiguous (writable into the pages), else a copy."""
    if order == "token":
        return k
    n, d = k.shape[-2], k.shape[-1]
    try:
        flat = k.view(*k.shape[:-2], d, n)
    except RuntimeError:
        flat = k.contiguous().view(*k.shape[:-2], d, n)
    return flat.transpose(-1, -2)
