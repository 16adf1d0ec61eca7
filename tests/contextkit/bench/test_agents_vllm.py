"""bench agents-vllm: the figures from raw rows (no vLLM needed)."""

from __future__ import annotations

import argparse
import math

import pytest

from contextkit.bench._agents_report import SAME_TOKENS
from contextkit.bench.agents_vllm import quality, result_of, speedups


def test_speedups_are_ratios_of_warm_step_medians_and_none_where_a_config_did_not_run(
        ) -> None:
    warm = [False, True, True, True]
    ttft = {"connector": [900.0, 100.0, 200.0, 300.0], "apc": [1000.0, 600.0, 600.0, 600.0],
            "ordering": [1000.0, 300.0, 400.0, 500.0], "ceiling": [900.0, 100.0, 150.0, 100.0]}
    got = speedups(ttft, warm)
    assert got["speedup_vs_apc_p50"] == 3.0  # 600 / 200: the cold first step is left out
    assert got["speedup_vs_ordering_p50"] == 2.0
    assert got["ceiling_fraction"] == 0.5
    assert got["speedup_vs_lmcache_p50"] is None and got["speedup_vs_lru_p50"] is None
    # the bound: what a connector as fast as the ceiling (100 ms) would reach
    assert got["bound_vs_apc_p50"] == 6.0 and got["bound_vs_ordering_p50"] == 4.0
    assert got["bound_vs_lru_p50"] is None


def _top(best: int, spread: float = 1.0) -> dict[str, float]:
    logits = {t: (2.0 if t == best else 0.0) * spread for t in range(20)}
    norm = math.log(sum(math.exp(v) for v in logits.values()))
    return {str(t): v - norm for t, v in logits.items()}


def test_quality_of_an_identical_probe_is_perfect_and_a_changed_argmax_counts() -> None:
    reference = [[_top(1), _top(2), _top(3)]]
    forced = [[1, 2, 3]]
    same = quality(reference, reference, forced)
    assert same["teacher_forced_agreement"] == 1.0 and same["ppl_ratio"] == 1.0
    assert same["mean_kl"] == 0.0
    changed = quality(reference, [[_top(1), _top(5), _top(3)]], forced)
    assert changed["teacher_forced_agreement"] == pytest.approx(2 / 3, abs=1e-4)
    assert changed["ppl_ratio"] > 1.0 and changed["mean_kl"] > 0.0


