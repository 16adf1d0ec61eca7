"""A pipeline call's blocks registered with the tier manager (used by
:class:`~contextkit.pipeline.pipeline.CacheAwareContextPipeline` built with ``tiers=``).

After each ``generate`` the call's full, keyed blocks of its tenant are grouped into
runs of one source layer (the cache's block metadata), in prompt order, and handed to
:meth:`ContextTierManager.register_segments
<contextkit.loop.tiers.ContextTierManager.register_segments>`
as ``(layer, importance, block_ids)`` segments, the importance of a run being the
highest of its blocks'. The manager then knows every agent's blocks: which layer they
hold, how important they are, and which agents use them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gpu_cache import TQGPUCache

#: One segment: (source layer, importance, block ids in prompt order).
Segment = tuple[str, float, list[int]]


class SegmentRegistry(Protocol):
    """What the pipeline needs of a tier manager
    (:class:`~contextkit.loop.tiers.ContextTierManager` implements it)."""

    def register_segments(self, agent: str, tenant: str,
                          segments: Sequence[tuple[str, float, Sequence[int]]]) -> list[str]:
        ...


def call_segments(cache: TQGPUCache, tenant: str, block_ids: Sequence[int]) -> list[Segment]:
    """The call's full, keyed blocks of ``tenant`` as runs of one source layer, in
    prompt order (blocks the engine dropped, partial or duplicate, are left out)."""
    segments: list[Segment] = []
    with cache.locked():
        for bid in block_ids:
            if bid not in cache.metadata:
                continue
            meta = cache.metadata.get(bid)
            if meta.key is None or meta.tenant_slug != tenant:
                continue
            if segments and segments[-1][0] == meta.source_layer:
                layer, importance, ids = segments[-1]
                ids.append(bid)
                segments[-1] = (layer, max(importance, meta.importance), ids)
            else:
                segments.append((meta.source_layer, meta.importance, [bid]))
    return segments


def register_call(tiers: SegmentRegistry, cache: TQGPUCache, agent: str, tenant: str,
                  block_ids: Sequence[int]) -> int:
    """Register one call's blocks; returns how many tier items it touched."""
    segments = call_segments(cache, tenant, block_ids)
    if not segments:
        return 0
    return len(tiers.register_segments(agent, tenant, segments))
