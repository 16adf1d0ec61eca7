"""The cache side of one request: find reusable blocks, allocate the rest, label them;
afterwards register the full blocks by key and free the others.

Functions of the cache alone, used by :class:`contextkit.engine.engine.Engine` for every
request it serves from the cache; the block steps themselves are
:class:`gpu_cache.RequestBlockManager`'s, the engine's policy (pins give way, a full
device tier raises :class:`CacheFullError`) is here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from contextkit.engine.types import CacheFullError, TokenSpan
from gpu_cache import BlockAnnotation, PrefixPinManager, RequestBlockManager, Tier, TQGPUCache
from gpu_cache.hashing import BlockHash

__all__ = ["SequenceBlocks", "close_sequence", "open_sequence"]


@dataclass(slots=True)
class SequenceBlocks:
    """A request's blocks while it runs: what :func:`open_sequence` gives and
    :func:`close_sequence` takes back.

    Attributes:
        tenant: whose blocks these are (keys are salted with it).
        block_ids: the request's blocks in order, the reused prefix first; each holds
            one reference until :func:`close_sequence`.
        new_block_ids: those allocated for the request (the rest were reused).
        keys: the keys of the prompt's full blocks.
        cached_tokens: prompt tokens whose K/V was reused (reused blocks' tokens).
        warmed_tokens: of those, the tokens the open brought up from the host tier.
    """

    tenant: str
    block_ids: list[int]
    new_block_ids: list[int]
    keys: list[BlockHash]
    cached_tokens: int
    warmed_tokens: int

    @property
    def first_new_idx(self) -> int:
        """Index in ``block_ids`` of the first block allocated for the request."""
        return len(self.block_ids) - len(self.new_block_ids)


def open_sequence(cache: TQGPUCache, ids: Sequence[int], extra: int, tenant: str,
                  spans: Sequence[TokenSpan] | None, reuse: bool,
                  max_reuse: int | None = None) -> SequenceBlocks:
    """Find reusable blocks (at most ``max_reuse`` tokens' worth) and allocate the
    rest for ``ids`` plus ``extra`` new tokens; every block is acquired.

    Raises:
        CacheFullError: the device tier cannot hold the sequence; nothing changed.
    """
    bs = cache.block_size
    need = -(-(len(ids) + extra) // bs)
    capacity = cache.capacity(Tier.DEVICE)
    blocks = RequestBlockManager(cache)
    with cache.locked():
        keys = cache.block_keys(ids, tenant)
        max_blocks = None if max_reuse is None else max(0, max_reuse) // bs
        hits = blocks.lookup(keys, tenant, max_blocks=max_blocks) if reuse else []
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
        got = blocks.allocate(need, tenant, reuse=hits, source_layer="user_turn",
                              annotations=_annotations(bs, need, len(ids), spans), hold=True)
        if got is None:
            raise CacheFullError(
                f"could not free the device blocks a {len(ids)}-token prompt needs beyond "
                f"its {len(hits)} cached ones (the rest are pinned or in use); raise "
                "num_device_blocks. Nothing cached was dropped")
        cache.metadata.chain(got.block_ids)  # what stays cached is a prefix
    return SequenceBlocks(tenant=tenant, block_ids=got.block_ids,
                          new_block_ids=got.new_block_ids, keys=keys,
                          cached_tokens=got.num_reused * bs, warmed_tokens=got.num_warmed * bs)


def _pinned_outside(cache: TQGPUCache, hits: Sequence[int]) -> int:
    """Pinned blocks other than ``hits`` (what a request cannot use)."""
    mine = set(hits)
    return sum(1 for m in cache.metadata.pinned() if m.block_id not in mine)


def _annotations(bs: int, num_blocks: int, prompt_len: int,
                 spans: Sequence[TokenSpan] | None) -> list[BlockAnnotation]:
    """Per block: the layer and importance of the span covering most of it (else a
    user turn's), its token range and how many prompt tokens it holds."""
    ordered = sorted(spans or (), key=lambda s: s.start)
    out = []
    for j in range(num_blocks):
        lo, hi = j * bs, (j + 1) * bs
        layer, importance = "user_turn", 0.5
        best = 0
        for span in ordered:
            overlap = min(hi, span.end) - max(lo, span.start)
            if overlap > best:
                best, layer, importance = overlap, span.source_layer, span.importance
        out.append(BlockAnnotation(source_layer=layer, importance=importance,
                                   token_range=(lo, hi),
                                   num_tokens=max(0, min(bs, prompt_len - lo))))
    return out


def close_sequence(cache: TQGPUCache, seq: SequenceBlocks, all_ids: Sequence[int],
                   written: int) -> None:
    """Register the full written blocks of ``seq`` by key, free the rest, drop references.

    Args:
        cache: the cache :func:`open_sequence` opened ``seq`` in.
        seq: the open sequence.
        all_ids: the prompt plus the tokens generated after it.
        written: tokens of ``all_ids`` whose K/V is in the blocks.
    """
    bs = cache.block_size
    tenant, block_ids, keys = seq.tenant, seq.block_ids, list(seq.keys)
    full = written // bs
    if full > len(keys):  # blocks the reply filled: extend the key chain
        parent = keys[-1] if keys else None
        keys += cache.block_keys(list(all_ids[len(keys) * bs : full * bs]), tenant,
                                 parent=parent)
    first = seq.first_new_idx
    # new blocks from ``done`` on are partial (or were never written)
    done = min(len(block_ids), max(first, full))
    with cache.locked():
        cache.release(block_ids)
        # an equal block already cached keeps its key; this one is dropped
        drop = set(RequestBlockManager(cache).set_keys(block_ids[first:done], keys[first:done],
                                                       tenant=tenant))
        drop.update(block_ids[done:])
        if drop:
            cache.remove_blocks([b for b in block_ids[first:] if b in drop])
