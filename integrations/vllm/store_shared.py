"""The connector store's side of the shared tier: its blocks out as chunks, chunks in as
blocks. :class:`SharedBlocks` is held by :class:`integrations.vllm.store.ConnectorStore`,
which owns the pools and the index and reaches them to it through the
:class:`BlockIndex` interface.

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
from collections.abc import Sequence
from typing import Protocol

import torch

from gpu_cache import (
    BlockStateError,
    CacheIdentity,
    InvalidNameError,
    PinCapacityError,
    validate_tenant,
)
from gpu_cache.hashing import BlockHash
from integrations.vllm.pools import Pool, fit_budget
from shadow.shared.objects import BlockEntry, PoolPart, SharedChunk

__all__ = ["BlockIndex", "SharedBlocks", "tenant_slug"]


def tenant_slug(cache_salt: str) -> str:
    """The cache tenant of a vLLM ``cache_salt``: the salt itself when it follows
    contextkit's naming rule (as the pipeline's tenants do), else a stable digest of
    it. vLLM allows any salt; block keys are salted with the raw salt either way."""
    try:
        return validate_tenant(cache_salt)
    except InvalidNameError:
        return "salt-" + hashlib.sha256(cache_salt.encode()).hexdigest()[:40]


class BlockIndex(Protocol):
    """What :class:`SharedBlocks` needs of the store that owns the pools and the index
    (every method but :meth:`pool` and :attr:`budget` with the store's lock held)."""

    pools: dict[str, Pool]

    @property
    def budget(self) -> int:
        """The DDR byte budget of all pools together."""
        ...

    def pool(self, identity: CacheIdentity, offsets: torch.Tensor | None) -> Pool:
        """The pool of ``identity``, made if new."""
        ...

    def entry(self, key: bytes) -> tuple[Pool, int] | None:
        """The pool and block id holding ``key``; None when not held."""
        ...

    def index_block(self, key: bytes, pool: Pool, bid: int, source_layer: str | None) -> None:
        """Record that block ``bid`` of ``pool`` holds ``key``."""
        ...

    def forget_evicted(self) -> tuple[list[bytes], list[str | None]]:
        """Forget the blocks the pools evicted; their keys and layers."""
        ...


class SharedBlocks:
    """Export held blocks as a shared chunk; import a fetched chunk's blocks.

    Args:
        index: the store owning the pools and the block index.
        identity: the key identity (a chunk records it).
        lock: the store's lock, guarding the pools and the index.
    """

    def __init__(self, index: BlockIndex, identity: CacheIdentity,
                 lock: threading.RLock) -> None:
        self._index = index
        self.identity = identity
        self._lock = lock

    def export_chunk(self, keys: Sequence[bytes], tenant: str, path: str
                     ) -> SharedChunk | None:
        """The held blocks ``keys`` (of ``tenant``'s slug) as the chunk named ``path``;
        None when any of them is no longer held (evicted since it was saved)."""
        slug = tenant_slug(tenant)
        by_pool: dict[str, tuple[Pool, list[int], list[int]]] = {}
        entries: list[BlockEntry] = []
        with self._lock:
            for i, key in enumerate(keys):
                entry = self._index.entry(key)
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

    def import_chunk(self, chunk: SharedChunk, want: Sequence[bytes]
                     ) -> tuple[list[bytes], list[bytes]]:
        """Store the blocks of ``chunk`` whose keys are in ``want`` and not held yet, in
        the pool of their identity, making room as a save does. Returns the keys held
        afterwards (imported now or before), in the chunk's order, and the keys evicted
        to make room."""
        wanted = set(want)
        slug = tenant_slug(chunk.tenant)
        held: list[bytes] = []
        with self._lock:
            for part in chunk.parts:
                pool = self._index.pool(part.identity, part.key_offsets)
                rows = [j for j, pos in enumerate(part.positions)
                        if chunk.blocks[pos].key in wanted
                        and self._index.entry(chunk.blocks[pos].key) is None]
                held += [chunk.blocks[pos].key for pos in part.positions
                         if chunk.blocks[pos].key in wanted
                         and self._index.entry(chunk.blocks[pos].key) is not None]
                if not rows:
                    continue
                if not fit_budget(list(self._index.pools.values()), pool, len(rows),
                                  self._index.budget):
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
                    self._index.index_block(block.key, pool, bid, block.source_layer)
                    held.append(block.key)
                    if block.pinned:
                        pinned.append(bid)
                if pinned:  # pinned where it was written: pinned here too, quota allowing
                    with contextlib.suppress(PinCapacityError, BlockStateError):
                        pool.pins.pin(pinned)
            removed, _ = self._index.forget_evicted()
        order = {b.key: i for i, b in enumerate(chunk.blocks)}
        return sorted(set(held) - set(removed), key=order.__getitem__), removed
