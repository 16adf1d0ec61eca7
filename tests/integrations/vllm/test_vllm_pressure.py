"""A vLLM server whose KV space holds about two prompts, with the connector (CPU build).

More agents than vLLM's KV holds: vLLM's prefix cache drops a returning agent's blocks,
the connector's DDR tier still has them, and its tenant's next request loads them
instead of recomputing; another tenant sending the same text loads nothing. Run by
``make test-vllm``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.connector_server import BLOCK, connector_server, counter, words_text

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[3]
SERVED = "contextkit-pressure"
KV_BLOCKS = 100  # 3,200 tokens: about two of the ~1,400-token prompts below


def _prompt(seed: int, words: int = 1100) -> str:
    return words_text(seed, words)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    srv, stats = connector_server(tmp_path_factory.mktemp("pressure"), SERVED,
                                  kv_blocks=KV_BLOCKS, host_blocks=600, max_model_len=3072)
    with srv:
        yield srv, stats


def _chat(srv: Any, stats: Path, text: str, tenant: str
          ) -> tuple[int, int, int, dict[str, Any]]:
    """One request; (prompt tokens, tokens vLLM reported cached, tokens the connector
    loaded, the response's cache report)."""
    from contextkit.pipeline.served.wire import cache_report
    from integrations.vllm.bench.harness import read_stats

    _, start = read_stats(stats)
    reply = srv.post("/v1/chat/completions", {
        "model": SERVED, "max_tokens": 2, "temperature": 0, "cache_salt": tenant,
        "messages": [{"role": "system", "content": text},
                     {"role": "user", "content": "Summarise."}]})
    usage = reply.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    rows: list[dict[str, Any]] = []
    for _ in range(100):  # the scheduler writes the request's record as it finishes
        rows, _ = read_stats(stats, start)
        if rows:
            break
        time.sleep(0.1)
    assert len(rows) == 1, rows
    report = cache_report(reply.get("kv_transfer_params"))
    assert report is not None, reply.get("kv_transfer_params")
    return (int(usage["prompt_tokens"]), int(cached),
            int(rows[0].get("external_hit_tokens") or 0), report)


def test_a_returning_agent_loads_from_the_connector_after_vllm_evicted_it(
        server: tuple[Any, Path]) -> None:
    srv, stats = server
    agent_a, agent_b, agent_c = _prompt(1), _prompt(2), _prompt(3)
    cold = _chat(srv, stats, agent_a, "org-a")
    assert cold[1:3] == (0, 0) and cold[3]["reuse"] == "none"
    assert cold[3]["computed_tokens"] == cold[0]
    # two other agents fill vLLM's KV space: agent A's blocks leave it (the tail first:
    # vLLM frees a finished request's blocks last to first)
    for text, tenant in ((agent_b, "org-a"), (agent_c, "org-b"), (agent_b, "org-a")):
        _chat(srv, stats, text, tenant)
    prompt, cached, loaded, report = _chat(srv, stats, agent_a, "org-a")
    assert loaded >= 10 * BLOCK, (prompt, cached, loaded)  # what vLLM lost, from DDR
    # vLLM's own blocks and the connector's together: every full block but the last
    assert cached >= prompt - 2 * BLOCK, (prompt, cached, loaded)
    # the response says so: cached_tokens counts the connector's hits, and its cache
    # report splits them by tier
    assert report["reuse"] == "prefix" and report["fallback"] is None, report
    assert report["contextkit_loaded_tokens"] == loaded
    assert report["vllm_cached_tokens"] + loaded == cached, (report, cached)
    assert report["computed_tokens"] == prompt - cached
    # another tenant sending the same text reuses nothing, on either tier
    other = _chat(srv, stats, agent_a, "org-b")
    assert other[1:3] == (0, 0) and other[3]["reuse"] == "none"


def test_agent_hints_in_other_stacks_dialects_reach_the_connector(
        server: tuple[Any, Path]) -> None:
    # Dynamo's cache_control and an SGLang-style priority, which vLLM alone does not
    # read as hints: the middleware turns both into contextkit's, and the connector
    # pins the prompt's blocks for the TTL (without the middleware: none)
    srv, _ = server
    before = counter(srv, "vllm:contextkit_hint_pinned_blocks_total")
    reply = srv.post("/v1/chat/completions", {
        "model": SERVED, "max_tokens": 2, "temperature": 0, "cache_salt": "org-hints",
        "priority": 40, "nvext": {"cache_control": {"type": "ephemeral", "ttl": "5m"}},
        "messages": [{"role": "system", "content": _prompt(9, words=400)},
                     {"role": "user", "content": "Summarise."}]})
    assert reply["choices"][0]["message"]["content"] is not None
    srv.post("/v1/chat/completions", {  # one more step carries the worker's report
        "model": SERVED, "max_tokens": 1, "cache_salt": "org-other",
        "messages": [{"role": "user", "content": "tick"}]})
    pinned = 0.0
    for _ in range(50):  # the keeps land on the save thread, a report at a time
        pinned = counter(srv, "vllm:contextkit_hint_pinned_blocks_total") - before
        if pinned >= 10:
            break
        time.sleep(0.2)
    assert pinned >= 10, pinned  # the ~500-token prompt's full blocks
    # a bad hint is dropped and the request served
    bad = srv.post("/v1/chat/completions", {
        "model": SERVED, "max_tokens": 1, "cache_salt": "org-hints",
        "nvext": {"cache_control": {"type": "ephemeral", "ttl": "forever"}},
        "messages": [{"role": "user", "content": "tick"}]})
    assert bad["choices"][0]["message"]["content"] is not None


def _loaded_since(stats: Path, start: int) -> int:
    """The tokens the connector loaded for the first request recorded after ``start``
    (the scheduler writes a request's record as it finishes)."""
    from integrations.vllm.bench.harness import read_stats

    rows: list[dict[str, Any]] = []
    for _ in range(100):
        rows, _ = read_stats(stats, start)
        if rows:
            break
        time.sleep(0.1)
    assert rows, "no record of the request in the connector's stats"
    return int(rows[-1].get("external_hit_tokens") or 0)


def test_llamaindex_usage_shows_the_connectors_hits(server: tuple[Any, Path]) -> None:
    # the same through LlamaIndex: ContextKitOpenAILike's reply carries vLLM's usage,
    # whose cached_tokens count the connector's loads, and the call's report reads them
    # (LlamaIndex lives in the project's .venv, so the client runs there)
    from integrations.vllm.bench.harness import read_stats

    srv, stats = server
    python = ROOT / ".venv" / "bin" / "python"
    assert python.is_file(), "make setup makes .venv, where LlamaIndex is installed"

    def client() -> dict[str, Any]:
        done = subprocess.run([str(python), "-m", "tests.integrations.vllm.llamaindex_client",
                               srv.base_url, SERVED, "org-llamaindex", "40"], cwd=ROOT,
                              capture_output=True, text=True, timeout=900, check=False,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert done.returncode == 0, done.stderr[-4000:]
        got: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return got

    first = client()
    assert first["report_prompt_tokens"] == first["prompt_tokens"]
    for filler in (30, 31, 30):  # push it out of vLLM's KV
        _chat(srv, stats, _prompt(filler), "org-filler")
    _, start = read_stats(stats)
    again = client()
    loaded = _loaded_since(stats, start)
    assert loaded >= 10 * BLOCK, (first, again)
    assert again["cached_tokens"] >= loaded, (again, loaded)
    assert again["report_reused_tokens"] == again["cached_tokens"]


def test_langchain_usage_shows_the_connectors_hits(server: tuple[Any, Path]) -> None:
    # a returning prompt loaded from the connector's DDR tier: LangChain's cache_read
    # counts those tokens, as vLLM's cached_tokens does
    from langchain_openai import ChatOpenAI
    from pydantic import SecretStr

    from integrations.vllm.bench.harness import read_stats

    srv, stats = server
    chat = ChatOpenAI(model=SERVED, base_url=srv.base_url, api_key=SecretStr("x"),
                      max_tokens=2, temperature=0, max_retries=0)
    text, tenant = _prompt(20), "org-usage"
    _chat(srv, stats, text, tenant)
    for filler in (30, 31, 30):  # push it out of vLLM's KV
        _chat(srv, stats, _prompt(filler), "org-filler")
    _, start = read_stats(stats)
    reply = chat.invoke([("system", text), ("user", "Summarise.")],
                        extra_body={"cache_salt": tenant})
    cached = (reply.usage_metadata or {}).get("input_token_details", {})["cache_read"]
    loaded = _loaded_since(stats, start)
    assert loaded >= 10 * BLOCK
    assert cached >= loaded, (cached, loaded)
