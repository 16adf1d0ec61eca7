"""The prefill of a request that reuses chunks past its cached prefix.

The first model layers (``0..select_layer``) run over every token after the prefix,
the reused chunks' too: their K/V there are computed afresh, and at ``select_layer``
each reused token's fresh K/V are compared with the cached ones (where the chunk lies,
its fresh keys rotated back: ``ChunkReuse.deviation_at``).
The tokens picked by :func:`contextkit.engine.chunks.select_repair` and every token
that is not part of a reused chunk (changed layers, the template between spans, the
residual window at the end) run through the remaining layers; the others keep the
moved K/V there, and the computed tokens attend over them. This is CacheBlend's
selective recompute on the engine's own forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from contextkit.engine.attention import rotate
from contextkit.engine.chunks import (
    ChunkHit,
    ChunkReuse,
    ChunkSource,
    ChunkUse,
    copy_chunks,
    find_chunks,
    kv_deviation,
    release_chunks,
    select_repair,
)
from contextkit.engine.kv import PagedKV
from contextkit.engine.runner import ModelRunner
from contextkit.engine.types import TokenSpan

__all__ = ["prefill_reusing_chunks"]


def prefill_reusing_chunks(runner: ModelRunner, ids: Sequence[int], start: int, kv: PagedKV,
                           spans: Sequence[TokenSpan], tenant: str, cfg: ChunkReuse,
                           only: Sequence[int] | None = None,
                           edits: Sequence[int] = ()) -> tuple[torch.Tensor, ChunkUse]:
    """Prefill ``ids[start:]`` into ``kv``, reusing cached chunks where the index has
    them (``only``: just the chunks starting there, and ``edits``: of those, the ones
    aligned against a version, to replay a request's path); logits of the last token
    and what was reused.

    Without a chunk to reuse (or a tail longer than the engine's ``prefill_chunk``)
    this is the plain prefill.
    """
    n = len(ids)
    use = ChunkUse()
    window = kv.window_start if kv.window_start is not None else n
    lo = max(start, kv.sink, kv.cached)
    hits: list[ChunkHit] = []
    if cfg.enabled and spans and n - start <= runner.prefill_chunk \
            and cfg.select_layer < runner.model.num_layers:
        hits = find_chunks(runner.cache, ids, spans, tenant, lo, window, cfg, only, edits)
        if only is None and sum(h.length for h in hits) < cfg.min_share * (n - start):
            release_chunks(runner.cache, hits)  # too little to gain: a plain prefill
            hits = []
    if not hits:
        return runner.prefill(ids, start, kv), use
    try:
        # the selection layer's rows are all written afresh: the move there serves
        # only to compare against ("moved"); "source" reads them where they lie
        at_source = cfg.deviation_at == "source"
        source = copy_chunks(runner.cache, runner.model, hits, kv.table,
                             range(cfg.select_layer + at_source, runner.model.num_layers),
                             read_at=cfg.select_layer if at_source else None)
    finally:
        release_chunks(runner.cache, hits)
    logits, repaired = _blend_forward(runner, ids, start, kv, hits, cfg, source)
    use.repaired_tokens = sum(repaired)
    use.reused_tokens = sum(h.length for h in hits) - use.repaired_tokens
    for hit, fixed in zip(hits, repaired, strict=True):  # per span, its runs summed
        if not use.starts or use.starts[-1] != hit.span_start:
            use.chunks.append(hit.label)
            use.starts.append(hit.span_start)
            use.lengths.append(hit.span_length)
            use.moved.append(0)
            use.hops.append(hit.entry.hops + 1)
            if hit.edit:
                use.edits.append(hit.span_start)
                use.edited_tokens += hit.span_length
        use.moved[-1] += hit.length - fixed
        if hit.edit:
            use.edited_tokens -= hit.length
    return logits, use


@torch.inference_mode()
def _blend_forward(runner: ModelRunner, ids: Sequence[int], start: int, kv: PagedKV,
                   hits: Sequence[ChunkHit], cfg: ChunkReuse,
                   source: ChunkSource | None = None) -> tuple[torch.Tensor, list[int]]:
    """The staged forward; logits of the last token and, per chunk, how many of its
    tokens were recomputed (``source``: the reused rows at the selection layer as
    cached, else they are read after the move)."""
    m = runner.model
    n = len(ids)
    dev = m.device
    tokens = torch.tensor(list(ids[start:]), dtype=torch.long, device=dev)
    positions = torch.arange(start, n, device=dev)
    reused = torch.zeros(n - start, dtype=torch.bool)
    chunk_rows: list[tuple[int, int]] = []
    row = 0
    for hit in hits:
        reused[hit.start - start : hit.start - start + hit.length] = True
        chunk_rows.append((row, row + hit.length))
        row += hit.length
    reused_pos = positions[reused.to(dev)]
    h = F.embedding(tokens, m.embed)
    cos, sin = m.rope(positions)
    nq, nkv, d = m.num_heads, m.num_kv_heads, m.head_dim
    repaired = [0] * len(hits)
    for i, w in enumerate(m.layers):
        x = F.rms_norm(h, (m.hidden,), w.norm_in, m.eps)
        qkv = w.qkv(x).float()
        rows = x.shape[0]
        q = qkv[:, : nq * d].view(rows, nq, d)
        k = qkv[:, nq * d : (nq + nkv) * d].view(rows, nkv, d)
        v = qkv[:, (nq + nkv) * d :].view(rows, nkv, d)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if i < cfg.select_layer:
            attn = kv.attend(i, q, k, v, start, runner.scale)
        elif i == cfg.select_layer:
            mask = reused.to(dev)
            offset = None if kv.native else kv.cache.key_offset(i)
            if source is not None:
                deviation = source.deviation(k[mask], v[mask], offset)
            else:
                old_k, old_v = kv.rows(i, reused_pos)
                new_k = k[mask].float()
                if offset is not None:
                    new_k = new_k - offset
                deviation = kv_deviation(new_k, v[mask], old_k, old_v)
            pick = select_repair(deviation, chunk_rows, cfg, [h.first for h in hits])
            repaired = [int(pick[a:b].sum()) for a, b in chunk_rows]
            keep = ~reused
            keep[reused.nonzero()[:, 0][pick]] = True
            keep_dev = keep.to(dev)
            # every token's K/V are written here; only the rows that go on attend
            attn = kv.attend_some(i, q, k, v, start, keep_dev.nonzero()[:, 0], runner.scale)
            h, cos, sin, positions = h[keep_dev], cos[keep_dev], sin[keep_dev], positions[keep_dev]
        else:
            attn = kv.attend_rows(i, q, k, v, positions, runner.scale)
        h = h + w.o(attn.reshape(attn.shape[0], nq * d))
        x = F.rms_norm(h, (m.hidden,), w.norm_post, m.eps)
        gate, up = w.gate_up(x).chunk(2, dim=-1)
        h = h + w.down(F.silu(gate) * up)
    logits = m.lm_head(F.rms_norm(h[-1:], (m.hidden,), m.norm, m.eps))
    return logits[0].float(), repaired
