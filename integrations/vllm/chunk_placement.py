"""Moving stored chunks into a request's pages: each moved token's K/V decoded from its
source blocks and written at its new position, its key re-rotated by the position
delta (RoPE's rotations compose).

The work goes layer by layer, so that one layer of the source blocks stays in cache
from decoding to the pages: the layer's keys and values are decoded into a small
buffer (rows ordered block, head, token: a source page's key half is one contiguous
run there, as in vLLM's CPU pages), then the moved tokens are written. On vLLM's CPU
layout with float32 pages and contiguous layers, one fused kernel
(:func:`gpu_cache.kernels.cpu_fused.rope_move_into`) reads each moved token-head's key
and value from the buffer, rotates the key and writes both into the page rows the
layout names (:attr:`PagedLayout.rows <integrations.vllm.layout.PagedLayout>`), in
the probed key order. Elsewhere torch gathers, rotates and writes through
:class:`~integrations.vllm.chunk_forward.PagedKV` (vLLM's own cache kernel on the CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpu_cache.kernels import cpu_fused
from integrations.vllm.chunk_forward import PagedKV, ServedLlama
from integrations.vllm.chunk_planning import MovedChunk
from integrations.vllm.layout import keys_by_token
from integrations.vllm.pools import decode_pool_layer_into

__all__ = ["ChunkPlacement"]

#: ``(pool, the blocks' indexes among the sources, the blocks exported)`` per pool
#: holding them (:meth:`~integrations.vllm.store.ConnectorStore.export_all`).
Parts = Sequence[tuple[Any, Sequence[int], Mapping[str, torch.Tensor]]]
#: ``(block ids, heads, block size)`` -> the key and value rows of each (block, token,
#: head) in a contiguous layer viewed as rows of ``D`` values.
RowsOf = Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class ChunkPlacement:
    """The moved tokens of one chunk load: where they come from and go.

    Attributes:
        at: each moved token's slot among the source blocks' tokens (source index
            times the block size plus its slot there) ``[T]``.
        where: its position in the request ``[T]``.
        cos: RoPE's rotation by its position delta, cos ``[T, 1, D/2]``.
        sin: and sin (signed).
        num_sources: the source blocks.
    """

    at: torch.Tensor
    where: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    num_sources: int

    @classmethod
    def of(cls, chunks: Sequence[MovedChunk], sources: Mapping[bytes, int],
           block_size: int, rotation: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
           ) -> ChunkPlacement:
        """The placement of ``chunks``, their source blocks indexed by ``sources``
        (block key -> index); ``rotation``: cos and sin of a rotation by each delta
        (:meth:`ServedLlama.rotation`)."""
        bs = block_size
        at, delta, where = [], [], []
        for moved in chunks:
            slots = torch.cat([torch.arange(bs) + sources[key] * bs for key in moved.source_keys])
            at.append(slots[moved.offset:moved.offset + moved.length])
            delta.append(torch.full((moved.length,), moved.position - moved.source_position))
            where.append(torch.arange(moved.position, moved.position + moved.length))
        cos, sin = rotation(torch.cat(delta))
        return cls(torch.cat(at), torch.cat(where), cos, sin, len(sources))

    @property
    def tokens(self) -> int:
        return int(self.at.shape[0])

    def run(self, parts: Parts, paged: PagedKV, rows_of: RowsOf | None = None) -> None:
        """Decode and write every layer (on the calling thread: the fused decoder sets
        its thread's OpenMP count, so the connector calls this on its loader thread).
        ``rows_of``: the layout's rows where every layer is a contiguous float32 CPU
        tensor that vLLM's CPU attention reads (``paged.isa``): the fused path."""
        heads, bs = paged.num_kv_heads, paged.block_size
        dim = int(paged.pages[0].shape[-1])
        n_rows = self.num_sources * heads * bs
        buf = torch.empty(2 * n_rows, dim, dtype=torch.float32)
        # the decoder's input is (block, token, head); its rows here (block, head, token)
        order = ((torch.arange(heads)[None, :] * bs + torch.arange(bs)[:, None])
                 .reshape(-1))
        plan = []
        for pool, held_at, data in parts:
            rows_k = (torch.as_tensor(list(held_at))[:, None] * heads * bs + order).reshape(-1)
            plan.append((pool, data, rows_k, rows_k + n_rows))
        write = (self._fused(paged, rows_of, buf, n_rows)
                 if rows_of is not None and self._fusable(paged)
                 else self._torch(paged, buf, n_rows))
        with torch.inference_mode():
            for layer in range(len(paged.pages)):
                for pool, data, rows_k, rows_v in plan:
                    decode_pool_layer_into(pool, data, layer, buf, rows_k, rows_v)
                write(layer)

    @staticmethod
    def _fusable(paged: PagedKV) -> bool:
        return (paged.isa is not None and cpu_fused.available()
                and all(p.device.type == "cpu" and p.dtype == torch.float32
                        and p.is_contiguous() for p in paged.pages))

    def _fused(self, paged: PagedKV, rows_of: RowsOf, buf: torch.Tensor, n_rows: int
               ) -> Callable[[int], None]:
        """One kernel per layer: each moved token-head's key (rotated) and value from
        the buffer straight into its page rows."""
        heads, bs = paged.num_kv_heads, paged.block_size
        dim = buf.shape[1]
        head = torch.arange(heads)[None, :]
        by_dim = paged.key_order == "dim"  # a page's key half is [D, N]: stride N
        # sources: (block, head) pages of N rows in the buffer
        src_block, src_slot = (self.at // bs)[:, None], (self.at % bs)[:, None]
        page = (src_block * heads + head) * bs
        k_src = page * dim + src_slot if by_dim else (page + src_slot) * dim
        v_src = (n_rows + page + src_slot) * dim
        # destinations: the layout's rows of the request's blocks
        ids = torch.as_tensor(list(paged.block_ids), dtype=torch.int64)
        used = torch.unique(self.where // bs)
        k_rows, v_rows = (r.view(len(used), bs, heads) for r in rows_of(ids[used], heads, bs))
        blk = torch.searchsorted(used, self.where // bs)[:, None]
        slot = (self.where % bs)[:, None]
        k_dst = (k_rows[blk, 0, head] * dim + slot if by_dim
                 else k_rows[blk, slot, head] * dim)
        v_dst = v_rows[blk, slot, head] * dim
        args = [t.reshape(-1).contiguous().numpy() for t in (k_src, k_dst)]
        step = bs if by_dim else 1
        rest = [t.reshape(-1).contiguous().numpy() for t in (v_src, v_dst)]
        cos = self.cos[:, 0].float().contiguous().numpy()
        sin = self.sin[:, 0].float().contiguous().numpy()
        src = buf.view(-1).numpy()
        dst = [p.view(-1).numpy() for p in paged.pages]

        def write(layer: int) -> None:
            cpu_fused.rope_move_into(src, dst[layer], args[0], args[1], step, rest[0], rest[1],
                                     cos, sin, heads)

        return write

    def _torch(self, paged: PagedKV, buf: torch.Tensor, n_rows: int) -> Callable[[int], None]:
        """Gather, rotate and write with torch ops (vLLM's cache kernel on the CPU)."""
        heads, bs = paged.num_kv_heads, paged.block_size
        dim, n_src = buf.shape[1], self.num_sources

        def write(layer: int) -> None:
            k = keys_by_token(buf[:n_rows].view(n_src, heads, bs, dim), paged.key_order)
            v = buf[n_rows:].view(n_src, heads, bs, dim)
            k, v = (t.permute(0, 2, 1, 3).reshape(n_src * bs, heads, dim)[self.at]
                    for t in (k, v))
            paged.write(layer, self.where, ServedLlama.rotate_with(k, self.cos, self.sin), v)

        return write
