"""bench tool-pauses' figures from raw rows (no vLLM needed)."""

from __future__ import annotations

import argparse

from contextkit.bench._agents_report import SAME_TOKENS
from contextkit.bench.tool_pauses import result_of, resume_figures


def _rows(cached: list[int], ttft: list[float]) -> list[dict[str, object]]:
    agents = ["a", "b", "a", "b", "a"]
    prompts = [1000, 800, 1200, 900, 1400]
    return [{"agent": a, "prompt_tokens": p, "cached_tokens": c, "ttft_ms": t,
             "agent_turn": i // 2, "tool_result": True} for i, (a, p, c, t) in
            enumerate(zip(agents, prompts, cached, ttft, strict=True))]


def test_a_resume_reuses_at_most_the_agents_previous_prompt() -> None:
    got = resume_figures(_rows([0, 0, 1000, 400, 1300], [900, 800, 200, 500, 100]))
    assert got["resume_steps"] == [2, 3, 4]
    # a's 1000 of 1000, b's 400 of 800, a's 1200 of 1200 (1300 cached, at most 1200)
    assert got["resumed_hit_fraction"] == round((1000 + 400 + 1200) / (1000 + 800 + 1200), 4)
    assert got["resume_ttft_p50"] == 200 and got["resume_ttft_sum"] == 800
    assert got["resume_computed_tokens"] == 200 + 500 + 100


def test_only_tool_rounds_are_resumes() -> None:
    rows = _rows([0, 0, 1000, 400, 1300], [900, 800, 200, 500, 100])
    rows[3]["tool_result"] = False  # b's second step: a new user turn, not a resume
    got = resume_figures(rows)
    assert got["resume_steps"] == [2, 4]
    assert got["resumed_hit_fraction"] == round((1000 + 1200) / (1000 + 1200), 4)


def test_speedups_over_the_resume_turns_and_same_tokens_is_noise() -> None:
    hints = _rows([0, 0, 1000, 700, 1300], [900, 800, 100, 100, 100])
    raw = {"configs": {
        "ceiling": {"rows": hints, "metrics": {}},
        "apc": {"rows": _rows([0, 0, 500, 300, 600], [900, 800, 300, 300, 300]),
                "metrics": {}},
        "connector": {"rows": _rows([0, 0, 800, 400, 900], [900, 800, 150, 150, 150]),
                      "metrics": {"vllm:contextkit_pause_kept_blocks_total": 0.0}},
        "connector_hints": {"rows": hints, "metrics": {
            "vllm:contextkit_pause_kept_blocks_total": 40.0,
            "vllm:contextkit_hint_other_pins_lost_total": 0.0}}},
        "workload": {"num_agents": 2, "num_steps": 5}, "interleaved": True}
    args = argparse.Namespace(model=None)
    result = result_of(args, raw)
    assert result["speedup_hints_vs_nohints_p50"] == 1.5
    assert result["speedup_vs_apc_p50"] == 3.0
    assert result["ceiling_fraction"] == SAME_TOKENS  # the same tokens: noise, no ratio
    assert result["counters"]["connector_hints"]["pause_kept_blocks"] == 40.0
    assert result["other_tenant_pins_lost_to_hints"] == 0.0
    assert result["resumed_hit_fraction_hints"] == result["resumed_hit_fraction"]["ceiling"]
