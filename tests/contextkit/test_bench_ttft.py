"""``contextkit bench ttft`` end to end (a few turns; ``make test-heavy``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contextkit.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.heavy]


def test_bench_ttft_reports_every_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "ttft", "--turns", "3", "--max-new-tokens", "8", "--json",
                 "--out", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("ttft_ms_baseline", "ttft_ms_contextkit", "ttft_ms_prefix_cache"):
        assert len(result[key]) == 3 and all(v > 0 for v in result[key])
    assert result["turns"] == 3
    assert result["reused_tokens"][0] == 0 and result["reused_tokens"][1] > 4_000
    assert result["speedup_p50"] > 1.5
    assert result["speedup_vs_prefix_cache_p50"] > 1.2
    assert result["agreement_native"] == 1.0
    # the lossless sibling reused what the TQ4 path reused, and both sit under the
    # FLOP ceiling of that reuse (within timing noise)
    assert result["reused_tokens_native_cached"][1:] == result["reused_tokens"][1:]
    assert result["flop_ratio"][0] == 1.0 and result["flop_ratio_p50"] > 2.0
    assert result["speedup_native_cached_p50"] < 1.25 * result["flop_ratio_p50"]
    assert result["top1_agreement_tq4"] > 0.8
    assert 0.9 < result["ppl_ratio_tq4"] < 1.2
    assert (tmp_path / "ttft.png").stat().st_size > 10_000
