"""Content of the prompt's ``memories`` layer from the memory graph."""

from __future__ import annotations

from memory_graph.graph import DEFAULT_TENANT, MemoryGraph

__all__ = ["memories_layer_lines"]


def memories_layer_lines(
    graph: MemoryGraph,
    query: str,
    tenant: str = DEFAULT_TENANT,
    k: int = 10,
    hops: int = 1,
) -> list[tuple[str, float]]:
    """Lines for the ``memories`` prompt layer: ``(text, importance)``, best first.

    Runs :meth:`MemoryGraph.hybrid_query`; importance is the rerank score scaled
    so the best hit is 1.0 (always within [0, 1]), ready for
    ``synthesize_for_budget``. Reserve KV for the same hits with
    :meth:`GraphBlockReserver.reserve`.
    """
    hits = graph.hybrid_query(query, k, hops, tenant)
    if not hits:
        return []
    top = max(h.score for h in hits)
    if top <= 0:
        return [(h.text, 0.0) for h in hits]
    return [(h.text, min(1.0, max(0.0, h.score / top))) for h in hits]
