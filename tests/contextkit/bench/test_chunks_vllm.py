"""bench chunks-vllm: the figures from the driver's raw rows (no vLLM needed)."""

from __future__ import annotations

import argparse
import math

from contextkit.bench.chunks_vllm import computed_tokens, probed_quality, result_of
from integrations.vllm.bench.oracle import KnownSpans


def _top(best: int) -> dict[str, float]:
    logits = {t: 2.0 if t == best else 0.0 for t in range(20)}
    norm = math.log(sum(math.exp(v) for v in logits.values()))
    return {str(t): v - norm for t, v in logits.items()}


def _rows(ttft: list[float], cached: int, reports: list[dict | None] | None = None
          ) -> list[dict]:
    return [{"step": i, "ttft_ms": t, "prompt_tokens": 1000, "cached_tokens": cached,
             "report": (reports or [None] * len(ttft))[i]} for i, t in enumerate(ttft)]


def test_figures_are_over_the_chunk_turns_and_count_the_connectors_own_tokens() -> None:
    chunk = {"reuse": "chunk", "chunk_reused_tokens": 700, "repaired_tokens": 100}
    raw = {
        "configs": {
            "full": {"rows": _rows([1000, 1000, 1000], 0)},
            "connector": {"rows": _rows([900, 800, 600], 32)},
            "connector_chunks": {"rows": _rows([900, 400, 300], 832,
                                               [{"reuse": "prefix"}, chunk, chunk])},
            "lmcache": {"rows": _rows([900, 900, 900], 32)},
            "oracle": {"rows": _rows([900, 300, 200], 900)},
        },
        "probes": [{"step": 1, "forced": [1, 2],
                    "tops": {"full": [_top(1), _top(2)], "connector": [_top(1), _top(2)],
                             "connector_chunks": [_top(1), _top(5)]}}],
    }
    result = result_of(argparse.Namespace(model=None), raw)
    assert result["chunk_turns"] == 2 and result["chunk_turn_steps"] == [1, 2]
    assert result["speedup_chunks_vs_prefix_p50"] == 2.0  # median(800, 600) / median(400, 300)
    assert result["speedup_vs_lmcache_p50"] == round(900 / 350, 3)
    # the oracle (vLLM computing only the new tokens) bounds chunk reuse in the same run
    assert result["bound_chunks_vs_prefix_p50"] == round(700 / 250, 3)
    assert result["ceiling_fraction"] == round(250 / 350, 3)
    # chunk reuse computed what vLLM computed (1000 - 832) and what the connector did (100)
    assert computed_tokens(raw["configs"]["connector_chunks"]["rows"][1]) == 268
    assert result["tokens_computed_vs_prefix"] == round(2 * 268 / (2 * 968), 3)
    assert result["chunk_reused_tokens"] == 1400
    assert result["teacher_forced_agreement"] == 0.5  # the second forced token differs
    assert result["quality_prefix_only"]["teacher_forced_agreement"] == 1.0
    assert probed_quality(raw["probes"], "apc") is None


def test_the_oracle_holds_the_spans_a_tenant_sent_before_and_computes_the_rest() -> None:
    known = KnownSpans()
    # system, gap, doc A, doc B, gap, question
    first = [1, 2, 3, 9, 10, 11, 20, 21, 9, 30, 31]
    spans = [(0, 3, "rules"), (4, 6, "documents"), (6, 8, "documents"), (9, 11, "user_turn")]
    held, new = known.split("acme", first, spans)
    assert held == [] and new == first  # nothing known yet
    known.add("acme", first, spans)
    # doc C replaces A, B moves first, a new question: B and the system are held
    second = [1, 2, 3, 9, 20, 21, 40, 41, 9, 50, 51]
    spans2 = [(0, 3, "rules"), (4, 6, "documents"), (6, 8, "documents"), (9, 11, "user_turn")]
    held, new = known.split("acme", second, spans2)
    assert held == [1, 2, 3, 9, 20, 21] and new == [40, 41, 9, 50, 51]
    assert sorted(held + new) == sorted(second)
    # the same tokens under another label, or for another tenant, are not held (nor
    # the gap after them)
    assert known.split("acme", second, [(0, 3, "memories"), *spans2[1:]])[0] == [20, 21]
    assert known.split("globex", second, spans2) == ([], second)
