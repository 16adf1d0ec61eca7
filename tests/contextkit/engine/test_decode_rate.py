"""Decode tokens/s beside TTFT: ``GenerationResult.decode_tps`` and the pipeline's report."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from contextkit.engine.engine import Engine, GenerationResult
from contextkit.pipeline.pipeline import CacheAwareContextPipeline


def result(tokens: int, ttft_ms: float, total_ms: float) -> GenerationResult:
    return GenerationResult(text="", token_ids=list(range(tokens)), prompt_tokens=10,
                            reused_tokens=0, computed_tokens=10, ttft_ms=ttft_ms,
                            total_ms=total_ms, blocks_per_tier={}, kv_format="tq4")


def test_decode_tps_counts_tokens_after_the_first_over_the_time_after_it() -> None:
    r = result(5, ttft_ms=100.0, total_ms=300.0)
    assert r.decode_tps == pytest.approx(4 / 0.2)  # tokens 2..5 in the last 200 ms
    assert r.telemetry()["decode_tps"] == pytest.approx(20.0)
    # a one-token reply (or EOS first) has no decode step to time
    assert result(1, ttft_ms=100.0, total_ms=100.5).decode_tps is None
    assert result(1, ttft_ms=100.0, total_ms=100.5).telemetry()["decode_tps"] is None
    # a clock that did not move gives no rate rather than infinity
    assert result(3, ttft_ms=100.0, total_ms=100.0).decode_tps is None


SYSTEM = ("[AXIOMS]\nTell the truth about what you checked.\n[/AXIOMS]\n"
          "[IDENTITY]\nYou are Atlas, the platform team's SRE assistant.\n[/IDENTITY]")


@pytest.mark.slow
def test_engine_and_pipeline_report_the_decode_rate(fresh: Callable[..., Engine]) -> None:
    engine = fresh("tq4", device=64, host=16)
    pipeline = CacheAwareContextPipeline(engine)
    pipeline.wrap(lambda: SYSTEM)()
    out = pipeline.generate("List three causes of p95 latency spikes.", max_new_tokens=6)
    gen = out.generation
    assert len(gen.token_ids) == 6 and gen.total_ms > gen.ttft_ms > 0
    tps = gen.decode_tps
    assert tps is not None and tps > 0
    assert tps == pytest.approx(5 / ((gen.total_ms - gen.ttft_ms) / 1000))
    assert out.report.decode_tps == gen.decode_tps
    assert out.report.to_dict()["decode_tps"] == gen.decode_tps
    # the plain baseline (contiguous float32 K/V) reports its rate the same way
    ids, _, _ = pipeline.assemble("List three causes of p95 latency spikes.")
    base = engine.generate(ids, max_new_tokens=6, use_cache=False)
    assert len(base.token_ids) == 6
    assert base.decode_tps == pytest.approx(
        (len(base.token_ids) - 1) / ((base.total_ms - base.ttft_ms) / 1000))
    # a one-token request leaves the report's rate unset
    one = pipeline.generate("Say yes.", max_new_tokens=1)
    assert one.generation.decode_tps is None and one.report.decode_tps is None
