"""A session's KV kept through a tool-call pause, end to end on vLLM (CPU build).

An agent (a session, named by its ``x-session-id`` header) comes back after a pause the
connector has learned; meanwhile other tenants' prompts overflow vLLM's KV and the
connector's DDR tier several times. The session's blocks, kept for the pause it was
expected to take (pinned on the connector's device tier up to the tenant's quota, the
rest moved there unpinned), are loaded on its return; a session the connector knows
nothing of loses them. Run by ``make test-vllm``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.connector_server import BLOCK, connector_server, counter, words_text

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

SERVED = "contextkit-pauses"
KV_BLOCKS = 60  # 1,920 tokens: the agent's prompt, and one filler at a time
HOST_BLOCKS = 48  # the DDR tier: ~1.5K tokens in fp16 slots
DEVICE_BLOCKS = 32  # room for the session's ~14 blocks, a pin quota (pin_share 0.5) under it
PAUSE_S = 8.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path]]:
    srv, stats = connector_server(tmp_path_factory.mktemp("pauses"), SERVED,
                                  kv_blocks=KV_BLOCKS, host_blocks=HOST_BLOCKS,
                                  device_blocks=DEVICE_BLOCKS, max_model_len=1800)
    with srv:
        yield srv, stats


def _turn(srv: Any, stats: Path, text: str, tenant: str, session: str | None,
          user: str = "Check the queue.") -> dict[str, Any]:
    """One turn; the connector's record of it."""
    from integrations.vllm.bench.harness import read_stats

    _, start = read_stats(stats)
    body = {"model": SERVED, "max_tokens": 1, "temperature": 0, "cache_salt": tenant,
            "messages": [{"role": "system", "content": text},
                         {"role": "user", "content": user}]}
    headers = {"x-session-id": session} if session else {}
    srv.post("/v1/chat/completions", body, headers=headers)
    for _ in range(100):
        rows, _ = read_stats(stats, start)
        if rows:
            return rows[-1]
        time.sleep(0.1)
    raise AssertionError("no record of the turn")


def _fill(srv: Any, stats: Path) -> None:
    """Other tenants' prompts: three times the DDR tier, vLLM's KV overflowed each time."""
    for i in range(5):
        _turn(srv, stats, words_text(100 + i, 900), f"filler-{i % 2}", None)


@pytest.mark.parametrize("session", ["agent-7", None])
def test_a_paused_sessions_kv_comes_back_on_its_return(server: tuple[Any, Path],
                                                       session: str | None) -> None:
    srv, stats = server
    tenant = "org-kept" if session else "org-unknown"
    text = words_text(7 if session else 8, 380)  # ~12 blocks
    _turn(srv, stats, text, tenant, session)
    time.sleep(PAUSE_S)  # the first pause: learned
    _turn(srv, stats, text, tenant, session)  # back, then paused again: kept
    _fill(srv, stats)
    kept = counter(srv, "vllm:contextkit_pause_kept_blocks_total")
    warmed = counter(srv, "vllm:contextkit_pause_warmed_blocks_total")
    back = _turn(srv, stats, text, tenant, session)
    _turn(srv, stats, "tick", "filler-0", None)  # one more step carries the release
    blocks = back["prompt_tokens"] // BLOCK
    if session:  # before it came back: pinned up to the quota, the rest on the device tier
        assert kept >= 1 and warmed >= 1 and kept + warmed >= blocks - 1, (kept, warmed)
        assert back["external_hit_tokens"] >= (blocks - 1) * BLOCK, back
        assert counter(srv, "vllm:contextkit_pause_released_blocks_total") >= kept  # its pins
    else:  # nothing learned, nothing kept: the fillers took its blocks
        assert back["external_hit_tokens"] < (blocks - 1) * BLOCK, back
