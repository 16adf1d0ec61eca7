"""The example scripts run as users run them (small turn counts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from openai_server import SERVED_NAME, FakeOpenAIServer

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
    assert second["ttft_ms"] > 0  # reported (timing itself is a benchmark's business)


def test_langchain_over_an_openai_server_example(openai_server: FakeOpenAIServer) -> None:
    """The LangChain-over-vLLM recipe, against a real OpenAI-compatible HTTP server."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "langchain_vllm.py"),
         "--base-url", openai_server.base_url, "--model", SERVED_NAME, "--turns", "3",
         "--tenant", "acme", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["turn", "prompt", "cached"]
    summary = json.loads(lines[-1])
    assert summary["calls"] == 3 and summary["errors"] == 0
    bodies = openai_server.chat_requests()
    assert len(bodies) == 3
    for i, (turn, body) in enumerate(zip(summary["turns"], bodies, strict=True)):
        assert body["cache_salt"] == "acme"
        ours = body["kv_transfer_params"]["contextkit"]
        assert turn["prompt_tokens"] == ours["prompt_tokens"] > 5000  # the replay's prompt
        assert turn["cached_tokens"] == openai_server.cached_for(i)
        layers = {span[2] for span in ours["spans"]}
        assert {"axioms", "identity", "capabilities", "memories", "user_turn"} <= layers
        assert [m["role"] for m in body["messages"]][-2:] == ["system", "user"]
    assert summary["turns"][-1]["cached_tokens"] > summary["turns"][-1]["prompt_tokens"] // 2
