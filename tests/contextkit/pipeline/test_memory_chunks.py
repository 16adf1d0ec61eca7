"""Memory lines prefilled when they enter the graph are reused by the first prompt that
brings them in, for their tenant only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from contextkit.engine.engine import Engine
from contextkit.pipeline.memory_chunks import MemoryChunks
from contextkit.pipeline.pipeline import CacheAwareContextPipeline

pytestmark = pytest.mark.slow

MEMORIES = [
    f"2024-03-{10 + i:02d}: checkout-api p95 rose to {800 + 40 * i} ms after deploy "
    f"{4100 + i}; the cause was pool exhaustion in region eu-{i}, fixed by raising the "
    "pool to 64." for i in range(6)
]


class CountEmbedder:
    """The memory graph's Embedder protocol, by text length (no model needed here)."""

    model_id = "test-count-2"
    dim = 2

    def encode(self, texts: Any) -> np.ndarray:
        return np.array([[len(t), 1.0] for t in texts], dtype=np.float32)


def prompt(memories: list[str]) -> dict[str, Any]:
    return {
        "axioms": ["Tell the truth about what you checked."],
        "identity": ["You are Atlas, the platform team's SRE assistant."],
        "memories": memories,
        # enough after the memories that none of them is in the float residual window
        "awareness": [f"The user has been on call for {n} hours and prefers short answers "
                      "with the one command to run first." for n in range(2, 8)],
        "system_state": ["checkout-api: p95 912 ms, 5xx 1.4%"],
        "current_time": ["Now: 17:10 CET."],
    }


def served(engine: Engine, memories: list[str], tenant: str) -> Any:
    pipeline = CacheAwareContextPipeline(engine, tenant=tenant)
    pipeline.wrap(prompt)(memories)
    return pipeline.generate("Is checkout slow again?", max_new_tokens=1).report


def test_prefilled_memories_are_moved_in_for_their_tenant_only(
        fresh: Callable[..., Engine]) -> None:
    engine = fresh("tq4", device=256, host=256)
    chunks = MemoryChunks(engine)
    stats = chunks.add(MEMORIES, tenant="acme")
    assert stats.lines == len(MEMORIES) and stats.skipped == 0 and not stats.preempted
    assert stats.computed_tokens % engine.cache.block_size == 0 and stats.computed_tokens > 0
    again = chunks.add([*MEMORIES[:2], "  "], tenant="acme")
    assert again.lines == 0 and again.skipped == 3 and again.computed_tokens == 0
    assert chunks.pending(MEMORIES, tenant="other") == MEMORIES

    picked = [MEMORIES[4], MEMORIES[1], MEMORIES[3]]  # another order, another position
    report = served(engine, picked, "acme")
    assert report.reused_chunks.get("memories") == len(picked)
    assert report.reused_by_layer["memories"] > report.computed_by_layer.get("memories", 0)
    assert report.reused_tokens + report.chunk_reused_tokens + report.computed_tokens \
        == report.prompt_tokens

    other = served(engine, picked, "other")  # same text, another tenant: nothing shared
    assert other.reused_chunks.get("memories", 0) == 0
    assert other.reused_by_layer.get("memories", 0) == 0


def test_sync_adds_what_the_graph_holds_for_the_tenant(fresh: Callable[..., Engine]) -> None:
    from memory_graph import MemoryGraph

    graph = MemoryGraph(embedder=CountEmbedder())
    graph.add_nodes(MEMORIES[:4], tenant="acme")
    graph.add_nodes(MEMORIES[4:], tenant="beta")
    chunks = MemoryChunks(fresh("tq4", device=256, host=256))
    assert chunks.sync(graph, graph_tenant="acme").lines == 4
    assert chunks.pending(MEMORIES, tenant="acme") == MEMORIES[4:]
    assert chunks.sync(graph, graph_tenant="acme").lines == 0
