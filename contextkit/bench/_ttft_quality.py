"""Reply quality of ``bench ttft``'s TQ4 path, turn by turn, against a full prefill.

Each turn's reply from the no-cache baseline (a full float prefill: the reference of
every agreement and perplexity figure here) is teacher-forced through the path the
contextkit request took (:meth:`contextkit.engine.engine.Engine.score` with the same
reused prefix, chunks, edited lines and float overlay); top-1 agreement counts the
positions whose argmax is the baseline's token. On the turns that reused chunks the
same reply also goes through a separate TQ4 engine whose cache only prefills ever
wrote (``prefill_only``): the agreement of the TQ4 format with no chunk ever moved,
the ceiling chunk reuse is read against. It shares no block with the chunk path, so
it cannot share that path's error. Every agreement comes with its Wilson 95%
interval over the forced positions (:func:`wilson_interval`), and a gate is met only
when the interval's lower end passes it (:func:`gate_verdict`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["GATES", "GateVerdict", "ReplyQuality", "gate_verdict", "nll", "perplexity",
           "wilson_interval"]

#: z of a two-sided 95% normal interval.
Z95 = 1.959963984540054


def wilson_interval(hits: int, total: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval ``(lo, hi)`` of a proportion ``hits / total`` (95% by
    default): unlike the normal approximation it stays inside [0, 1] and is not empty
    at 0 or ``total`` hits.

    Raises:
        ValueError: ``total`` < 1 or ``hits`` outside ``0..total``.
    """
    if total < 1 or not 0 <= hits <= total:
        raise ValueError(f"need 0 <= hits <= total and total >= 1, got {hits} of {total}")
    p = hits / total
    z2 = z * z
    centre = (p + z2 / (2 * total)) / (1 + z2 / total)
    half = z * math.sqrt(p * (1 - p) / total + z2 / (4 * total * total)) / (1 + z2 / total)
    # exact ends at 0 and ``total`` hits (the closed form reaches them up to rounding)
    return (0.0 if hits == 0 else max(0.0, centre - half),
            1.0 if hits == total else min(1.0, centre + half))


@dataclass(frozen=True)
class GateVerdict:
    """A proportion against a gate: met only if its interval's lower end passes."""

    value: float
    lo: float
    hi: float
    gate: float
    positions: int

    @property
    def met(self) -> bool:
        return self.lo >= self.gate

    def note(self) -> str:
        """E.g. ``0.972 [0.957, 0.982] gate 0.97: not met (lower end below)``."""
        if self.met:
            verdict = "met"
        elif self.value >= self.gate:
            verdict = "not met (lower end below)"
        else:
            verdict = "not met"
        return (f"{self.value:.3f} [{self.lo:.3f}, {self.hi:.3f}] gate {self.gate:g}: "
                f"{verdict}")

    def as_dict(self) -> dict[str, Any]:
        return {"value": self.value, "ci95": [round(self.lo, 4), round(self.hi, 4)],
                "gate": self.gate, "positions": self.positions, "met": self.met,
                "note": self.note()}


def gate_verdict(hits: int, total: int, gate: float) -> GateVerdict:
    """``hits`` of ``total`` forced positions agreeing, against a minimum ``gate``."""
    lo, hi = wilson_interval(hits, total)
    return GateVerdict(hits / total, lo, hi, gate, total)


def nll(logits: torch.Tensor, target: Sequence[int]) -> float:
    """Mean negative log-likelihood of ``target`` under teacher-forced ``logits``
    ``[len(target), V]``."""
    return float(torch.nn.functional.cross_entropy(logits.float(),
                                                   torch.tensor(list(target))))


def perplexity(logits: torch.Tensor, target: Sequence[int]) -> float:
    """Perplexity of ``target`` under teacher-forced ``logits``."""
    return math.exp(nll(logits, target))


#: The top-1 agreement gates of ``bench ttft`` (README's goals).
GATES = {"top1_agreement_tq4": 0.97, "top1_agreement_chunk_turns": 0.97}


