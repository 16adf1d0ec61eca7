"""PrefixPinManager: keep stable prompt prefixes in the device tier for good."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from gpu_cache._errors import BlockStateError, PinCapacityError
from gpu_cache.cache import TQGPUCache
from gpu_cache.metadata import PINNABLE_SOURCES, Tier

__all__ = ["PrefixPinManager"]

logger = logging.getLogger(__name__)


class PrefixPinManager:
    """Pins blocks of stable layers (axioms, identity, rules, capabilities, soul).

    Pinned blocks get priority 999, are warmed into the device tier if needed, and
    are never spilled or evicted until unpinned. Pinning more than the device tier
    holds fails as a whole, leaving every existing pin in place.
    """

    def __init__(self, cache: TQGPUCache, pinnable_sources: frozenset[str] = PINNABLE_SOURCES):
        self.cache = cache
        self.pinnable_sources = pinnable_sources

    def pin(self, block_ids: Sequence[int]) -> list[int]:
        """Pin blocks; returns the ids newly pinned.

        Raises:
            BlockStateError: a block's source layer is not pinnable.
            PinCapacityError: pins would exceed the device tier, or the device tier
                cannot make room for the blocks still in the host tier.
        """
        cache = self.cache
        with cache._lock:
            metas = [cache.metadata.get(b) for b in cache._checked(block_ids)]
            for meta in metas:
                if meta.source_layer not in self.pinnable_sources:
                    raise BlockStateError(
                        f"block {meta.block_id} comes from layer {meta.source_layer!r}, which is "
                        f"not pinnable (pinnable: {sorted(self.pinnable_sources)}); pin only "
                        "stable-prefix blocks"
                    )
            new = [m for m in metas if not m.pinned]
            already = len(cache.metadata.pinned())
            capacity = cache.capacity(Tier.DEVICE)
            if already + len(new) > capacity:
                raise PinCapacityError(
                    f"pinning {len(new)} more blocks would make {already + len(new)} pinned "
                    f"blocks, but the device tier holds {capacity}; raise num_device_blocks "
                    "or shorten the stable prefix. No pin was changed."
                )
            on_host = [m.block_id for m in new if m.tier is Tier.HOST]
            if on_host and cache.warm_blocks(on_host) is None:
                raise PinCapacityError(
                    f"the device tier cannot make room for {len(on_host)} blocks to pin (the "
                    "rest is pinned or in use); release blocks or raise num_device_blocks. "
                    "No pin was changed."
                )
            for meta in new:
                cache.set_pinned(meta.block_id, True)
            if new:
                logger.debug("pinned %d blocks (%d pinned in all)", len(new), already + len(new))
            return [m.block_id for m in new]

    def unpin(self, block_ids: Sequence[int]) -> None:
        """Unpin blocks; their priority returns to that of their source layer."""
        cache = self.cache
        with cache._lock:
            for bid in cache._checked(block_ids):
                cache.set_pinned(bid, False)

    def pinned_ids(self) -> list[int]:
        return sorted(m.block_id for m in self.cache.metadata.pinned())

    @property
    def num_pinned(self) -> int:
        return len(self.cache.metadata.pinned())
