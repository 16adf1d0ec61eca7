"""``contextkit demo`` end to end: replay, plot, shadow, warm restart, ``contextkit status``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contextkit.cli.commands import main

pytestmark = pytest.mark.slow


def test_demo_runs_shadows_and_restarts_warm(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    store = f"file://{tmp_path / 'shadow'}"
    out = tmp_path / "demo"
    assert main(["demo", "--turns", "1", "--max-new-tokens", "4", "--out", str(out),
                 "--store", store]) == 0
    first = json.loads((out / "demo.json").read_text())
    # reservations are made in the think time between turns: none after the last turn
    assert first["summary"]["reservations"]["enabled"] is True
    printed = capsys.readouterr()
    assert "reservations: made 0, hit 0, expired 0" in printed.out
    assert "decode tok/s" in printed.err  # the per-turn table's column
    assert "Decode median: contextkit" in printed.out  # and the summary's line
    assert (out / "ttft.png").stat().st_size > 10_000
    assert (out / "memory.db").is_file()
    rec = first["records"][0]
    assert rec["prefix_broken_by"] == "first_call" and rec["reused_tokens"] == 0
    assert 5_500 < rec["prompt_tokens"] < 7_000  # the ~6K-token ten-layer prompt
    # decode tokens/s beside TTFT: tokens 2..N of the reply over the time after the first
    assert rec["generated_tokens_contextkit"] == 4
    assert rec["decode_tps_contextkit"] == pytest.approx(
        3 / ((rec["total_ms_contextkit"] - rec["ttft_ms_contextkit"]) / 1000))
    assert first["summary"]["decode_tps_p50"] == rec["decode_tps_contextkit"]
    assert rec["decode_tps_baseline"] is None  # the baseline stops at its first token
    assert first["summary"]["pinned_blocks"] > 0
    assert first["summary"]["shadow"]["blocks"] > 0
    agents = first["summary"]["agents"]  # the short multi-agent run after the replay
    assert agents["prefetches"] == agents["steps"] > 0
    assert agents["prefetch_before_generate"] is True
    assert agents["pinned_blocks_evicted"] == 0 and agents["leak_free"]
    # against its reference policy, on the same steps
    assert agents["reference"]["policy"] == "lru"
    assert len(first["agents_reference"]) == len(first["agents"]) == agents["steps"]
    assert "LRU reference (recency only" in printed.out
    # more agents than the tiers hold: the policy computes fewer prompt tokens than LRU,
    # and no fewer than a cache that holds every agent
    assert agents["ceiling"]["computed_tokens"] <= agents["computed_tokens"]
    assert agents["computed_tokens"] < agents["reference"]["computed_tokens"]
    assert "prompt tokens against LRU" in printed.out
    assert "Turn 1 (" in printed.out and "nothing is cached yet" in printed.out
    assert (out / "agents.png").stat().st_size > 10_000
    capsys.readouterr()

    assert main(["status", "--store", store, "--json"]) == 0
    status = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (session,) = status["sessions"]
    assert session["session_id"] == "contextkit-demo" and session["error"] is None
    assert session["blocks"] == first["summary"]["shadow"]["blocks"]
    assert session["pinned_blocks"] == first["summary"]["pinned_blocks"]
    assert {"axioms", "capabilities", "system_state"} <= set(session["by_layer"])

    # A second run restores the shadow: turn 1 reuses the whole prompt but a token.
    assert main(["demo", "--turns", "1", "--max-new-tokens", "4", "--out", str(out),
                 "--store", store, "--agent-steps", "0"]) == 0
    second = json.loads((out / "demo.json").read_text())
    assert second["summary"]["recovered_blocks"] == first["summary"]["shadow"]["blocks"]
    assert "blocks restored from the shadow, reusing" in capsys.readouterr().out
    rec2 = second["records"][0]
    assert rec2["prompt_tokens"] == rec["prompt_tokens"]
    assert rec2["computed_tokens"] <= 16
    assert rec2["reply"] == rec["reply"]


def test_status_on_an_empty_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--store", f"file://{tmp_path}", "--json"]) == 0
    out = capsys.readouterr().out
    assert "nothing shadowed yet" in out
    assert json.loads(out.strip().splitlines()[-1])["sessions"] == []