class ReplyQuality:
    """Agreement and perplexity figures accumulated over the replay's turns.

    Args:
        engine: the TQ4 engine the turns ran on.
        held: token ids of a held-out continuation (perplexity after each chunk
            turn's prompt).
        prefill_only: a TQ4 engine of the same format whose cache only this object
            fills, by prefilling each turn's full prompt (no chunk reuse): the
            independent TQ4 ceiling; ``None`` leaves those figures out.
    """

    def __init__(self, engine: Any, held: Sequence[int], prefill_only: Any = None) -> None:
        self.engine = engine
        self.held = list(held)
        self.prefill_only = prefill_only
        self.hits = self.total = self.packed_hits = self.prefill_hits = 0
        self.chunk_hits = self.chunk_total = self.chunk_same_cache_hits = 0
        self.chunk_prefill_hits = 0
        self.chunk_nll: list[float] = []
        self.chunk_prefill_nll: list[float] = []

    def turn(self, ids: Sequence[int], spans: Any, generation: Any,
             reply: Sequence[int]) -> float:
        """Score one turn (``generation``: contextkit's
        :class:`~contextkit.engine.types.GenerationResult`, ``reply``: the baseline's
        token ids); its top-1 agreement."""
        engine, fresh = self.engine, self.prefill_only
        target = torch.tensor(list(reply))
        reused = generation.reused_tokens

        def agree(on: Any = engine, **path: Any) -> int:
            return int((on.score(ids, reply, **path).argmax(dim=-1) == target).sum())

        path = {"max_reuse_tokens": reused, "spans": spans,
                "chunk_starts": generation.reused_chunk_starts,
                "chunk_edits": generation.reused_chunk_edits}
        hits = agree(**path)
        # every turn, so that the fresh cache holds the prefixes its prefills wrote
        prefill_hits = agree(fresh, max_reuse_tokens=reused) if fresh is not None else 0
        if generation.reused_chunks:  # the turns whose chunks were reused
            self.chunk_hits += hits
            self.chunk_total += len(reply)
            self.chunk_same_cache_hits += agree(max_reuse_tokens=reused)
            self.chunk_prefill_hits += prefill_hits
            full = nll(engine.score(ids, self.held, use_cache=False), self.held)
            self.chunk_nll.append(nll(engine.score(ids, self.held, **path), self.held) - full)
            if fresh is not None:
                self.chunk_prefill_nll.append(
                    nll(fresh.score(ids, self.held, max_reuse_tokens=reused), self.held)
                    - full)
        self.packed_hits += agree(max_reuse_tokens=reused, residual_tokens=0, sink_tokens=0)
        self.prefill_hits += prefill_hits
        self.hits += hits
        self.total += len(reply)
        return hits / len(reply)

    def figures(self) -> dict[str, Any]:
        """The run's quality figures (see :mod:`contextkit.bench.ttft`)."""
        chunk, fresh = self.chunk_total or None, self.prefill_only is not None

        def share(hits: int, total: int | None, present: bool = True) -> float | None:
            return hits / total if total and present else None

        def ci(hits: int, total: int | None, present: bool = True) -> list[float] | None:
            if not total or not present:
                return None
            return [round(v, 4) for v in wilson_interval(hits, total)]

        def ppl(nlls: list[float]) -> float | None:
            # geometric mean over the chunk turns of the held-out perplexity ratio
            return math.exp(statistics.fmean(nlls)) if nlls else None

        total = self.total or None
        gates = {}
        for name, hits, n in (("top1_agreement_tq4", self.hits, total),
                              ("top1_agreement_chunk_turns", self.chunk_hits, chunk)):
            if n:
                gates[name] = gate_verdict(hits, n, GATES[name]).as_dict()
        return {
            "top1_agreement_tq4": share(self.hits, total),
            "top1_agreement_tq4_ci95": ci(self.hits, total),
            "forced_positions": self.total,
            "top1_agreement_tq4_packed_only": share(self.packed_hits, total),
            "top1_agreement_tq4_prefill_only": share(self.prefill_hits, total, fresh),
            "top1_agreement_tq4_prefill_only_ci95": ci(self.prefill_hits, total, fresh),
            "chunk_turns": len(self.chunk_nll),
            "chunk_turn_positions": self.chunk_total,
            "top1_agreement_chunk_turns": share(self.chunk_hits, chunk),
            "top1_agreement_chunk_turns_ci95": ci(self.chunk_hits, chunk),
            # the independent ceiling: a TQ4 cache that no chunk path wrote
            "top1_agreement_chunk_turns_tq4_prefill_only": share(self.chunk_prefill_hits,
                                                                 chunk, fresh),
            "top1_agreement_chunk_turns_tq4_prefill_only_ci95": ci(self.chunk_prefill_hits,
                                                                   chunk, fresh),
            # the same turns' prefix alone on the chunk path's own cache: its prefix
            # blocks may hold K/V that earlier chunk turns moved in, so not a ceiling
            "top1_agreement_chunk_turns_prefix_only_same_cache": share(
                self.chunk_same_cache_hits, chunk),
            "ppl_ratio_chunk_turns": ppl(self.chunk_nll),
            "ppl_ratio_chunk_turns_tq4_prefill_only": ppl(self.chunk_prefill_nll),
            "gates": gates,
        }