def _rows(ttft: list[float]) -> list[dict[str, object]]:
    return [{"step": i, "agent": f"a{i % 2}", "ttft_ms": t, "prompt_tokens": 2000,
             "cached_tokens": 1000 if i else 0, "agent_turn": i // 2, "kind": "r"}
            for i, t in enumerate(ttft)]


def test_result_reports_hit_tokens_per_tier_quality_and_what_did_not_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    probe = {"tops": [[_top(1), _top(2)]], "forced": [[1, 2]]}
    raw = {
        "configs": {
            "ceiling": {"rows": _rows([900, 800, 100, 100]), "probe": probe, "seconds": 1.0,
                        "loadavg_1min": 1.0, "metrics": {}},
            "apc": {"rows": _rows([900, 800, 700, 700]), "seconds": 1.0, "loadavg_1min": 1.0,
                    "metrics": {}},
            "connector": {"rows": _rows([900, 800, 200, 200]), "seconds": 1.0,
                          "loadavg_1min": 1.0, "probe": probe,
                          "metrics": {"vllm:contextkit_hit_tokens_total": 640.0},
                          # the server's 3 warm-up requests come first
                          "warmup_requests": 3,
                          "connector_stats": [{"external_hit_tokens": 999}] * 3
                          + [{"external_hit_tokens": 0}] * 2
                          + [{"external_hit_tokens": 320}] * 2
                          + [{"external_hit_tokens": 64}]},
        },
        "errors": {"lmcache": "SystemExit: no lmcache"},
        "sizes": {"kv_blocks_pressure": 140, "kv_blocks_ceiling": 700,
                  "prompt_tokens_mean": 2200, "budget_bytes": 10 ** 8, "host_blocks": 480},
        "workload": {"num_agents": 2, "num_steps": 4},
    }
    for row in raw["configs"]["apc"]["rows"][1:]:
        row["cached_tokens"] = 500  # APC reuses less: its speedup is a timing, not noise
    args = argparse.Namespace(kv_agents=2.0, budget_agents=3.0, model=None, plot=None)
    result = result_of(args, raw)
    assert result["speedup_vs_apc_p50"] == 3.5  # warm steps 2-3: 700 / 200
    assert result["hit_tokens"]["connector"] == {"vllm": 3000 - 640, "ddr": 640,
                                                 "shadow": 0, "chunk": 0, "computed": 5000}
    assert result["teacher_forced_agreement"] == 1.0
    assert result["quality"]["connector"]["probe_connector_hit_tokens"] == 64
    assert result["not_run"] == {"lmcache": "SystemExit: no lmcache"}
    # bounds in prompt tokens computed: apc 8000 - 1500, connector and ceiling 8000 - 3000
    assert set(result["bounds"]) == {"apc", "connector"}
    assert result["bounds"]["connector"]["ttft_vs_ceiling"] == SAME_TOKENS
    assert result["bounds"]["apc"]["computed_tokens"] == 6500
    assert not any(b["beats_ceiling"] for b in result["bounds"].values())


def test_the_warm_up_requests_records_are_not_counted_as_steps() -> None:
    """The connector records the 3 warm-up requests first; reading the first N records
    as the N steps would count the warm-up's hits and drop the last steps'."""
    from contextkit.bench.agents_vllm import result_of

    rows = _rows([900.0, 800.0, 200.0, 200.0])
    stats = ([{"external_hit_tokens": 1000}] * 3 + [{"external_hit_tokens": 0}] * 2
             + [{"external_hit_tokens": 320}] * 2)
    run = {"rows": rows, "seconds": 1.0, "loadavg_1min": 1.0, "metrics": {},
           "connector_stats": stats, "warmup_requests": 3}
    raw = {"configs": {"connector": run}, "sizes": {
        "kv_blocks_pressure": 1, "kv_blocks_ceiling": 2, "prompt_tokens_mean": 1,
        "budget_bytes": 1, "host_blocks": 1}, "workload": {"num_agents": 2, "num_steps": 4}}
    args = argparse.Namespace(kv_agents=2.0, budget_agents=3.0, model=None, plot=None)
    assert result_of(args, raw)["hit_tokens"]["connector"]["ddr"] == 640


def test_the_ceiling_is_its_own_run_and_a_second_run_only_measures_drift() -> None:
    warm = [False, True, True]
    ttft = {"connector": [1.0, 200.0, 200.0], "ceiling": [1.0, 100.0, 100.0],
            "ceiling_last": [1.0, 50.0, 50.0], "apc": [1.0, 400.0, 400.0]}
    got = speedups(ttft, warm)
    assert got["ceiling_fraction"] == 0.5  # not 0.25 from the faster second run
    assert got["ceiling_drift"] == 0.5
    assert got["bound_vs_apc_p50"] == 4.0


def test_configurations_computing_the_same_tokens_are_noise_not_a_speedup() -> None:
    warm = [False, True, True]
    ttft = {"connector": [1.0, 200.0, 200.0], "connector_lru": [1.0, 300.0, 300.0],
            "ceiling": [1.0, 250.0, 250.0], "apc": [1.0, 400.0, 400.0]}
    computed = {"connector": 1000, "connector_lru": 1000, "ceiling": 1000, "apc": 3000}
    got = speedups(ttft, warm, computed)
    assert got["speedup_vs_lru_p50"] == SAME_TOKENS
    assert got["speedup_vs_lru_total"] == SAME_TOKENS
    assert got["ceiling_fraction"] == SAME_TOKENS  # 'beating' the ceiling by 25% is drift
    assert got["speedup_vs_apc_p50"] == 2.0


def test_connector_tq4_is_the_default_policy_before_k5v4() -> None:
    """connector_tq4 measures what k5v4 changed: the same rules over tq4 within 0.33."""
    import dataclasses

    from integrations.vllm.bench.agents_bench import SETUPS
    from integrations.vllm.config import ConnectorConfig
    from integrations.vllm.precision import DEFAULT_POLICY

    setup = SETUPS["connector_tq4"]
    policy = ConnectorConfig.from_extra_config(dict(setup.connector)).policy
    assert policy == dataclasses.replace(DEFAULT_POLICY, default="tq4", max_vs_fp16=0.33)
    assert SETUPS["connector"].connector == {"eviction": "semantic"}  # the default policy
    assert DEFAULT_POLICY.default == "k5v4"
    got = speedups({"connector": [1.0, 100.0], "connector_tq4": [1.0, 150.0],
                    "ceiling": [1.0, 100.0]}, [False, True])
    assert got["speedup_vs_tq4_p50"] == 1.5


def test_the_eviction_bound_is_lru_over_the_connector_that_holds_everything() -> None:
    """speedup_vs_lru_p50's own ceiling: connector_all pays the same loads as the
    connector but never misses for want of room."""
    warm = [False, True, True, True]
    ttft = {"connector": [900.0, 300.0, 400.0, 500.0],
            "connector_lru": [900.0, 400.0, 480.0, 600.0],
            "connector_all": [900.0, 300.0, 400.0, 400.0], "ceiling": [900.0, 100.0, 100.0, 100.0]}
    got = speedups(ttft, warm)
    assert got["speedup_vs_lru_p50"] == 1.2  # 480 / 400
    assert got["eviction_bound_vs_lru_p50"] == 1.2  # 480 / 400: the policy is at its ceiling
    assert got["eviction_ceiling_fraction"] == 1.0
    assert got["bound_vs_lru_p50"] == 4.8  # the KV space that holds everyone loads nothing
    # over the warm steps' total: 1480 / 1200 and 1480 / 1100
    assert got["speedup_vs_lru_total"] == round(1480 / 1200, 3)
    assert got["eviction_bound_vs_lru_total"] == round(1480 / 1100, 3)
    del ttft["connector_all"]
    assert speedups(ttft, warm)["eviction_bound_vs_lru_p50"] is None
    assert speedups(ttft, warm)["eviction_bound_vs_lru_total"] is None


def test_connector_costs_per_step_and_block_from_the_counters() -> None:
    from contextkit.bench.agents_vllm import connector_costs

    metrics = {f"vllm:contextkit_{name}_total": value for name, value in (
        ("load_seconds", 1.5), ("loaded_blocks", 600.0), ("save_seconds", 3.0),
        ("evicted_blocks", 7.0), ("saved_blocks", 900.0), ("skipped_blocks", 40.0))}
    got = connector_costs(metrics, 30)
    assert got == {"load_ms_per_step": 50.0, "load_ms_per_block": 2.5, "save_ms_per_step": 100.0,
                   "saved_blocks": 900.0, "evicted_blocks": 7.0, "skipped_blocks": 40.0,
                   "loaded_blocks": 600.0}
    assert connector_costs({"vllm:num_requests_running": 0.0}, 30) is None  # no connector


def test_connector_all_is_the_default_connector_with_room_for_everything(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from integrations.vllm.bench.agents_bench import ALL_BUDGET_FACTOR, SETUPS, _connector_config

    sizes = {"host_blocks": 832}
    setup = SETUPS["connector_all"]
    assert setup.connector == SETUPS["connector"].connector and setup.pin
    config = _connector_config(tmp_path, setup.name, sizes, setup.connector, setup.budget_factor)
    assert config.host_blocks == 832 * ALL_BUDGET_FACTOR
    assert _connector_config(tmp_path, "connector", sizes, {}).host_blocks == 832


def test_a_reused_work_dir_gives_each_connector_a_fresh_stats_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # the per-request records are read from the file's start: an earlier run's would
    # be counted as this run's first steps
    from integrations.vllm.bench.agents_bench import _connector_config

    stale = tmp_path / "stats-connector_chunks.jsonl"
    stale.write_text('{"prompt_tokens": 1004, "chunk_reused_tokens": 623}\n')
    config = _connector_config(tmp_path, "connector_chunks", {"host_blocks": 832}, {})
    assert config.stats_path == str(stale) and not stale.exists()


def test_an_interleaved_run_counts_the_replies_that_matched_the_transcript() -> None:
    from contextkit.bench.agents_vllm import result_of

    rows = _rows([900.0, 800.0, 200.0, 200.0])
    matched = [dict(r, reply_matches_transcript=i != 2) for i, r in enumerate(rows)]
    run = {"seconds": 1.0, "loadavg_1min": 1.0, "metrics": {}}
    raw = {"configs": {"ceiling": dict(run, rows=rows), "apc": dict(run, rows=matched)},
           "interleaved": True, "sizes": {
               "kv_blocks_pressure": 1, "kv_blocks_ceiling": 2, "prompt_tokens_mean": 1,
               "budget_bytes": 1, "host_blocks": 1},
           "workload": {"num_agents": 2, "num_steps": 4}}
    args = argparse.Namespace(kv_agents=2.0, budget_agents=3.0, model=None, plot=None)
    result = result_of(args, raw)
    assert result["interleaved"] is True
    assert result["replies_matching_transcript"] == {"apc": 3}
    assert result["method"].startswith("every server up")


def test_chunk_reuse_is_compared_over_warm_steps_and_over_those_that_moved_chunks() -> None:
    rows = _rows([900, 800, 400, 100])
    raw = {
        "configs": {
            "apc": {"rows": _rows([900, 800, 700, 700]), "seconds": 1.0, "metrics": {},
                    "loadavg_1min": 1.0},
            "connector": {"rows": _rows([900, 800, 200, 200]), "seconds": 1.0, "metrics": {},
                          "loadavg_1min": 1.0,
                          "connector_stats": [{"external_hit_tokens": 0}] * 4},
            "connector_chunks": {
                "rows": rows, "seconds": 1.0, "metrics": {}, "loadavg_1min": 1.0,
                "connector_stats": [{"external_hit_tokens": 0}] * 3
                + [{"external_hit_tokens": 0, "chunk_reused_tokens": 600,
                    "chunk_computed_tokens": 50}]},
        },
        "sizes": {"kv_blocks_pressure": 140, "kv_blocks_ceiling": 700,
                  "prompt_tokens_mean": 2200, "budget_bytes": 10 ** 8, "host_blocks": 480},
        "workload": {"num_agents": 2, "num_steps": 4},
    }
    args = argparse.Namespace(kv_agents=2.0, budget_agents=3.0, model=None, plot=None)
    chunks = result_of(args, raw)["chunks"]
    assert chunks["chunk_steps"] == 1 and chunks["chunk_reused_tokens"] == 600
    assert chunks["warm_speedup_vs_apc_p50"] == 2.8  # 700 / median(400, 100) = 250
    assert chunks["chunk_steps_speedup_vs_connector_p50"] == 2.0  # step 3: 200 / 100
    # the tokens the connector computed itself count as computed
    assert result_of(args, raw)["hit_tokens"]["connector_chunks"]["computed"] == 5000 + 50
    assert chunks["warm_speedup_vs_lmcache_p50"] is None
    assert chunks["warm_bound_vs_apc_p50"] is None  # no oracle in this run


def test_the_oracle_bounds_chunk_reuse_in_the_same_run() -> None:
    def lane(ttft: list[float], **more: object) -> dict[str, object]:
        return {"rows": _rows(ttft), "seconds": 1.0, "metrics": {}, "loadavg_1min": 1.0,
                **more}

    raw = {
        "configs": {
            "apc": lane([900, 800, 700, 700]),
            "connector": lane([900, 800, 200, 200],
                              connector_stats=[{"external_hit_tokens": 0}] * 4),
            "connector_chunks": lane([900, 800, 400, 100], connector_stats=[
                {"external_hit_tokens": 0}] * 3 + [{"chunk_reused_tokens": 600}]),
            "oracle": lane([900, 800, 125, 50]),
        },
        "sizes": {"kv_blocks_pressure": 140, "kv_blocks_ceiling": 700,
                  "prompt_tokens_mean": 2200, "budget_bytes": 10 ** 8, "host_blocks": 480},
        "workload": {"num_agents": 2, "num_steps": 4},
    }
    args = argparse.Namespace(kv_agents=2.0, budget_agents=3.0, model=None, plot=None)
    chunks = result_of(args, raw)["chunks"]
    # warm steps 2 and 3: apc 700, oracle median(125, 50), chunk reuse median(400, 100)
    assert chunks["warm_bound_vs_apc_p50"] == 8.0
    assert chunks["warm_speedup_vs_oracle_p50"] == 0.35  # the share of the bound reached
    # the step that moved chunks (3): connector 200, oracle 50, chunk reuse 100
    assert chunks["chunk_steps_bound_vs_connector_p50"] == 4.0
    assert chunks["chunk_steps_speedup_vs_oracle_p50"] == 0.5
