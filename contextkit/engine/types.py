"""Public value types and errors of the engine (re-exported by :mod:`contextkit.engine.engine`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CacheFullError", "GenerationResult", "TokenIdError", "TokenSpan"]


class TokenIdError(ValueError):
    """A token id that is not an integer in the model's vocabulary ``[0, vocab_size)``."""


class CacheFullError(RuntimeError):
    """The device tier cannot hold a request's blocks; nothing cached was dropped."""


@dataclass(frozen=True, slots=True)
class TokenSpan:
    """Semantic label of prompt tokens ``[start, end)`` for block registration."""

    start: int
    end: int
    source_layer: str
    importance: float = 0.5


@dataclass
class GenerationResult:
    """One request's output and telemetry.

    Attributes:
        text: decoded reply (special tokens removed).
        token_ids: reply token ids (EOS included when generated).
        prompt_tokens: tokens in the prompt.
        reused_tokens: prompt tokens whose K/V came from the cache.
        warmed_tokens: of those, the tokens whose blocks this request brought up from
            the host tier (the rest were already on the device).
        computed_tokens: prompt tokens run through the model.
        ttft_ms: request start to first token.
        total_ms: request start to last token.
        decode_tps: (property) decode tokens/s: tokens 2..N over ``total_ms - ttft_ms``;
            ``None`` for a one-token reply.
        blocks_per_tier: the caller's tenant's blocks per tier after the request (other
            tenants' are not counted; ``engine.cache.summary()`` has the cache-wide view).
        block_ids: this sequence's blocks in order (kept or freed afterwards).
        first_logits: float32 logits that chose the first token ``[vocab]``.
        chunk_reused_tokens: prompt tokens past the cached prefix whose K/V came from
            cached chunks (:mod:`contextkit.engine.chunks`) and were not recomputed;
            not in ``computed_tokens``.
        repaired_tokens: tokens of those chunks that were recomputed (the seams); in
            ``computed_tokens``.
        reused_chunks: the labels of the reused chunks, in prompt order.
        reused_chunk_starts: their positions (to replay the path in ``Engine.score``).
        reused_chunk_tokens: per reused chunk, its tokens not recomputed.
        reused_chunk_edits: the starts of the reused chunks whose text had changed:
            the tokens they share with a cached version were moved in.
        edited_tokens: tokens of those chunks computed because they changed (in
            ``computed_tokens``).
    """

    text: str
    token_ids: list[int]
    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    ttft_ms: float
    total_ms: float
    blocks_per_tier: dict[str, int]
    kv_format: str
    block_ids: list[int] = field(default_factory=list)
    first_logits: torch.Tensor | None = field(default=None, repr=False)
    warmed_tokens: int = 0
    chunk_reused_tokens: int = 0
    repaired_tokens: int = 0
    reused_chunks: list[str] = field(default_factory=list)
    reused_chunk_starts: list[int] = field(default_factory=list)
    reused_chunk_tokens: list[int] = field(default_factory=list)
    reused_chunk_edits: list[int] = field(default_factory=list)
    edited_tokens: int = 0

    @property
    def kv_reuse_ratio(self) -> float:
        """Fraction of prompt tokens served from the cache."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def decode_tps(self) -> float | None:
        """Decode tokens/s: the tokens after the first over the time after the first
        (``None`` when the reply has one token, or the clock did not move)."""
        decode_s = (self.total_ms - self.ttft_ms) / 1000
        if len(self.token_ids) < 2 or decode_s <= 0:
            return None
        return (len(self.token_ids) - 1) / decode_s

    def telemetry(self) -> dict[str, Any]:
        """The JSON-friendly telemetry fields."""
        return {
            "ttft_ms": round(self.ttft_ms, 2),
            "total_ms": round(self.total_ms, 2),
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "computed_tokens": self.computed_tokens,
            "warmed_tokens": self.warmed_tokens,
            "chunk_reused_tokens": self.chunk_reused_tokens,
            "repaired_tokens": self.repaired_tokens,
            "reused_chunks": list(self.reused_chunks),
            "edited_chunks": len(self.reused_chunk_edits),
            "edited_tokens": self.edited_tokens,
            "kv_reuse_ratio": round(self.kv_reuse_ratio, 4),
            "generated_tokens": len(self.token_ids),
            "decode_tps": None if (tps := self.decode_tps) is None else round(tps, 2),
            "blocks_per_tier": dict(self.blocks_per_tier),
            "kv_format": self.kv_format,
        }
