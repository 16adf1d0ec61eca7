"""The cache side of one request: find reusable blocks, allocate the rest, label them;
afterwards register the full blocks by key and free the others.

Functions of the cache alone, used by :class:`contextkit.engine.engine.Engine` for every
request it serves from the cache.
"""

from __future__ import annotations

from collections.abc import Sequence

from contextkit.engine.types import CacheFullError, TokenSpan
from gpu_cache import PrefixPinManager, Tier, TQGPUCache
from gpu_cache.hashing import BlockHash

__all__ = ["close_sequence", "open_sequence"]


def open_sequence(cache: TQGPUCache, ids: Sequence[int], extra: int, tenant: str,
                  spans: Sequence[TokenSpan] | None, reuse: bool,
                  max_reuse: int | None = None,
                  ) -> tuple[list[int], list[int], list[BlockHash], int, int]:
    """Find reusable blocks (at most ``max_reuse`` tokens' worth) and allocate the
    rest; every block is acquired.

    Returns:
        ``(block_ids, new_ids, keys, cached_tokens, warmed_tokens)``: ``warmed_tokens``
        of the cached tokens were on the host tier and brought up by this call.

    Raises:
        CacheFullError: the device tier cannot hold the sequence; nothing changed.
    """
    bs = cache.block_size
    need = -(-(len(ids) + extra) // bs)
    capacity = cache.capacity(Tier.DEVICE)
    with cache.locked():
        keys = cache.block_keys(ids, tenant)
        hits = cache.lookup(keys, tenant) if reuse else []
        if max_reuse is not None:
            hits = hits[: max(0, max_reuse) // bs]
        pins = PrefixPinManager(cache)
        pins.release_idle(protect=hits)
        if need > capacity:
            raise CacheFullError(
                f"a request of {len(ids)} prompt + {extra} new tokens needs {need} blocks of "
                f"{bs} tokens, but the device tier holds {capacity}; raise "
                "num_device_blocks or shorten the prompt. Nothing cached was dropped")
        room = capacity - _pinned_outside(cache, hits)
        if need > room:
            # Pins are a cache, not a reservation: demote other tenants' (idle and
            # over-quota ones first) rather than fail this request.
            pins.reclaim(need - room, for_tenant=tenant, protect=hits)
            room = capacity - _pinned_outside(cache, hits)
        if need > room:
            raise CacheFullError(
                f"a request of {len(ids)} prompt + {extra} new tokens needs {need} blocks of "
                f"{bs} tokens, but only {room} of the device tier's {capacity} are not "
                "pinned; raise num_device_blocks or shorten the prompt. Nothing cached was "
                "dropped")
        cache.acquire(hits)
        host = [b for b in hits if cache.metadata.get(b).tier is Tier.HOST]
        if host and cache.warm_blocks(host) is None:
            # Could not bring them up: keep the device-resident run, recompute the rest.
            first = hits.index(host[0])
            cache.release(hits[first:])
            hits = hits[:first]
            host = []
        new = cache.allocate(need - len(hits), Tier.DEVICE, tenant=tenant,
                             source_layer="user_turn")
        if new is None:
            cache.release(hits)
            raise CacheFullError(
                f"could not free {need - len(hits)} device blocks for a {len(ids)}-token "
                "prompt (the rest are pinned or in use); raise num_device_blocks. Nothing "
                "cached was dropped")
        cache.acquire(new)
        block_ids = hits + new
        _annotate(cache, block_ids, len(hits), len(ids), tenant, spans)
        cache.metadata.chain(block_ids)  # what stays cached is a prefix
        cache.metadata.touch(hits)
    return block_ids, new, keys, len(hits) * bs, len(host) * bs


def _pinned_outside(cache: TQGPUCache, hits: Sequence[int]) -> int:
    """Pinned blocks other than ``hits`` (what a request cannot use)."""
    mine = set(hits)
    return sum(1 for m in cache.metadata.pinned() if m.block_id not in mine)


def _annotate(cache: TQGPUCache, block_ids: Sequence[int], first: int, prompt_len: int,
              tenant: str, spans: Sequence[TokenSpan] | None) -> None:
    bs = cache.block_size
    ordered = sorted(spans or (), key=lambda s: s.start)
    for j in range(first, len(block_ids)):
        lo, hi = j * bs, (j + 1) * bs
        layer, importance = "user_turn", 0.5
        best = 0
        for span in ordered:  # the span covering most of the block names it
            overlap = min(hi, span.end) - max(lo, span.start)
            if overlap > best:
                best, layer, importance = overlap, span.source_layer, span.importance
        cache.metadata.annotate(
            block_ids[j], source_layer=layer, importance=importance, token_range=(lo, hi),
            tenant_slug=tenant, num_tokens=max(0, min(bs, prompt_len - lo)))


def close_sequence(cache: TQGPUCache, block_ids: list[int], all_ids: Sequence[int],
                   written: int, tenant: str, keys: Sequence[BlockHash],
                   first_new: int) -> None:
    """Register the full written blocks by key, free the rest, drop references."""
    bs = cache.block_size
    full = written // bs
    if full > len(keys):  # blocks the reply filled: extend the key chain
        parent = keys[-1] if keys else None
        keys = [*keys, *cache.block_keys(list(all_ids[len(keys) * bs : full * bs]), tenant,
                                         parent=parent)]
    with cache.locked():
        cache.release(block_ids)
        drop = []
        for j in range(first_new, len(block_ids)):
            if j < full and not cache.lookup([keys[j]], tenant):
                cache.set_key(block_ids[j], keys[j])
                cache.metadata.annotate(block_ids[j], num_tokens=bs)
            else:  # a partial block, or an equal block already exists
                drop.append(block_ids[j])
        if drop:
            cache.remove_blocks(drop)
