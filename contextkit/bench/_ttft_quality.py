"""Reply quality of ``bench ttft``'s TQ4 path, turn by turn, against a full prefill.

Each turn's reply from the no-cache baseline is teacher-forced through the path the
contextkit request took (:meth:`contextkit.engine.engine.Engine.score` with the same
reused prefix, chunks, edited lines and float overlay); top-1 agreement counts the
positions whose argmax is the baseline's token. On the turns that reused chunks the
same reply also goes through that turn's prefix alone on the same TQ4 cache, every
chunk token computed: the agreement chunk reuse would have had without moving
anything, the quality ceiling it is read against.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["ReplyQuality", "nll", "perplexity"]


def nll(logits: torch.Tensor, target: Sequence[int]) -> float:
    """Mean negative log-likelihood of ``target`` under teacher-forced ``logits``
    ``[len(target), V]``."""
    return float(torch.nn.functional.cross_entropy(logits.float(),
                                                   torch.tensor(list(target))))


def perplexity(logits: torch.Tensor, target: Sequence[int]) -> float:
    """Perplexity of ``target`` under teacher-forced ``logits``."""
    return math.exp(nll(logits, target))


class ReplyQuality:
    """Agreement and perplexity figures accumulated over the replay's turns.

    Args:
        engine: the TQ4 engine the turns ran on.
        held: token ids of a held-out continuation (perplexity after each chunk
            turn's prompt).
    """

    def __init__(self, engine: Any, held: Sequence[int]) -> None:
        self.engine = engine
        self.held = list(held)
        self.hits = self.total = self.packed_hits = 0
        self.chunk_hits = self.chunk_total = self.chunk_prefix_hits = 0
        self.chunk_nll: list[float] = []

    def turn(self, ids: Sequence[int], spans: Any, generation: Any,
             reply: Sequence[int]) -> float:
        """Score one turn (``generation``: contextkit's
        :class:`~contextkit.engine.types.GenerationResult`, ``reply``: the baseline's
        token ids); its top-1 agreement."""
        engine = self.engine
        target = torch.tensor(list(reply))
        reused = generation.reused_tokens

        def agree(**path: Any) -> int:
            return int((engine.score(ids, reply, **path).argmax(dim=-1) == target).sum())

        path = {"max_reuse_tokens": reused, "spans": spans,
                "chunk_starts": generation.reused_chunk_starts,
                "chunk_edits": generation.reused_chunk_edits}
        hits = agree(**path)
        if generation.reused_chunks:  # the turns whose chunks were reused
            self.chunk_hits += hits
            self.chunk_total += len(reply)
            self.chunk_prefix_hits += agree(max_reuse_tokens=reused)
            self.chunk_nll.append(nll(engine.score(ids, self.held, **path), self.held)
                                  - nll(engine.score(ids, self.held, use_cache=False),
                                        self.held))
        self.packed_hits += agree(max_reuse_tokens=reused, residual_tokens=0, sink_tokens=0)
        self.hits += hits
        self.total += len(reply)
        return hits / len(reply)

    def figures(self) -> dict[str, Any]:
        """The run's quality figures (see :mod:`contextkit.bench.ttft`)."""
        chunk = self.chunk_total or None
        return {
            "top1_agreement_tq4": self.hits / max(1, self.total),
            "top1_agreement_tq4_packed_only": self.packed_hits / max(1, self.total),
            "chunk_turns": len(self.chunk_nll),
            "top1_agreement_chunk_turns": self.chunk_hits / chunk if chunk else None,
            "top1_agreement_chunk_turns_prefix_only": (self.chunk_prefix_hits / chunk
                                                       if chunk else None),
            # perplexity of the held-out text after each chunk turn's prompt, the path
            # the turn took over a full prefill (geometric mean over those turns)
            "ppl_ratio_chunk_turns": (math.exp(statistics.fmean(self.chunk_nll))
                                      if self.chunk_nll else None),
        }
