"""Semantic block metadata and eviction policies.

Every allocated block carries where its tokens came from (prompt layer), how
important they are, who owns them, and where the bytes live. Eviction sorts by a
policy's ``priority(meta)`` tuple, lowest first; the semantic policy orders by the
block's *effective* layer priority and importance, then last attention, then the
newest block first.

A block is worth no more than the blocks before it in its prompt, since a cached
block is reusable only behind its whole cached prefix. :meth:`BlockMetadataTable.chain`
records a prompt's blocks in order; a block's effective priority (importance) is then
the lowest layer priority (importance) of itself and every block before it, so a
low-priority layer in the middle of a prompt is kept as long as the blocks after it,
the tail goes first, and what stays cached is always a prefix.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from gpu_cache._errors import UnknownBlockError
from gpu_cache.hashing import BlockHash

__all__ = [
    "DEFAULT_SOURCE_PRIORITY",
    "EVICTION_POLICIES",
    "PINNABLE_SOURCES",
    "PINNED_PRIORITY",
    "BlockMeta",
    "BlockMetadataTable",
    "EvictionPolicy",
    "LRUEvictionPolicy",
    "SemanticEvictionPolicy",
    "Tier",
]

PINNED_PRIORITY = 999

#: Eviction priority by source layer; lower is evicted first. Stable layers are reused
#: on every call; the conversation (``user_turn``) on the next; the volatile layers
#: (affect, awareness, system state, time) change on most calls, so their blocks go first.
DEFAULT_SOURCE_PRIORITY: Mapping[str, int] = {
    "axioms": 100,
    "identity": 90,
    "rules": 85,
    "capabilities": 80,
    "soul": 75,
    "partner": 55,
    "neurons": 40,
    "memories": 35,
    "user_turn": 15,
    "affect": 14,
    "awareness": 13,
    "system_state": 12,
    "current_time": 10,
}

PINNABLE_SOURCES = frozenset({"axioms", "identity", "rules", "capabilities", "soul"})


class Tier(enum.Enum):
    """Where a block's bytes live."""

    DEVICE = "device"  # accelerator memory ("VRAM"); CPU memory when there is none
    HOST = "host"  # pinned host memory ("DDR")


@dataclass(slots=True)
class BlockMeta:
    """Semantic and physical state of one block."""

    block_id: int
    source_layer: str
    importance: float
    created_at: float
    last_attended: float
    eviction_priority: int
    token_range: tuple[int, int]
    tenant_slug: str
    tier: Tier
    slot: int
    key: BlockHash | None = None
    pinned: bool = False
    ref_count: int = 0
    num_tokens: int = 0
    pinned_at: float = 0.0
    # lowest layer priority / importance of the blocks before this one in its prompt
    prefix_priority: float = math.inf
    prefix_importance: float = 1.0

    @property
    def evictable(self) -> bool:
        return not self.pinned and self.ref_count == 0

    @property
    def last_active(self) -> float:
        """When the block was last attended or pinned (what a pin's idle TTL counts from)."""
        return max(self.last_attended, self.pinned_at)


class EvictionPolicy(Protocol):
    """Strategy: blocks with the smallest ``priority`` tuple are evicted first."""

    name: str

    def priority(self, meta: BlockMeta) -> tuple[float, ...]: ...


class SemanticEvictionPolicy:
    """Effective source-layer priority, then effective importance (the lowest of the
    block and the blocks before it in its prompt), then last attention, then the
    newest block first (within one request: the tail of the prompt first)."""

    name = "semantic"

    def priority(self, meta: BlockMeta) -> tuple[float, ...]:
        return (min(meta.eviction_priority, meta.prefix_priority),
                min(meta.importance, meta.prefix_importance), meta.last_attended,
                -meta.block_id)


class LRUEvictionPolicy:
    """Least recently attended first, whatever the content (for comparison)."""

    name = "lru"

    def priority(self, meta: BlockMeta) -> tuple[float, ...]:
        return (meta.last_attended, meta.created_at)


EVICTION_POLICIES: dict[str, EvictionPolicy] = {
    "semantic": SemanticEvictionPolicy(),
    "lru": LRUEvictionPolicy(),
}


