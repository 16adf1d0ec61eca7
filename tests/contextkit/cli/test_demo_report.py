"""What the demo says about its first turn and its multi-agent run (fast: no model)."""

from __future__ import annotations

from typing import Any

from contextkit.cli.demo import _agents_text, _first_turn_line, agents_figure


def _turn(reused: int) -> dict[str, Any]:
    return {"prompt_tokens": 6_200, "reused_tokens": reused, "computed_tokens": 6_200 - reused,
            "ttft_ms_baseline": 24_290.0, "ttft_ms_contextkit": 4_630.0 if reused else 33_000.0}


def test_the_first_turn_says_why_it_is_slower_cold_and_what_a_restart_reused() -> None:
    cold = _first_turn_line(_turn(0), recovered_blocks=0)
    assert cold.startswith("Turn 1 (TTFT 33.00 s with contextkit vs 24.29 s for the full prefill)")
    assert "nothing is cached yet" in cold and "quantizes every block" in cold
    warm = _first_turn_line(_turn(6_176), recovered_blocks=194)
    assert "served from the 194 blocks restored from the shadow" in warm
    assert "reusing 6,176 of 6,200 prompt tokens and computing 24" in warm
    assert "may differ from a cold run's" in warm  # the 4-bit KV, said once


def _rows(warmed: list[int]) -> list[dict[str, Any]]:
    return [{"step": i, "agent": f"agent-{i % 3}", "ttft_ms": 1000.0 + i, "device_used": 10,
             "host_used": 5, "prefetch_warmed": w} for i, w in enumerate(warmed)]


def _legend(fig: Any) -> list[str]:
    return [t.get_text() for ax in fig.axes if ax.get_legend()
            for t in ax.get_legend().get_texts()]


def test_the_agents_plot_draws_warms_only_when_they_happen_and_the_reference() -> None:
    none = _legend(agents_figure(_rows([0] * 6), _rows([0] * 6), 40, 20, cpu_only=True))
    assert "blocks prefetched (warmed)" not in none
    assert "LRU reference" in none
    assert "device tier used (%) (CPU only: both tiers are host memory)" in none
    some = _legend(agents_figure(_rows([0, 3, 0, 2, 0, 0]), [], 40, 20, cpu_only=False))
    assert "blocks prefetched (warmed)" in some and "LRU reference" not in some
    assert "device tier used (%)" in some


def _summary(warmed: int, host_rate: float) -> dict[str, Any]:
    return {"agents": 3, "tenants": 2, "steps": 6, "device_agents": 2, "host_agents": 1,
            "tiers": {"device": {"used": 10, "capacity": 40}}, "device": "cpu",
            "ttft_ms_p50": 1200.0, "computed_tokens": 900, "device_hit_rate": 0.8,
            "host_hit_rate": host_rate, "prefetch_warmed_blocks": warmed,
            "prefetch_spilled_blocks": 1, "prefetch_removed_blocks": 0, "prefetches": 6,
            "prefetch_before_generate": True, "ooda_ms_p50": 2.0, "pinned_blocks": 4,
            "pinned_blocks_evicted": 0, "ttft_ms_sum": 9000.0,
            "reference": {"policy": "lru", "ttft_ms_p50": 2400.0, "computed_tokens": 1800,
                          "ttft_ms_sum": 15000.0, "device_hit_rate": 0.4, "host_hit_rate": 0.0},
            "ceiling": {"policy": "semantic, every agent fits", "ttft_ms_sum": 6000.0,
                        "computed_tokens": 600}}


def test_the_agents_summary_compares_with_lru_and_says_nothing_was_warmed() -> None:
    quiet = _agents_text(_summary(0, 0.0), "agents.png")
    assert "0 blocks warmed" not in quiet and "from the host 0%" not in quiet
    assert "no prefetch had to warm a block" in quiet
    assert "LRU reference (recency only, no pins, no prefetch), same steps: TTFT median " \
           "2.40 s, 1,800 prompt tokens computed" in quiet
    assert "both tiers are host memory" in quiet
    assert ("The policy saved 900 prompt tokens against LRU (900 vs 1,800), 75% of the way "
            "from LRU to the ceiling of a cache holding every agent (600); TTFT summed over "
            "the steps 9.0 s vs LRU's 15.0 s (ceiling 6.0 s).") in quiet
    busy = _agents_text(_summary(5, 0.1), "agents.png")
    assert "prefetches warmed 5 blocks" in busy and "brought up from the host 10%" in busy


def test_the_agents_summary_calls_equal_tokens_noise() -> None:
    same = _summary(0, 0.0)
    same["computed_tokens"] = same["reference"]["computed_tokens"]
    text = _agents_text(same, "agents.png")
    assert "computed the same 1,800 prompt tokens as LRU: any TTFT difference is" in text
    assert "saved" not in text
