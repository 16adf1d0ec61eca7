"""The example scripts run as users run them (small turn counts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["langchain_agent.py", "llamaindex_chat.py"])
def test_example_runs_and_reuses_the_prefix(script: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--turns", "2",
         "--max-new-tokens", "4", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["turn", "TTFT", "ms"]
    summary = json.loads(lines[-1])
    assert summary["calls"] == 2 and summary["errors"] == 0
    first, second = summary["turns"]
    assert first["cache_read_tokens"] == 0 and first["input_tokens"] > 5000
    assert second["cache_read_tokens"] > first["input_tokens"] // 2  # the layered prefix
    assert second["ttft_ms"] < first["ttft_ms"]
