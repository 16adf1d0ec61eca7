"""Teacher-forced scoring: the logits a request's path gives a known continuation
(:meth:`contextkit.engine.engine.Engine.score`), to measure what a cache format, a
reuse or a repaired chunk costs in quality."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from contextkit.engine.blend import prefill_reusing_chunks
from contextkit.engine.chunks import ChunkReuse
from contextkit.engine.runner import ModelRunner, foreground
from contextkit.engine.sequence import close_sequence, open_sequence
from contextkit.engine.types import TokenSpan
from gpu_cache import validate_tenant

__all__ = ["score"]


def score(
    runner: ModelRunner,
    prompt_ids: Sequence[int],
    target_ids: Sequence[int],
    *,
    chunk_reuse: ChunkReuse,
    tenant: str = "default",
    use_cache: bool = True,
    max_reuse_tokens: int | None = None,
    residual_tokens: int | None = None,
    sink_tokens: int | None = None,
    spans: Sequence[TokenSpan] | None = None,
    chunk_starts: Sequence[int] | None = None,
    chunk_edits: Sequence[int] = (),
) -> torch.Tensor:
    """Teacher-forced logits ``[len(target), V]``: row ``i`` predicts ``target[i]``.

    With the cache, the prompt reuses cached blocks and the target tokens read
    their own K/V back as decode would (packed, or from the residual window), so
    the logits reflect the cache format. Without it, everything is one exact
    full prefill.

    Args:
        chunk_reuse: the engine's chunk reuse settings (for ``spans``/``chunk_starts``).
        max_reuse_tokens: reuse at most this many cached prompt tokens (to replay
            the exact path a request took: what it reused, what it computed).
        residual_tokens: this call's float residual window (default: the
            engine's; with ``sink_tokens=0``, 0 reads every token back from TQ4).
        sink_tokens: this call's float attention sink (default: the engine's).
        spans, chunk_starts: replay a request's chunk reuse
            (:mod:`contextkit.engine.chunks`): the chunks of ``spans`` starting at
            ``chunk_starts`` (a :class:`~contextkit.engine.types.GenerationResult`'s
            ``reused_chunk_starts``) are reused and repaired as that request did;
        chunk_edits: of those, the ones it aligned against an earlier version
            (``reused_chunk_edits``).

    Raises:
        ValueError: an empty target or an over-long sequence.
        TokenIdError: a token id outside the vocabulary (a ValueError).
        InvalidNameError: a tenant that breaks :func:`gpu_cache.validate_tenant`.
    """
    validate_tenant(tenant)
    prompt = runner.check_token_ids(prompt_ids, "prompt_ids")
    target = runner.check_token_ids(target_ids, "target_ids")
    if not target:
        raise ValueError("target_ids is empty")
    ids = prompt + target
    runner.check_prompt(ids, 0)
    with foreground(runner):
        if not use_cache:
            logits = runner.prefill(ids, 0, runner.contiguous(),
                                     all_logits=True)
            return logits[len(prompt) - 1 : len(ids) - 1]
        seq = open_sequence(runner.cache, ids, 0, tenant, None, True,
                            max_reuse=max_reuse_tokens)
        try:
            cached = seq.cached_tokens
            start = min(cached, len(prompt) - 1)
            kv = runner.paged(seq.block_ids, cached, prompt, start, tenant, residual_tokens,
                               sink_tokens)
            if spans and chunk_starts:
                first, _ = prefill_reusing_chunks(runner, prompt, start, kv, spans, tenant,
                                                  chunk_reuse, only=chunk_starts,
                                                  edits=chunk_edits)
            else:
                first = runner.prefill(prompt, start, kv)
            if len(target) == 1:
                return first[None]
            kv.fresh = False  # target tokens read their own K/V back, as decode does
            rest = runner.forward(target[:-1], len(prompt), kv, all_logits=True)
        finally:
            close_sequence(runner.cache, seq, ids, len(ids) - 1)
        return torch.cat([first[None], rest])