class BlockMetadataTable:
    """Block id -> :class:`BlockMeta`, with the queries eviction and pinning need.

    Args:
        default_priority: priority of source layers missing from ``priorities``.
        priorities: override of :data:`DEFAULT_SOURCE_PRIORITY`.
    """

    def __init__(self, default_priority: int = 50,
                 priorities: Mapping[str, int] | None = None) -> None:
        self.default_priority = default_priority
        self.priorities = dict(DEFAULT_SOURCE_PRIORITY if priorities is None else priorities)
        self._metas: dict[int, BlockMeta] = {}
        self._lock = threading.RLock()

    def priority_for(self, source_layer: str) -> int:
        return self.priorities.get(source_layer, self.default_priority)

    def __len__(self) -> int:
        return len(self._metas)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._metas

    def add(self, meta: BlockMeta) -> None:
        with self._lock:
            self._metas[meta.block_id] = meta

    def get(self, block_id: int) -> BlockMeta:
        try:
            return self._metas[block_id]
        except KeyError:
            raise UnknownBlockError(
                f"block {block_id} is not in the cache (never allocated, or already freed); "
                "allocate it first or look it up by key"
            ) from None

    def pop(self, block_id: int) -> BlockMeta:
        with self._lock:
            meta = self.get(block_id)
            del self._metas[block_id]
            return meta

    def annotate(
        self,
        block_id: int,
        *,
        source_layer: str | None = None,
        importance: float | None = None,
        token_range: tuple[int, int] | None = None,
        tenant_slug: str | None = None,
        num_tokens: int | None = None,
    ) -> BlockMeta:
        """Set semantic fields of a block; the priority follows the source layer."""
        with self._lock:
            meta = self.get(block_id)
            if source_layer is not None:
                meta.source_layer = source_layer
                if not meta.pinned:
                    meta.eviction_priority = self.priority_for(source_layer)
            if importance is not None:
                if not 0.0 <= importance <= 1.0:
                    raise ValueError(f"importance must be within [0, 1], got {importance}")
                meta.importance = float(importance)
            if token_range is not None:
                meta.token_range = (int(token_range[0]), int(token_range[1]))
            if tenant_slug is not None:
                meta.tenant_slug = tenant_slug
            if num_tokens is not None:
                meta.num_tokens = int(num_tokens)
            return meta

    def chain(self, block_ids: Iterable[int]) -> None:
        """Record ``block_ids`` as one prompt's blocks, in prompt order: each block's
        effective priority and importance become at most those of the blocks before it.

        Pinned blocks count with their layer's priority (what they fall back to when
        unpinned). A block shared by several prompts has the same blocks before it in
        each (block keys chain the whole prefix), so the order agrees.
        """
        with self._lock:
            priority, importance = math.inf, 1.0
            for bid in block_ids:
                meta = self.get(bid)
                meta.prefix_priority, meta.prefix_importance = priority, importance
                priority = min(priority, self.priority_for(meta.source_layer))
                importance = min(importance, meta.importance)

    def effective(self, block_id: int) -> tuple[float, float]:
        """``(priority, importance)`` the semantic policy evicts ``block_id`` by (its
        pin aside)."""
        with self._lock:
            meta = self.get(block_id)
            return (min(self.priority_for(meta.source_layer), meta.prefix_priority),
                    min(meta.importance, meta.prefix_importance))

    def touch(self, block_ids: Iterable[int], now: float | None = None) -> None:
        """Record that attention read these blocks."""
        stamp = time.time() if now is None else now
        with self._lock:
            for bid in block_ids:
                self.get(bid).last_attended = stamp

    def all(self) -> list[BlockMeta]:
        with self._lock:
            return list(self._metas.values())

    def in_tier(self, tier: Tier) -> list[BlockMeta]:
        with self._lock:
            return [m for m in self._metas.values() if m.tier is tier]

    def pinned(self, tenant: str | None = None) -> list[BlockMeta]:
        """Pinned blocks (of one tenant when given)."""
        with self._lock:
            return [m for m in self._metas.values()
                    if m.pinned and (tenant is None or m.tenant_slug == tenant)]

    def of_tenant(self, tenant: str) -> list[BlockMeta]:
        """Every block of one tenant, in any tier."""
        with self._lock:
            return [m for m in self._metas.values() if m.tenant_slug == tenant]

    def eviction_order(self, tier: Tier, policy: EvictionPolicy,
                       exclude: Iterable[int] = ()) -> list[BlockMeta]:
        """Evictable blocks of ``tier``, first to evict first; pinned and in-use excluded."""
        skip = set(exclude)
        with self._lock:
            candidates = [m for m in self._metas.values()
                          if m.tier is tier and m.evictable and m.block_id not in skip]
        candidates.sort(key=policy.priority)
        return candidates
