"""The connector store's side of the shared tier: its blocks out as chunks, chunks in as
blocks (a mixin of :class:`integrations.vllm.store.ConnectorStore`, which owns the
pools and the index).

A chunk carries each block's stored bytes as they are (no decode, no re-encode) with
its pool's identity: its format and, for formats with key offsets, the offsets
themselves. A replica importing it puts the blocks into its pool of that identity,
made on first use as the startup recovery does, so blocks calibrated on another
replica load exactly as they would there.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from gpu_cache import (
    BlockStateError,
    CacheIdentity,
    InvalidNameError,
    PinCapacityError,
    validate_tenant,
)
from gpu_cache.hashing import BlockHash
from integrations.vllm.metrics import StatsRecorder
from integrations.vllm.pools import Pool, fit_budget, held_bytes
from shadow.shared.objects import BlockEntry, PoolPart, SharedChunk

__all__ = ["SharedBlocks", "tenant_slug"]


def tenant_slug(cache_salt: str) -> str:
    """The cache tenant of a vLLM ``cache_salt``: the salt itself when it follows
    contextkit's naming rule (as the pipeline's tenants do), else a stable digest of
    it. vLLM allows any salt; block keys are salted with the raw salt either way."""
    try:
        return validate_tenant(cache_salt)
    except InvalidNameError:
        return "salt-" + hashlib.sha256(cache_salt.encode()).hexdigest()[:40]


class SharedBlocks:
    """Export held blocks as a shared chunk; import a fetched chunk's blocks."""

    identity: CacheIdentity
    pools: dict[str, Pool]
    stats: StatsRecorder
    _lock: threading.RLock
    _ids: dict[bytes, tuple[Pool, int]]
    _sources: dict[bytes, str | None]

    if TYPE_CHECKING:  # provided by ConnectorStore
        def _pool(self, identity: CacheIdentity, offsets: torch.Tensor | None) -> Pool: ...

        @property
        def _budget(self) -> int: ...

        def _forget_evicted(self) -> tuple[list[bytes], list[str | None]]: ...

    def export_chunk(self, keys: Sequence[bytes], tenant: str, path: str
                     ) -> SharedChunk | None:
        """The held blocks ``keys`` (of ``tenant``'s slug) as the chunk named ``path``;
        None when any of them is no longer held (evicted since it was saved)."""
        slug = tenant_slug(tenant)
        by_pool: dict[str, tuple[Pool, list[int], list[int]]] = {}
        entries: list[BlockEntry] = []
        with self._lock:
            for i, key in enumerate(keys):
                entry = self._ids.get(key)
                if entry is None:
                    return None
                pool, bid = entry
                if pool.cache.lookup([BlockHash(key)], slug) != [bid]:
                    return None
                meta = pool.cache.metadata.get(bid)
                entries.append(BlockEntry(key, meta.source_layer, meta.importance,
                                          meta.pinned))
                part = by_pool.setdefault(pool.name, (pool, [], []))
                part[1].append(i)
                part[2].append(bid)
            parts = []
            for pool, positions, bids in by_pool.values():
                with pool.cache.locked():
                    tensors = pool.cache.export_blocks(bids, block_major=True)
                parts.append(PoolPart(pool.identity, positions, tensors,
                                      pool.cache.key_offsets))
        return SharedChunk(path, self.identity, tenant, entries, parts)

    def held_bytes(self) -> int:
        """Bytes the DDR tier holds (every pool)."""
        with self._lock:
            return held_bytes(list(self.pools.values()))

    def missing(self, keys: Iterable[bytes]) -> set[bytes]:
        """The keys of ``keys`` the store does not hold."""
        with self._lock:
            return {key for key in keys if key not in self._ids}

    def import_chunk(self, chunk: SharedChunk, want: Sequence[bytes]
                     ) -> tuple[list[bytes], list[bytes]]:
        """Store the blocks of ``chunk`` whose keys are in ``want`` and not held yet, in
        the pool of their identity, making room as a save does. Returns the keys held
        afterwards (imported now or before), in the chunk's order, and the keys evicted
        to make room."""
        wanted = set(want)
        slug = tenant_slug(chunk.tenant)
        held: list[bytes] = []
        imported = 0
        with self._lock:
            for part in chunk.parts:
                pool = self._pool(part.identity, part.key_offsets)
                rows = [j for j, pos in enumerate(part.positions)
                        if chunk.blocks[pos].key in wanted
                        and chunk.blocks[pos].key not in self._ids]
                held += [chunk.blocks[pos].key for pos in part.positions
                         if chunk.blocks[pos].key in wanted and chunk.blocks[pos].key in self._ids]
                if not rows:
                    continue
                if not fit_budget(list(self.pools.values()), pool, len(rows), self._budget):
                    continue
                sel = torch.tensor(rows, dtype=torch.int64)
                tensors = {name: t.index_select(0, sel) for name, t in part.tensors.items()}
                bs = self.identity.block_size
                metas: list[dict[str, object]] = []
                for j in rows:
                    block = chunk.blocks[part.positions[j]]
                    metas.append({"source_layer": block.source_layer,
                                  "importance": block.importance, "tenant_slug": slug,
                                  "key": block.key, "num_tokens": bs})
                with pool.cache.locked():
                    ids = pool.cache.import_blocks(tensors, metas, pool.save_tier,
                                                   block_major=True)
                if ids is None:
                    continue
                pool.dirty = True
                pinned = []
                for bid, j in zip(ids, rows, strict=True):
                    block = chunk.blocks[part.positions[j]]
                    self._ids[block.key] = (pool, bid)
                    self._sources[block.key] = block.source_layer
                    held.append(block.key)
                    if block.pinned:
                        pinned.append(bid)
                if pinned:  # pinned where it was written: pinned here too, quota allowing
                    with contextlib.suppress(PinCapacityError, BlockStateError):
                        pool.pins.pin(pinned)
                imported += len(ids)
            self.stats.count("shared_imported_blocks", imported)
            removed, _ = self._forget_evicted()
        order = {b.key: i for i, b in enumerate(chunk.blocks)}
        return sorted(set(held) - set(removed), key=order.__getitem__), removed
