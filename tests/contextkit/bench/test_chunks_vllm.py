"""bench chunks-vllm: the figures from the driver's raw rows (no vLLM needed)."""

from __future__ import annotations

import argparse
import math

from contextkit.bench.chunks_vllm import computed_tokens, probed_quality, result_of


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
        },
        "probes": [{"step": 1, "forced": [1, 2],
                    "tops": {"full": [_top(1), _top(2)], "connector": [_top(1), _top(2)],
                             "connector_chunks": [_top(1), _top(5)]}}],
    }
    result = result_of(argparse.Namespace(model=None), raw)
    assert result["chunk_turns"] == 2 and result["chunk_turn_steps"] == [1, 2]
    assert result["speedup_chunks_vs_prefix_p50"] == 2.0  # median(800, 600) / median(400, 300)
    assert result["speedup_vs_lmcache_p50"] == round(900 / 350, 3)
    # chunk reuse computed what vLLM computed (1000 - 832) and what the connector did (100)
    assert computed_tokens(raw["configs"]["connector_chunks"]["rows"][1]) == 268
    assert result["tokens_computed_vs_prefix"] == round(2 * 268 / (2 * 968), 3)
    assert result["chunk_reused_tokens"] == 1400
    assert result["teacher_forced_agreement"] == 0.5  # the second forced token differs
    assert result["quality_prefix_only"]["teacher_forced_agreement"] == 1.0
    assert probed_quality(raw["probes"], "apc") is None
