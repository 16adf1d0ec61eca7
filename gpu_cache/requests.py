"""A request's blocks in a :class:`~gpu_cache.cache.TQGPUCache`: one facade for callers.

Every caller that gives a request (a prompt, a vLLM save, a memory reservation) its
blocks composes the same steps: find the longest cached prefix of its block keys,
allocate the rest, label the new blocks (layer, importance, token range) and, once
their K/V is written, register the full ones under their keys.
:class:`RequestBlockManager` does those steps under the cache's lock and hands back a
:class:`RequestBlocks`, or ``None`` when the tier cannot make room (nothing changed).
Policy stays with the caller: what to reclaim first, what to raise on no room.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpu_cache.cache import TQGPUCache
from gpu_cache.hashing import BlockHash
from gpu_cache.metadata import Tier

__all__ = ["BlockAnnotation", "RequestBlockManager", "RequestBlocks"]


@dataclass(frozen=True, slots=True)
class BlockAnnotation:
    """Metadata a new block gets; ``None`` keeps what the allocation gave it."""

    source_layer: str | None = None
    importance: float | None = None
    token_range: tuple[int, int] | None = None
    num_tokens: int | None = None


@dataclass(slots=True)
class RequestBlocks:
    """The blocks :meth:`RequestBlockManager.allocate` gave one request.

    Attributes:
        block_ids: the request's blocks in order: the reused prefix, then the new ones.
        num_reused: leading blocks found cached and kept (their K/V is not recomputed).
        num_warmed: of those, how many this call brought up from the host tier.
        tier: where the new blocks were allocated.
    """

    block_ids: list[int]
    num_reused: int
    num_warmed: int
    tier: Tier

    @property
    def reused_block_ids(self) -> list[int]:
        """The cached prefix kept for the request."""
        return self.block_ids[: self.num_reused]

    @property
    def new_block_ids(self) -> list[int]:
        """The blocks allocated for the request (their K/V still to be written)."""
        return self.block_ids[self.num_reused :]

    @property
    def num_new(self) -> int:
        """How many blocks were allocated."""
        return len(self.block_ids) - self.num_reused


class RequestBlockManager:
    """Look up, allocate, label and key the blocks of requests in one cache.

    Args:
        cache: the tiered cache the blocks live in.
    """

    def __init__(self, cache: TQGPUCache) -> None:
        self.cache = cache

    def lookup(self, keys: Sequence[BlockHash], tenant: str, *,
               max_blocks: int | None = None) -> list[int]:
        """Block ids of the longest prefix of ``keys`` held for ``tenant`` (any tier),
        at most ``max_blocks`` of them.

        Raises:
            InvalidNameError: ``tenant`` breaks the naming rule of :mod:`gpu_cache.ids`.
        """
        hits = self.cache.lookup(keys, tenant)
        return hits if max_blocks is None else hits[: max(0, max_blocks)]

    def allocate(self, num_blocks: int, tenant: str, *, reuse: Sequence[int] = (),
                 tier: Tier = Tier.DEVICE, source_layer: str = "unassigned",
                 importance: float = 0.5,
                 annotations: Sequence[BlockAnnotation] | None = None,
                 hold: bool = False) -> RequestBlocks | None:
        """Give a request of ``num_blocks`` blocks the cached prefix ``reuse`` plus new ones.

        Reused blocks on the host tier are warmed to the device tier when ``tier`` is
        the device; if they cannot be, the request keeps the reused run before the
        first of them and allocates the rest. Reused blocks count as attended now.

        Args:
            num_blocks: blocks the request needs in all, reused ones included.
            tenant: owner of the new blocks.
            reuse: a cached prefix of the request (e.g. from :meth:`lookup`).
            tier: where new blocks go (making room may evict by priority).
            source_layer: the layer new blocks are allocated with.
            importance: the importance new blocks are allocated with.
            annotations: per request position (``num_blocks`` of them): what the new
                block at that position is labelled with; reused positions are skipped.
            hold: leave one reference on every returned block (protects it from
                eviction until :meth:`TQGPUCache.release`).

        Returns:
            The request's blocks, or ``None`` when ``tier`` cannot make room (nothing
            changed, no reference left).

        Raises:
            ValueError: ``reuse`` longer than ``num_blocks``, or ``annotations`` not
                one per block.
            InvalidNameError: ``tenant`` breaks the naming rule of :mod:`gpu_cache.ids`.
        """
        hits = list(reuse)
        if len(hits) > num_blocks:
            raise ValueError(f"{len(hits)} reused blocks for a request of {num_blocks}; "
                             "reuse at most the blocks the request needs")
        if annotations is not None and len(annotations) != num_blocks:
            raise ValueError(f"{len(annotations)} annotations for {num_blocks} blocks; give "
                             "one per block of the request")
        cache = self.cache
        with cache.locked():
            cache.acquire(hits)  # allocating must not evict the prefix it extends
            host = [b for b in hits if cache.metadata.get(b).tier is Tier.HOST]
            if host and tier is Tier.DEVICE and cache.warm_blocks(host) is None:
                # Could not bring them up: keep the device-resident run, recompute the rest.
                first = hits.index(host[0])
                cache.release(hits[first:])
                hits = hits[:first]
                host = []
            new = cache.allocate(num_blocks - len(hits), tier, tenant=tenant,
                                 source_layer=source_layer, importance=importance)
            if new is None:
                cache.release(hits)
                return None
            if hold:
                cache.acquire(new)
            else:
                cache.release(hits)
            if annotations is not None:
                for bid, note in zip(new, annotations[len(hits):], strict=True):
                    cache.metadata.annotate(
                        bid, source_layer=note.source_layer, importance=note.importance,
                        token_range=note.token_range, num_tokens=note.num_tokens)
            cache.metadata.touch(hits)
            warmed = len(host) if tier is Tier.DEVICE else 0
            return RequestBlocks(block_ids=hits + new, num_reused=len(hits),
                                 num_warmed=warmed, tier=tier)

    def set_keys(self, block_ids: Sequence[int], keys: Sequence[BlockHash], *,
                 tenant: str | None = None) -> list[int]:
        """Register full blocks under their content keys (later lookups find them).

        Each registered block's ``num_tokens`` becomes the block size.

        Args:
            block_ids: the blocks, their K/V written.
            keys: one key per block.
            tenant: keep the blocks ``tenant`` already holds: a block whose key is held
                is not registered (an equal block exists). ``None``: every block is
                registered; a key held already moves to the new block.

        Returns:
            The ids not registered, in the order given (free or keep them).

        Raises:
            ValueError: not one key per block.
        """
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} blocks; give one key "
                             "per block")
        cache = self.cache
        skipped = []
        with cache.locked():
            for bid, key in zip(block_ids, keys, strict=True):
                if tenant is not None and cache.lookup([key], tenant):
                    skipped.append(bid)
                    continue
                cache.set_key(bid, key)
                cache.metadata.annotate(bid, num_tokens=cache.block_size)
        return skipped
