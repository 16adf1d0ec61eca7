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

__all__ = ["CPU_LAYOUT", "LAYOUTS", "SPLIT_LAYOUT", "PagedLayout"]


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
