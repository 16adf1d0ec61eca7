"""``contextkit bench ttft`` end to end (a few turns; ``make test-heavy``)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from contextkit.cli.commands import main

pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def check_decode(result: dict[str, Any], who: str, max_new_tokens: int) -> list[float]:
    """Per-turn decode tokens/s of ``who`` agree with its TTFT, total time and tokens.

    The JSON rounds times to 0.1 ms (so ``total - ttft`` is off by at most 0.1 ms) and
    rates to 4 significant digits (relative 5e-4): the bounds below are exactly that.
    """
    tps, ttft, total, generated = (result[f"{k}_{who}"] for k in
                                   ("decode_tps", "ttft_ms", "total_ms", "generated_tokens"))
    assert len(tps) == len(ttft) == len(total) == len(generated) == result["turns"]
    for rate, first, last, n in zip(tps, ttft, total, generated, strict=True):
        assert 2 <= n <= max_new_tokens and last - first > 0.1 and first > 0
        low = (n - 1) / ((last - first + 0.1) / 1000) * (1 - 5e-4)
        high = (n - 1) / ((last - first - 0.1) / 1000) * (1 + 5e-4)
        assert low <= rate <= high
    return tps


def test_bench_ttft_reports_every_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "ttft", "--turns", "3", "--max-new-tokens", "8", "--json",
                 "--no-reserve", "--out", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["reserve"] is False and result["reservations"] is None
    assert result["background_cpu_s"] == [0.0] * 3 and result["reservation_hit"] == [None] * 3
    for key in ("ttft_ms_baseline", "ttft_ms_contextkit", "ttft_ms_prefix_cache"):
        assert len(result[key]) == 3 and all(v > 0 for v in result[key])
    assert result["turns"] == 3
    assert result["reused_tokens"][0] == 0 and result["reused_tokens"][1] > 4_000
    # What the speedups come from, in tokens (no timed assertion: a busy machine would
    # fail it): later turns compute under half their prompt, and contextkit's order
    # reuses more than prefix caching of the user's own order.
    assert all(2 * c < p for c, p in zip(result["computed_tokens"][1:],
                                         result["prompt_tokens"][1:], strict=True))
    assert sum(result["reused_tokens"][1:]) > sum(result["reused_tokens_prefix_cache"][1:])
    assert result["agreement_native"] == 1.0  # the lossless sibling reuses prefixes only
    # reuse beyond the prefix: turn 2 changes a layer mid-prompt and moves the rest in;
    # the ceiling (every chunk moved, none repaired) never computes more than it
    assert result["chunk_reuse"] is True and result["chunk_reused_tokens"][0] == 0
    # every seeded memory's line was computed before turn 1, in whole blocks
    ingest = result["memory_chunks"]
    assert ingest["lines"] > 20 and ingest["computed_tokens"] % 16 == 0
    assert result["chunk_reused_tokens"][1] > 0 and result["chunk_turns"] >= 1
    assert all(top <= c for top, c in zip(result["computed_tokens_chunk_ceiling"],
                                          result["computed_tokens"], strict=True))
    assert result["top1_agreement_chunk_turns"] > 0.8
    # the same turns' replies on a fresh TQ4 cache only prefills wrote, and through the
    # prefix alone on the chunk path's own cache
    assert result["top1_agreement_chunk_turns_tq4_prefill_only"] > 0.8
    assert result["top1_agreement_chunk_turns_prefix_only_same_cache"] > 0.8
    assert 0.9 < result["ppl_ratio_chunk_turns_tq4_prefill_only"] < 1.2
    lo, hi = result["top1_agreement_chunk_turns_ci95"]
    assert lo <= result["top1_agreement_chunk_turns"] <= hi
    assert result["gates"]["top1_agreement_tq4"]["positions"] == result["forced_positions"]
    assert 0.9 < result["ppl_ratio_chunk_turns"] < 1.2
    # the lossless sibling reused what the TQ4 path reused
    assert result["reused_tokens_native_cached"][1:] == result["reused_tokens"][1:]
    assert (result["flop_ratio_prefix_reuse"][0] == 1.0
            and result["flop_ratio_prefix_reuse_p50"] > 2.0)
    fraction = result["ceiling_fraction_memory_change"]  # capped by construction
    assert fraction is None or 0 < fraction <= 1.0
    assert result["top1_agreement_tq4"] > 0.8
    assert 0.9 < result["ppl_ratio_tq4"] < 1.2
    assert (tmp_path / "ttft.png").stat().st_size > 10_000
    # decode tokens/s beside TTFT, for contextkit (TQ4 cache) and the full-prefill baseline
    ck = check_decode(result, "contextkit", 8)
    base = check_decode(result, "baseline", 8)
    # the medians are of the unrounded rates (each list entry is within 5e-4 of its rate)
    assert result["decode_tps_p50"] == pytest.approx(statistics.median(ck), rel=5e-4)
    assert result["decode_tps_baseline_p50"] == pytest.approx(statistics.median(base), rel=5e-4)
    assert all(v > 0 for v in result["decode_tps_native_cached"])
    assert result["decode_tps_native_cached_p50"] > 0


def test_bench_ttft_think_time_runs_background_work_and_reserves_memories(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tiny run (2 turns, a small prompt): after turn 1 the think window prefills the
    next prompt with the exchange just finished and reserves the best predicted memory
    neighborhood; turn 2's memories do not change, so it expires unused (no leak)."""
    assert main(["bench", "ttft", "--turns", "2", "--scale", "0.3", "--max-new-tokens", "4",
                 "--no-quality", "--json", "--out", str(tmp_path), "--think-s", "600",
                 "--reserve-candidates", "1", "--no-memory-chunks"]) == 0
    on = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert on["think_s"] == 600 and on["reserve"] is True and on["reserve_candidates"] == 1
    assert on["memory_change_turns"] == [] and on["reservation_hit_rate"] is None
    assert on["background_cpu_s"][0] == 0.0 and on["background_cpu_s"][1] > 0
    assert on["background_done"] == [True, True]  # all of it fit the think time
    stats = on["reservations"]
    assert stats["extensions"] == 1 and on["extension_tokens"][1] == stats["extension_tokens"] > 0
    assert stats["made"] == 1 and stats["expired"] == 1 and stats["hits"] == stats["misses"] == 0
    assert stats["reserved_tokens"] > 0 and stats["preempted"] == 0
    assert on["reservation_hit"] == [None, None]
    assert len(on["foreground_wait_ms"]) == 2 and min(on["foreground_wait_ms"]) >= 0
    assert on["reused_tokens"][0] == 0 and on["reused_tokens"][1] > 2_000
    assert on["speedup_total"] > 0 and on["speedup_total_excl_turn1"] > 0
    assert on["speedup_steady_p50"] > 0  # reported; tokens above
    assert on["computed_tokens"][1] < on["prompt_tokens"][1] - 2_000
    assert on["speedup_memory_change_p50"] is None
    assert on["memory_chunks"] is None
    assert on["blocks_per_tier"]["host"] == 0  # the expired reservation's DDR blocks freed
    # without the quality runs the baseline stops at its first token: no decode rate
    ck = check_decode(on, "contextkit", 4)
    assert on["decode_tps_p50"] == pytest.approx(statistics.median(ck), rel=5e-4)
    assert on["generated_tokens_baseline"] == [1, 1] and on["decode_tps_baseline"] == [None] * 2
    assert on["decode_tps_baseline_p50"] is None and "decode_tps_native_cached" not in on
