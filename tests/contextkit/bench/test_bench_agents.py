"""``contextkit bench agents``: the figures from raw rows, the engine's per-tier reuse
(``GenerationResult.warmed_tokens``) and a tiny real run of the three policies."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from contextkit.bench import BENCHMARKS, load
from contextkit.bench._agents_report import SAME_TOKENS, bounds
from contextkit.bench.agents import (
    POLICIES,
    add_arguments,
    check_args,
    parse_sweep,
    percentile,
    plan_sizes,
    policy_figures,
    run_interleaved,
    speedups,
)
from contextkit.cli.commands import main
from contextkit.engine.engine import Engine
from gpu_cache import Tier


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def _prompt(engine: Engine, words: int, seed: int) -> list[int]:
    text = " ".join(f"w{seed}x{i}" for i in range(words))
    return engine.encode(text)


def test_warmed_tokens_count_reuse_brought_up_from_the_host_tier(
        fresh: Callable[..., Engine]) -> None:
    eng = fresh(device=64, host=64)
    ids = _prompt(eng, 120, 1)
    first = eng.generate(ids, max_new_tokens=1)
    assert first.reused_tokens == 0 and first.warmed_tokens == 0
    again = eng.generate(ids, max_new_tokens=1)  # every full block still on the device
    assert again.reused_tokens > 0 and again.warmed_tokens == 0
    cache = eng.cache
    on_device = [m.block_id for m in cache.metadata.all() if m.tier is Tier.DEVICE
                 and m.key is not None]
    assert cache.spill_blocks(on_device) == on_device
    warmed = eng.generate(ids, max_new_tokens=1)
    assert warmed.reused_tokens == again.reused_tokens
    # every reused token came up from the host tier in this request
    assert warmed.warmed_tokens == warmed.reused_tokens
    assert eng.generate(ids, max_new_tokens=1).warmed_tokens == 0
    assert eng.generate(ids, max_new_tokens=1, use_cache=False).warmed_tokens == 0


# ---------------------------------------------------------------------- pure figures
def _row(step: int, turn: int, ttft: float, prompt: int = 100, reused: int = 0,
         warmed: int = 0, **extra: object) -> dict[str, object]:
    return {"step": step, "agent": f"agent-{step % 2}", "agent_turn": turn, "ttft_ms": ttft,
            "prompt_tokens": prompt, "reused_tokens": reused, "warmed_tokens": warmed,
            "computed_tokens": prompt - reused, "blocks_moved": 2, "bytes_moved": 10,
            "pinned_blocks_evicted": 0, **extra}


def test_policy_figures_come_from_the_rows() -> None:
    rows = [_row(0, 0, 5000.0), _row(1, 0, 4000.0),
            _row(2, 1, 1000.0, reused=80, warmed=16), _row(3, 1, 3000.0, reused=40),
            _row(4, 2, 2000.0, reused=60, warmed=60)]
    out = policy_figures(rows)
    # p50 and p95 over the warm steps only (1000, 3000, 2000)
    assert out["ttft_p50"] == 2000.0
    assert out["ttft_p95"] == 2900.0  # linear between ranks: 2000 + 0.9 * (3000 - 2000)
    assert out["ttft_ms"] == [5000.0, 4000.0, 1000.0, 3000.0, 2000.0]
    # hit rates over every step: reused 180 of which warmed 76, of 500 prompt tokens
    assert out["device_hit_rate"] == round(104 / 500, 4)
    assert out["host_hit_rate"] == round(76 / 500, 4)
    assert out["blocks_moved"] == 10 and out["bytes_moved"] == 50
    assert out["pinned_blocks_evicted"] == 0
    assert out["ooda_cycle_ms_p50"] is None and "prefetch" not in out


def test_policy_figures_of_the_ooda_policy_check_the_prefetch_order() -> None:
    def ooda(step: int, turn: int, ms: float, finished: float, started: float
             ) -> dict[str, object]:
        return _row(step, turn, 100.0, ooda_ms=ms, prefetch_warmed=3, prefetch_spilled=1,
                    prefetch_removed=0, prefetch_bytes=64, prefetch_finished_at=finished,
                    generate_started_at=started)

    rows = [ooda(0, 0, 1.0, 1.0, 2.0), ooda(1, 1, 3.0, 3.0, 4.0), ooda(2, 1, 2.0, 5.0, 6.0)]
    out = policy_figures(rows)
    assert out["ooda_cycle_ms_p50"] == 2.0
    assert out["prefetch"] == {"calls": 3, "warmed_blocks": 9, "spilled_blocks": 3,
                               "removed_blocks": 0, "bytes": 192, "before_generate": True}
    rows[2] = ooda(2, 1, 2.0, 6.5, 6.0)  # finished after its generate started
    assert policy_figures(rows)["prefetch"]["before_generate"] is False


def test_policy_figures_need_a_warm_step() -> None:
    with pytest.raises(ValueError, match="second turn"):
        policy_figures([_row(0, 0, 1.0), _row(1, 0, 1.0)])
    with pytest.raises(ValueError, match="no steps"):
        policy_figures([])


def test_speedups_are_medians_of_per_step_ratios_over_warm_steps() -> None:
    rows = [_row(i, t, 1.0) for i, t in enumerate((0, 0, 1, 1, 2, 1))]
    ttft = {"lru": [900.0, 900.0, 1000.0, 3000.0, 800.0, 1200.0],
            "semantic": [900.0, 900.0, 500.0, 1000.0, 800.0, 1200.0],
            "semantic+ooda": [900.0, 900.0, 250.0, 1000.0, 400.0, 400.0]}
    out = speedups(ttft, rows)
    # warm steps 2..5: semantic ratios 2, 3, 1, 1 -> 1.5; ooda 4, 3, 2, 3 -> 3
    assert out["speedup_vs_lru_p50"] == {"semantic": 1.5, "semantic+ooda": 3.0}
    # medians of the warm steps: lru 1100, semantic 900, ooda 400
    assert out["speedup_vs_lru_of_medians"] == {"semantic": 1.222, "semantic+ooda": 2.75}
    # sums of the warm steps: lru 6000, semantic 3500, ooda 2050
    assert out["speedup_vs_lru_total"] == {"semantic": 1.714, "semantic+ooda": 2.927}
    with pytest.raises(ValueError, match="same steps"):
        speedups({**ttft, "semantic": [1.0]}, rows)


def test_a_median_of_ratios_can_beat_its_ceiling_a_ratio_of_sums_cannot_be_told_apart() -> None:
    """Why the ceiling is in tokens: per-step ratios let a policy 'beat' a cache that holds
    everything (agents-cpu-run2.json had 1.161 against a ceiling of 1.113)."""
    rows = [_row(i, 1, 1.0) for i in range(3)]
    ttft = {"lru": [1000.0, 1000.0, 4000.0], "policy": [500.0, 500.0, 3900.0],
            "fits": [600.0, 600.0, 1000.0]}
    out = speedups(ttft, rows)
    # per-step ratios: policy 2, 2, 1.03 -> median 2; fits 1.67, 1.67, 4 -> median 1.67
    assert out["speedup_vs_lru_p50"] == {"policy": 2.0, "fits": 1.667}
    # sums: 6000 / 4900 against 6000 / 2200: the cache that holds everything is ahead
    assert out["speedup_vs_lru_total"] == {"policy": 1.224, "fits": 2.727}


def test_bounds_are_tokens_and_same_tokens_is_noise() -> None:
    computed = {"lru": 30_000, "semantic": 25_000, "semantic+ooda": 20_000, "ceiling": 20_000}
    ttft = {"lru": 9.0, "semantic": 8.0, "semantic+ooda": 5.0, "ceiling": 5.5}
    out = bounds(computed, ttft, ceiling="ceiling")
    assert set(out) == {"lru", "semantic", "semantic+ooda"}
    assert out["lru"]["ceiling_fraction"] == 0.0
    assert out["semantic"]["ceiling_fraction"] == 0.5
    assert out["semantic"]["ttft_vs_ceiling"] == round(5.5 / 8.0, 3)
    # the same tokens as the ceiling: a faster TTFT than it is noise, not a speedup
    assert out["semantic+ooda"] == {"computed_tokens": 20_000, "ceiling_computed_tokens": 20_000,
                                    "beats_ceiling": False, "ceiling_fraction": 1.0,
                                    "ttft_vs_ceiling": SAME_TOKENS}
    assert not any(b["beats_ceiling"] for b in out.values())
    broken = bounds({**computed, "semantic": 19_000}, ttft, ceiling="ceiling")["semantic"]
    assert broken["beats_ceiling"] is True and broken["ceiling_fraction"] > 1
    assert bounds({"lru": 5, "ceiling": 5}, {"lru": 1.0, "ceiling": 1.0},
                  ceiling="ceiling")["lru"]["ceiling_fraction"] is None
    with pytest.raises(ValueError, match="ceiling"):
        bounds({"lru": 5}, {"lru": 1.0}, ceiling="ceiling")


class _Scripted:
    """A configuration for :func:`run_interleaved` that answers from a script and
    records what it was asked (the interface of :class:`PolicyRun`)."""

    def __init__(self, name: str, order: list[str], reply: str) -> None:
        self.name, self.order, self.reply = name, order, reply
        self.rows: list[dict[str, object]] = []
        self.histories: list[list[tuple[str, str]]] = []
        self.closed = False

    def step(self, i: int, history: list[tuple[str, str]]) -> tuple[dict[str, object], str]:
        self.order.append(self.name)
        self.histories.append(list(history))
        self.rows.append({"step": i})
        return self.rows[-1], f"{self.reply}{i}"

    def close(self) -> dict[str, object]:
        self.closed = True
        return {"rows": self.rows}


def test_interleaving_rotates_the_order_and_feeds_every_run_one_transcript() -> None:
    from contextkit.workloads.agents import MultiAgentWorkload

    workload = MultiAgentWorkload(2, num_tenants=1, steps=6, seed=0, scale=0.2)
    order: list[str] = []
    runs = {"lru": _Scripted("lru", order, "a"), "semantic": _Scripted("semantic", order, "a"),
            "ceiling": _Scripted("ceiling", order, "b")}
    out = run_interleaved(runs, workload, steps=6, progress=False)
    assert all(r.closed for r in runs.values()) and set(out) == set(runs)
    # each step goes to every run before the next step, and the first one rotates
    per_step = [order[i:i + 3] for i in range(0, 18, 3)]
    assert all(sorted(s) == ["ceiling", "lru", "semantic"] for s in per_step)
    assert [s[0] for s in per_step] == ["lru", "semantic", "ceiling"] * 2
    # one transcript: the first run's replies, whatever the others answered
    assert runs["ceiling"].histories == runs["lru"].histories
    assert any(("assistant", "a0") in h for h in runs["ceiling"].histories)
    assert not any(("assistant", "b0") in h for h in runs["ceiling"].histories)
    assert [r["reply_matches_transcript"] for r in runs["semantic"].rows] == [True] * 6
    assert [r["reply_matches_transcript"] for r in runs["ceiling"].rows] == [False] * 6


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([10.0, 20.0], 95) == 19.5
    with pytest.raises(ValueError):
        percentile([], 50)


def test_sizes_state_blocks_tokens_agents_and_the_pin_budget() -> None:
    prompt = {"agent-0": 150, "agent-1": 180, "agent-2": 120}
    stable = {"agent-0": 100, "agent-1": 110, "agent-2": 90}
    two = plan_sizes(prompt, stable, block_size=16, device_agents=2, host_agents=4,
                     max_new_tokens=1)
    assert two.headroom_blocks == 2  # 3 reply tokens + a block, rounded up
    assert two.device_blocks == 2 * (180 + 2) and two.host_blocks == 4 * 150
    assert two.pin_budget == 182 and two.pins
    d = two.describe()
    assert d["device_tokens"] == 364 * 16 and d["host_tokens"] == 600 * 16
    assert d["device_agents"] == 2 and d["pins"].startswith("on")
    one = plan_sizes(prompt, stable, block_size=16, device_agents=1, host_agents=4,
                     max_new_tokens=1)
    assert one.device_blocks == 182 and one.pin_budget == 0 and not one.pins
    assert one.describe()["pins"].startswith("off")
    with pytest.raises(ValueError):
        plan_sizes({}, {}, block_size=16, device_agents=1, host_agents=1, max_new_tokens=1)


def test_sweep_and_argument_checks() -> None:
    assert parse_sweep("1,2,4,all", 6) == [1, 2, 4, 6]
    assert parse_sweep("all, 9, 2", 6) == [2, 6]
    assert parse_sweep("", 6) == []
    with pytest.raises(ValueError, match="--sweep"):
        parse_sweep("1,two", 6)
    for argv, message in ((["--tenants", "7"], "--tenants"), (["--steps", "8"], "--steps"),
                          (["--sweep", "0"], "--sweep"), (["--plot", "x.svg"], ".png")):
        with pytest.raises(SystemExit, match=message):
            check_args(_args(*argv))
    check_args(_args())


def test_registered_as_agents() -> None:
    assert BENCHMARKS["agents"] == "contextkit.bench.agents"
    assert load("agents").HELP


# ---------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_bench_agents_end_to_end_on_the_real_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """3 agents of 2 tenants, 6 steps, a device tier of 2 agents and a host tier of 1:
    every field, no pinned block evicted, every prefetch done before its turn."""
    out, png = tmp_path / "agents.json", tmp_path / "agents.png"
    assert main(["bench", "agents", "--agents", "3", "--tenants", "2", "--steps", "6",
                 "--scale", "0.2", "--device-agents", "2", "--host-agents", "1",
                 "--sweep", "2", "--json", "--out", str(out), "--plot", str(png)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == result
    assert png.stat().st_size > 10_000
    sizes = result["sizes"]
    assert sizes["device_blocks"] == 2 * (sizes["largest_prompt_blocks"]
                                          + sizes["headroom_blocks"])
    assert sizes["host_blocks"] == sizes["mean_prompt_blocks"]
    assert sizes["pins"].startswith("on")
    assert set(result["policies"]) == set(POLICIES)
    for name, fig in result["policies"].items():
        rows = result["rows"][name]
        assert len(rows) == len(fig["ttft_ms"]) == 6
        assert all(r["ttft_ms"] > 0 and r["prompt_tokens"] > 1_000 for r in rows)
        assert fig["pinned_blocks_evicted"] == 0
        assert fig["leak_free"] is True
        for tier in fig["tiers_at_end"].values():
            assert tier["free"] + tier["used"] == tier["capacity"]
        # the reported figures are those of the rows
        recomputed = policy_figures(rows)
        assert {k: fig[k] for k in recomputed} == recomputed
        assert 0 < fig["device_hit_rate"] + fig["host_hit_rate"] < 1
        assert fig["blocks_moved"] > 0  # the tiers are too small: blocks had to move
    assert any(r["pin_state"] == "pinned" for r in result["rows"]["semantic"])
    assert all(r["pin_state"] == "off" for r in result["rows"]["lru"])
    ooda = result["policies"]["semantic+ooda"]
    assert ooda["ooda_cycle_ms_p50"] > 0 and result["policies"]["lru"]["ooda_cycle_ms_p50"] is None
    assert ooda["prefetch"]["calls"] == 6 and ooda["prefetch"]["before_generate"] is True
    for row in result["rows"]["semantic+ooda"]:
        assert row["prefetch_finished_at"] <= row["generate_started_at"]
    assert set(result["speedup_vs_lru_p50"]) == {"semantic", "semantic+ooda"}
    # the ceiling ran in turn with the policies on the same prompts: a bound in tokens
    assert set(result["bounds"]) == set(POLICIES)
    for name, b in result["bounds"].items():
        assert b["beats_ceiling"] is False, name
        assert b["computed_tokens"] == result["policies"][name]["computed_tokens"]
    assert result["ceiling"]["computed_tokens"] <= result["ceiling"][
        "computed_tokens_prefix_only"]
    assert len(result["ceiling"]["ttft_ms"]) == 6
    (point,) = result["sweep"]
    assert point["device_agents"] == 2 and point["device_blocks"] == sizes["device_blocks"]
    assert point["speedup_vs_lru_p50"] == result["speedup_vs_lru_p50"]  # the same 6 steps
    assert result["workload"]["num_agents"] == 3 and len(result["workload"]["prompt_tokens"]) == 6
