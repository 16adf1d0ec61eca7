"""The figure formulas of ``contextkit bench ttft`` on small synthetic turns (no model)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from contextkit.bench._ttft_quality import gate_verdict, wilson_interval
from contextkit.bench._ttft_report import memory_change_ceiling, speedup_totals


def turn(baseline: float, contextkit: float, ceiling: float | None = None) -> dict[str, Any]:
    record: dict[str, Any] = {"ttft_ms_baseline": baseline, "ttft_ms_contextkit": contextkit}
    if ceiling is not None:
        record["ttft_ms_chunk_ceiling"] = ceiling
    return record


def test_speedup_total_includes_turn_1_and_excl_leaves_it_out() -> None:
    # turn 1 caches nothing and contextkit is slower there (110 ms against 100 ms)
    records = [turn(100, 110), turn(400, 100), turn(600, 100)]
    totals = speedup_totals(records)
    assert totals["speedup_total"] == pytest.approx(1100 / 310)
    assert totals["speedup_total_excl_turn1"] == pytest.approx(1000 / 200)
    total = totals["speedup_total"]
    assert total is not None and total < 1000 / 200  # turn 1 pulls the total down


def test_speedup_total_of_one_turn_has_no_excl_figure() -> None:
    totals = speedup_totals([turn(100, 50)])
    assert totals == {"speedup_total": 2.0, "speedup_total_excl_turn1": None}


def test_memory_change_ceiling_is_a_ratio_of_sums_over_the_same_turns() -> None:
    rows = [turn(1000, 400, 200), turn(900, 300, 150), turn(800, 500)]  # last: no ceiling
    figures = memory_change_ceiling(rows)
    assert figures["speedup_memory_change_ceiling_total"] == pytest.approx(1900 / 350)
    assert figures["speedup_memory_change_total"] == pytest.approx(1900 / 700)
    assert figures["ceiling_fraction_memory_change"] == pytest.approx(350 / 700)
    assert figures["speedup_memory_change_ceiling_p50"] == pytest.approx((5.0 + 6.0) / 2)
    assert figures["ceiling_slower_turns"] == 0


def test_a_ceiling_measured_slower_is_capped_so_nothing_exceeds_it() -> None:
    # turn 2's ceiling ran slower than contextkit (noise: it computes a subset)
    rows = [turn(1000, 400, 200), turn(900, 300, 450)]
    figures = memory_change_ceiling(rows)
    assert figures["ceiling_slower_turns"] == 1
    assert figures["speedup_memory_change_ceiling_total"] == pytest.approx(1900 / 500)
    assert figures["ceiling_fraction_memory_change"] == pytest.approx(500 / 700)
    assert figures["ceiling_fraction_memory_change"] <= 1.0
    assert (figures["speedup_memory_change_ceiling_total"]
            >= figures["speedup_memory_change_total"])
    assert figures["speedup_memory_change_ceiling_p50"] == pytest.approx((5.0 + 3.0) / 2)


def test_memory_change_ceiling_without_ceiling_runs_is_empty() -> None:
    figures = memory_change_ceiling([turn(1000, 400)])
    assert figures["ceiling_fraction_memory_change"] is None
    assert figures["speedup_memory_change_ceiling_total"] is None


@pytest.mark.parametrize(("hits", "total", "lo", "hi"), [
    (591, 608, 0.9557, 0.9825),  # the chunk turns' gate "met by one token"
    (0, 10, 0.0, 0.2775),
    (10, 10, 0.7225, 1.0),
    (5, 10, 0.2366, 0.7634),
], ids=["591-of-608", "none", "all", "half"])
def test_wilson_interval_matches_the_closed_form(hits: int, total: int, lo: float,
                                                 hi: float) -> None:
    low, high = wilson_interval(hits, total)
    assert low == pytest.approx(lo, abs=1e-4) and high == pytest.approx(hi, abs=1e-4)
    assert low <= hits / total <= high


def test_wilson_interval_narrows_with_more_positions() -> None:
    small, large = wilson_interval(97, 100), wilson_interval(970, 1000)
    assert large[1] - large[0] < small[1] - small[0]
    # the centre is pulled towards 1/2: (0.97 + z^2/200) / (1 + z^2/100)
    assert math.isclose(sum(small) / 2, 0.9526, abs_tol=1e-3)


@pytest.mark.parametrize(("hits", "total"), [(1, 0), (-1, 5), (6, 5)])
def test_wilson_interval_rejects_impossible_counts(hits: int, total: int) -> None:
    with pytest.raises(ValueError, match="hits <= total"):
        wilson_interval(hits, total)


def test_gate_above_the_line_but_lower_end_below_is_not_met() -> None:
    verdict = gate_verdict(591, 608, 0.97)
    assert verdict.value > 0.97 and not verdict.met
    assert verdict.note() == "0.972 [0.956, 0.982] gate 0.97: not met (lower end below)"
    assert verdict.as_dict()["met"] is False and verdict.as_dict()["positions"] == 608


def test_gate_met_only_when_the_lower_end_passes() -> None:
    verdict = gate_verdict(2990, 3000, 0.99)
    assert verdict.lo >= 0.99 and verdict.met
    assert verdict.note().endswith("gate 0.99: met")


def test_gate_below_the_line_is_not_met() -> None:
    verdict = gate_verdict(580, 608, 0.97)
    assert not verdict.met and verdict.note().endswith("gate 0.97: not met")


class ScoringEngine:
    """An engine's ``score`` interface: teacher-forced logits whose argmax is the
    target except at the positions listed in ``misses``; counts its calls."""

    VOCAB = 8

    def __init__(self, misses: set[int]) -> None:
        self.misses = misses
        self.calls: list[dict[str, Any]] = []

    def score(self, prompt_ids: Any, target_ids: Any, **path: Any) -> Any:
        import torch

        self.calls.append(path)
        logits = torch.zeros(len(target_ids), self.VOCAB)
        for i, token in enumerate(target_ids):
            wrong = path.get("use_cache", True) and i in self.misses
            logits[i, (token + 1) % self.VOCAB if wrong else token] = 5.0
        return logits


class Generation:
    """The fields of a ``GenerationResult`` that ``ReplyQuality`` reads."""

    def __init__(self, chunks: bool) -> None:
        self.reused_tokens = 4
        self.reused_chunks = {"memories": 1} if chunks else {}
        self.reused_chunk_starts = [6] if chunks else None
        self.reused_chunk_edits: list[int] = []


def test_reply_quality_scores_the_ceiling_on_a_separate_prefill_only_engine() -> None:
    from contextkit.bench._ttft_quality import ReplyQuality

    chunked, fresh = ScoringEngine(misses={0, 1}), ScoringEngine(misses={0})
    scores = ReplyQuality(chunked, held=[1, 2, 3], prefill_only=fresh)
    reply = [1, 2, 3, 4, 5]
    scores.turn([0] * 10, None, Generation(chunks=False), reply)
    scores.turn([0] * 12, None, Generation(chunks=True), reply)
    figures = scores.figures()
    # the fresh engine saw every turn's reply, and never a chunk path
    assert all("chunk_starts" not in call for call in fresh.calls)
    assert sum(len(call) == 1 for call in fresh.calls) == 3  # 2 replies + held-out text
    assert figures["top1_agreement_chunk_turns"] == 3 / 5
    assert figures["top1_agreement_chunk_turns_tq4_prefill_only"] == 4 / 5
    assert figures["top1_agreement_tq4_prefill_only"] == 8 / 10
    assert figures["chunk_turns"] == 1 and figures["chunk_turn_positions"] == 5
    assert figures["forced_positions"] == 10
    lo, hi = figures["top1_agreement_tq4_ci95"]
    assert lo < 6 / 10 < hi
    gate = figures["gates"]["top1_agreement_chunk_turns"]
    assert gate["met"] is False and gate["positions"] == 5 and gate["gate"] == 0.97


def test_reply_quality_without_a_prefill_only_engine_leaves_the_ceiling_out() -> None:
    from contextkit.bench._ttft_quality import ReplyQuality

    scores = ReplyQuality(ScoringEngine(misses=set()), held=[1, 2])
    scores.turn([0] * 10, None, Generation(chunks=True), [1, 2, 3])
    figures = scores.figures()
    assert figures["top1_agreement_chunk_turns_tq4_prefill_only"] is None
    assert figures["ppl_ratio_chunk_turns_tq4_prefill_only"] is None
    assert figures["top1_agreement_chunk_turns"] == 1.0
