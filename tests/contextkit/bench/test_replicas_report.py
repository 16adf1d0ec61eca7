"""bench replicas: the figures from the driver's raw rows (no vLLM needed)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from contextkit.bench import BENCHMARKS, load
from contextkit.bench import replicas as bench
from contextkit.bench.replicas import CONFIGS, add_arguments, result_of, run

# Two agents a0, a1 alternating, six steps: step i is agent a(i % 2)'s turn i // 2. The
# driver sends turn k of agent j to replica (j + k) % 2: replicas 0, 1, 1, 0, 0, 1 and
# previous replicas -, -, 0, 1, 1, 0, so steps 2-5 are the cross-replica steps.
TWO = [0, 1, 1, 0, 0, 1]
PREV = [None, None, 0, 1, 1, 0]


def _rows(ttft: list[float | None], cached: list[int], replica: list[int] = TWO,
          prev: list[int | None] = PREV, after: int = 99) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i, t in enumerate(ttft):
        if t is None:  # a lost turn
            rows.append({"step": i, "agent": f"a{i % 2}", "error": "Connection refused"})
            continue
        rows.append({"step": i, "agent": f"a{i % 2}", "tenant": f"t{i % 2}", "ttft_ms": t,
                     "total_ms": t + 50, "prompt_tokens": 2000, "cached_tokens": cached[i],
                     "kind": "r", "agent_turn": i // 2, "replica": replica[i],
                     "previous_replica": prev[i], "after_stop": i >= after})
    return rows


def _metrics(down: int, up: int, gets: int, puts: int, heads: int, misses: int,
             refused: int) -> dict[str, float]:
    m = {"shared_bytes_down": down, "shared_bytes_up": up, "shared_gets": gets,
         "shared_puts": puts, "shared_heads": heads, "shared_deadline_misses": misses,
         "shared_refused": refused, "load_errors": 0, "shared_hit_tokens": 0}
    return {f"vllm:contextkit_{k}_total": float(v) for k, v in m.items()}


def _run(rows: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"rows": rows, "errors": [], "server_start_s": 20.0, "seconds": 60.0,
            "replicas": 2, "metrics": [{}, {}], "connector_stats": [[], []],
            "uploads": [[], []], "router": None, "loadavg_1min": 1.5, **extra}


def raw() -> dict[str, Any]:
    zero = [0, 0]
    shared_metrics = [_metrics(3000, 6000, 3, 6, 12, 1, 0), _metrics(3000, 6000, 3, 6, 12, 0, 2)]
    return {
        "configs": {
            "single": _run(_rows([1000, 1000, 100, 120, 140, 160], [*zero, 1800, 1800, 1900, 1900],
                                 replica=[0] * 6, prev=[None, None, 0, 0, 0, 0]), replicas=1),
            "apc": _run(_rows([1000, 1000, 800, 900, 700, None], [*zero, 100, 100, 100, 0]),
                        errors=["step 5 a1: APIError: boom"]),
            "local": _run(_rows([1000, 1000, 600, 700, 500, 800], [*zero, 200, 400, 200, 400]),
                          metrics=[_metrics(0, 0, 0, 0, 0, 0, 0)] * 2),
            "shared": _run(
                _rows([1000, 1000, 200, 300, 250, 350], [*zero, 1600, 1700, 1800, 1900]),
                metrics=shared_metrics,
                connector_stats=[[{"tenant": "warmup", "shared_hit_tokens": 999},
                                  {"tenant": "t0", "shared_hit_tokens": 1024}],
                                 [{"tenant": "t1", "shared_hit_tokens": 512}]],
                uploads=[[{"event": "shared_upload", "lag_s": 0.1},
                          {"event": "shared_upload", "lag_s": 0.3}],
                         [{"event": "shared_upload", "lag_s": 0.2},
                          {"event": "shared_upload", "lag_s": 0.4},
                          {"event": "shared_upload", "lag_s": 1.0}]]),
            "routed": _run(_rows([1000, 1000, 150, 200, 250, 300], [*zero, 1800] * 2,
                                 replica=[0, 1, 0, 0, -1, 1], prev=[None, None, 0, 1, 0, -1]),
                           metrics=shared_metrics, router=["vllm-router", "--policy", "x"]),
            # replica 1 stops before step 3: a1 (last on 1) moves to 0, a0's step 4 is lost,
            # so a1's step 5 comes from replica 0 (previous 0)
            "failover": _run(_rows([1000, 1000, 200, 600, None, 300],
                                   [*zero, 1600, 1500, 0, 1900], replica=[0, 1, 1, 0, 0, 0],
                                   prev=[None, None, 0, 1, 1, 0], after=3),
                             errors=["step 4 a0: APIConnectionError: refused"],
                             metrics=[_metrics(3000, 6000, 3, 6, 12, 0, 0)]),
        },
        "errors": {},
        "sizes": {"kv_blocks_pressure": 140, "host_blocks": 480},
        "order": list(CONFIGS),
        "workload": {"num_agents": 2, "num_steps": 6},
        "chunk_blocks": 4, "deadline_s": 1.0, "router_policy": "consistent_hash",
    }


def _args(**kw: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    for key, value in kw.items():
        setattr(args, key, value)
    return args


def test_figures_equal_hand_computed_values(tmp_path: Path) -> None:
    result = result_of(_args(), raw())
    assert result["cross_replica_steps"] == [2, 3, 4, 5]
    assert result["shared_ttft_ms"] == [1000, 1000, 200, 300, 250, 350]
    assert result["apc_ttft_ms"][5] is None
    assert result["shared_ttft_p50"] == 325.0  # (300 + 350) / 2
    assert result["shared_ttft_p95"] == 1000
    # cached tokens on steps 2-5: shared 7000, local 1200, single 7400
    assert result["cross_replica_hit_rate"] == round(7000 / 7400, 4)
    assert result["cross_replica_hit_rate_local"] == round(1200 / 7400, 4)
    assert result["cross_replica_shared_tokens"] == 1536  # the warm-up's 999 dropped
    # medians on steps 2-5: shared 275, local 650, apc 800 (step 5 lost), single 130
    assert result["speedup_shared_vs_local_p50"] == round(650 / 275, 3)
    assert result["speedup_shared_vs_apc_p50"] == round(800 / 275, 3)
    assert result["ceiling_fraction"] == round(130 / 275, 3)
    assert result["bound_shared_vs_local_p50"] == round(650 / 130, 3)
    assert result["routed_vs_shared_p50"] == round(275 / 225, 3)
    assert result["routed_replica_unknown_steps"] == 1
    assert result["shared_lag_p50_s"] == 0.3 and result["shared_lag_p95_s"] == 1.0
    assert result["shared_tier"]["shared"] == {
        "bytes_down_per_step": 1000.0, "bytes_up_per_step": 2000.0, "gets_per_step": 1.0,
        "puts_per_step": 2.0, "heads_per_step": 4.0, "deadline_misses": 1.0, "refused": 2.0,
        "errors": None, "load_errors": 0.0, "lookup_s_per_step": None, "load_s_per_step": None,
        "save_s_per_step": None, "dropped": None, "deduplicated": None}
    assert result["shared_tier"]["failover"]["bytes_down_per_step"] == 600.0  # 3000 / 5
    assert set(result["shared_tier"]) == {"local", "shared", "routed", "failover"}
    assert result["failover_errors"] == 1 and result["failover_lost_turns"] == 1
    assert result["failover_recomputed_tokens_after_stop"] == 500 + 100  # steps 3 and 5
    assert result["failover_hit_rate_after_stop"] == 0.75  # step 3 only: 1500 / 2000
    assert result["lost_turns"]["apc"] == 1
    assert result["server_seconds"]["single"] == 60.0 and result["chunk_blocks"] == 4
    assert result["router_policy"] == "consistent_hash"
    # the ratio of sums on steps 2-5: single 520 over shared 1100
    assert result["ceiling_fraction_total"] == round(520 / 1100, 3)
    assert result["first_configuration"] == CONFIGS[0]
    assert result["shared_tier"]["shared"]["errors"] is None  # no such counter scraped


def test_chunk_figures_against_local_shared_and_their_ceiling() -> None:
    data = raw()
    data["configs"]["single_chunks"] = _run(
        _rows([1000, 1000, 80, 90, 100, 110], [*[0, 0], 1900, 1900, 1950, 1950],
              replica=[0] * 6, prev=[None, None, 0, 0, 0, 0]), replicas=1,
        metrics=[{"vllm:contextkit_shared_span_hits_total": 0.0}])
    data["configs"]["shared_chunks"] = _run(
        _rows([1000, 1000, 150, 200, 150, 250], [*[0, 0], 1800, 1900, 1900, 1900]),
        metrics=[{"vllm:contextkit_shared_span_hits_total": 3.0},
                 {"vllm:contextkit_shared_span_hits_total": 4.0}],
        connector_stats=[[{"tenant": "t0", "chunk_computed_tokens": 40},
                          {"tenant": "warmup", "chunk_computed_tokens": 1000}],
                         [{"tenant": "t1", "chunk_computed_tokens": 60}]])
    result = result_of(_args(), data)
    # medians on steps 2-5: shared_chunks 175, local 650, shared 275, single_chunks 95
    assert result["speedup_shared_chunks_vs_local_p50"] == round(650 / 175, 3)
    assert result["speedup_shared_chunks_vs_shared_p50"] == round(275 / 175, 3)
    assert result["ceiling_fraction_chunks"] == round(95 / 175, 3)
    assert result["bound_shared_chunks_vs_local_p50"] == round(650 / 95, 3)
    # 12000 prompt tokens, 7500 cached, plus the seams the connector computed (warm-up out)
    assert result["computed_tokens"]["shared_chunks"] == 12000 - 7500 + 100
    assert result["computed_tokens"]["local"] == 12000 - 1200
    assert result["computed_tokens"]["apc"] is None  # a lost turn: no comparable sum
    assert result["shared_span_hits"]["shared_chunks"] == 7.0
    assert "speedup_shared_chunks_vs_local_p50" not in result_of(_args(), raw())
    assert result["chunk_bound_vs_local_p50"] is None  # no oracle in this run
    # the oracle (one replica computing only what the tenant never sent) bounds chunk
    # reuse: its median on steps 2-5 is 65
    data["configs"]["oracle"] = _run(
        _rows([1000, 1000, 60, 70, 60, 70], [*[0, 0], 1950, 1950, 1950, 1950],
              replica=[0] * 6, prev=[None, None, 0, 0, 0, 0]), replicas=1)
    bounded = result_of(_args(), data)
    assert bounded["chunk_bound_vs_local_p50"] == round(650 / 65, 3)
    assert bounded["oracle_fraction_chunks"] == round(65 / 175, 3)
    assert bounded["cross_replica_steps"] == [2, 3, 4, 5]
    del data["configs"]["oracle"]
    # a run without the prefix-only shared tier reads the same cross-replica steps
    del data["configs"]["shared"]
    alone = result_of(_args(), data)
    assert alone["cross_replica_steps"] == [2, 3, 4, 5]
    assert alone["speedup_shared_chunks_vs_local_p50"] == round(650 / 175, 3)


def test_store_errors_are_reported_and_same_reuse_is_noise() -> None:
    data = raw()
    for m in data["configs"]["shared"]["metrics"]:
        m["vllm:contextkit_shared_errors_total"] = 2.0
    same = [r.get("cached_tokens") for r in data["configs"]["single"]["rows"]]
    for row, cached in zip(data["configs"]["shared"]["rows"], same, strict=True):
        row["cached_tokens"] = cached
    result = result_of(_args(), data)
    assert result["shared_tier"]["shared"]["errors"] == 4.0
    assert result["ceiling_fraction_total"] == bench.SAME_TOKENS


def test_a_config_that_did_not_run_gives_none(tmp_path: Path) -> None:
    data = raw()
    del data["configs"]["apc"], data["configs"]["failover"]
    data["errors"] = {"failover": "SystemExit: no router"}
    result = result_of(_args(), data)
    assert result["speedup_shared_vs_apc_p50"] is None
    assert result["failover_lost_turns"] is None
    assert result["errors"] == {"failover": "SystemExit: no router"}


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result_of(_args(plot=str(tmp_path / "p.png")), raw())
    assert (tmp_path / "p.png").stat().st_size > 0


def test_unknown_config_is_a_one_line_exit() -> None:
    with pytest.raises(SystemExit) as exc:
        run(_args(configs="single,bogus"))
    message = str(exc.value)
    assert "bogus" in message and "\n" not in message and "single" in message


def test_registered_and_in_step_with_the_driver() -> None:
    assert BENCHMARKS["replicas"] == "contextkit.bench.replicas"
    assert load("replicas") is bench
    from integrations.vllm.bench.replicas_bench import CONFIGS as DRIVER

    assert DRIVER == CONFIGS
