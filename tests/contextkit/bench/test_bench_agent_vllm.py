"""The pure parts of ``contextkit bench agent-vllm`` (no vLLM): speedups, label coverage,
argument checks and its registration."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest

from contextkit.bench import BENCHMARKS, load
from contextkit.bench.agent_vllm import (
    CONFIGS,
    add_arguments,
    check_args,
    label_coverage,
    restart_turn,
    speedups,
    token_bounds,
)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_registered_as_agent_vllm() -> None:
    assert BENCHMARKS["agent-vllm"] == "contextkit.bench.agent_vllm"
    assert load("agent-vllm").HELP


def test_speedups_are_medians_of_per_turn_ratios_after_turn_one() -> None:
    ttft = {"nocache": [1000.0, 1000.0, 1200.0, 900.0, 1100.0],
            "apc": [1000.0, 400.0, 600.0, 300.0, 500.0],
            "contextkit_apc": [1000.0, 100.0, 100.0, 900.0, 100.0],
            "contextkit_connector": [1000.0, 100.0, 200.0, 50.0, 100.0]}
    out = speedups(ttft, restart=3)
    # apc/d per turn 2..5: 4, 3, 6, 5 -> median 4.5; turn 1 (cold) is left out
    assert out["speedup_vs_apc_p50"] == 4.5
    # nocache/d: 10, 6, 18, 11 -> 10.5
    assert out["speedup_vs_nocache_p50"] == 10.5
    assert out["restart_turn_speedup"] == 18.0  # 900 / 50 on 0-based turn 3
    # medians over turns 2..5: apc 450, d 100
    assert out["speedup_vs_apc_of_medians"] == 4.5
    assert out["speedup_vs_contextkit_apc_p50"] == 1.0


def test_speedups_refuse_uneven_or_short_runs() -> None:
    even = {name: [1.0, 2.0, 3.0] for name in CONFIGS}
    with pytest.raises(ValueError, match="same turns"):
        speedups({**even, "apc": [1.0, 2.0]}, restart=1)
    with pytest.raises(ValueError, match="restart"):
        speedups(even, restart=3)
    with pytest.raises(ValueError, match="restart"):
        speedups(even, restart=0)


def test_token_bounds_use_the_tokens_each_configuration_computed() -> None:
    recomputed = {"nocache": [100, 100, 100], "apc": [100, 40, 60],
                  "contextkit_apc": [100, 10, 10], "contextkit_connector": [100, 10, 20]}
    prompt = {name: [100, 110, 120] for name in CONFIGS}
    out = token_bounds(recomputed, prompt, restart=2)
    assert out["apc_over_connector_p50"] == 3.5  # median of 4 and 3
    assert out["restart_turn_nocache_over_connector"] == 6.0  # 120 / 20


@dataclass
class Block:
    source_layer: str
    importance: float
    tenant: str
    pinned: bool = False


def test_label_coverage_counts_blocks_without_a_span_as_default() -> None:
    blocks = [Block("axioms", 1.0, "acme", True), Block("identity", 0.9, "acme", True),
              Block("memories", 0.6, "acme"), Block("user_turn", 0.3, "acme"),  # a span
              Block("user_turn", 0.5, "acme"),  # the connector's default: no span
              Block("user_turn", 0.5, "warmup"), Block("axioms", 1.0, "other")]
    out = label_coverage(blocks, "acme")
    assert out["blocks"] == 5
    assert out["label_coverage"] == 0.8
    assert out["pinned_blocks"] == 2
    assert out["blocks_by_layer"] == {"axioms": 1, "identity": 1, "memories": 1,
                                      "user_turn": 2}
    assert label_coverage(blocks, "nobody")["label_coverage"] is None


def test_arguments_defaults_and_checks() -> None:
    args = _args()
    assert (args.turns, args.scale, args.max_tokens) == (10, 1.0, 16)
    check_args(args)
    assert restart_turn(8) == 4 and restart_turn(9) == 4
    with pytest.raises(SystemExit, match="--turns must be >= 4"):
        check_args(_args("--turns", "3"))
    with pytest.raises(SystemExit, match=r"ending in \.png"):
        check_args(_args("--plot", "ttft.svg"))
    with pytest.raises(SystemExit):  # argparse: must be >= 1
        _args("--turns", "0")


def test_outside_the_vllm_venv_the_bench_says_where_it_runs() -> None:
    # `make test` runs in .venv, which has no vLLM (it lives in .venv-vllm). The suite puts
    # tests/integrations on sys.path, where tests/integrations/vllm is a namespace package
    # named vllm: only an installed distribution counts.
    from contextkit.bench.agent_vllm import vllm_installed

    assert not vllm_installed()
    with pytest.raises(SystemExit, match=r"\.venv-vllm/bin/python -m contextkit\.cli bench "
                                         r"agent-vllm"):
        load("agent-vllm").run(_args())


def test_the_result_from_the_drivers_raw_rows(tmp_path: Path) -> None:
    from contextkit.bench.agent_vllm import _result

    def rows(ttft: list[float], cached: list[int]) -> list[dict[str, object]]:
        return [{"turn": i + 1, "ttft_ms": t, "model_ttft_ms": t - 1, "client_ms": 1.0,
                 "total_ms": t + 5, "prompt_tokens": 1000 + 10 * i, "cached_tokens": c}
                for i, (t, c) in enumerate(zip(ttft, cached, strict=True))]

    raw = {"rows": {"nocache": rows([900, 1000, 1000, 1000], [0, 0, 0, 0]),
                    "apc": rows([900, 400, 400, 400], [0, 500, 500, 500]),
                    "contextkit_apc": rows([900, 100, 100, 100], [0, 900, 900, 900]),
                    "contextkit_connector": rows([900, 100, 200, 100], [0, 900, 900, 900])},
           "restart": 2, "seconds": {"total": 1.0}, "loadavg_1min": {"start": 0.1},
           "recovery": {"seconds": 1.0, "skipped": 0, "other": 1}, "default_layer": "user_turn",
           "blocks": [{"source_layer": "axioms", "importance": 1.0, "tenant": "acme",
                       "pinned": True},
                      {"source_layer": "user_turn", "importance": 0.5, "tenant": "acme",
                       "pinned": False}],
           "changed_layers": [["axioms"], ["current_time"], ["current_time"], ["current_time"]],
           "topics": ["a"] * 4, "apc_recompute_share": [1.0, 0.5, 0.5, 0.5],
           "vllm_cpu_num_of_reserved_cpu": "0", "omp_num_threads": "2"}
    args = _args("--turns", "4", "--plot", str(tmp_path / "p.png"), "--out",
                 str(tmp_path / "r.json"))
    out = _result(args, raw)
    assert out["speedup_vs_apc_p50"] == 4.0  # 400/100, 400/200, 400/100
    assert out["restart_turn_speedup"] == 5.0  # 1000/200 on turn 3
    assert out["label_coverage"] == 0.5
    assert out["restart_before_turn"] == 3
    assert out["recovery"] == {"seconds": 1.0, "skipped": 0}
    assert out["recomputed_tokens"]["apc"] == [1000, 510, 520, 530]
    assert (tmp_path / "p.png").stat().st_size > 1000
    assert out["turns"] == 4  # the CLI writes --out with the provenance (test_provenance)
