"""Precision that follows the DDR budget: what the store keeps above the policy's format.

A block whose label carries a ``room_fmt`` (the policy's
:attr:`~integrations.vllm.precision.PrecisionPolicy.room_format`, above the format the
rules gave it) is stored in that format while the whole save fits the store's byte
budget. When a later save needs room, such "upgraded" blocks are transcoded back to
their rules' format, lowest eviction priority first, before anything is evicted
(:meth:`integrations.vllm.store.ConnectorStore.save`). This module holds the
decisions; the store does the transcoding, since it owns the pools and the keys.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

from gpu_cache import Tier
from gpu_cache.metadata import BlockMeta
from integrations.vllm.pools import Pool
from integrations.vllm.precision import BlockLabel

__all__ = ["demotion_candidates", "room_formats"]


def room_formats(labels: Sequence[BlockLabel], new: Sequence[int], held: int, budget: int,
                 block_bytes: Callable[[str], int]) -> dict[int, str]:
    """Blocks ``new`` (indexes into ``labels``) to store above their format: every
    unpinned one whose label has a ``room_fmt`` when the save fits ``budget`` bytes that
    way on top of ``held`` without evicting or transcoding anything; else none (``{}``).

    Pinned blocks keep their format: a pin is never transcoded down, so the room format
    would hold it for good, in a wider pool whose pin quota counts fewer blocks.

    ``block_bytes(fmt)`` is one block's bytes in ``fmt``.
    """
    ups: dict[int, str] = {}
    for i in new:
        room = labels[i].room_fmt
        if room is not None and room != labels[i].fmt and not labels[i].pinned:
            ups[i] = room
    if not ups or held + sum(block_bytes(ups.get(i, labels[i].fmt)) for i in new) > budget:
        return {}
    return ups


def demotion_candidates(pools: Sequence[Pool], upgraded: Collection[bytes],
                        protect: Mapping[int, Collection[int]]
                        ) -> list[tuple[Pool, BlockMeta]]:
    """Upgraded blocks of the DDR tier that may be transcoded now, first to go first:
    the eviction policy's order across pools (pinned and in-use blocks are never
    candidates, nor ``protect``'s: ``id(pool)`` -> block ids of the save in progress)."""
    found = []
    for pool in pools:
        policy = pool.cache.policy
        for meta in pool.cache.metadata.eviction_order(Tier.HOST, policy,
                                                       exclude=protect.get(id(pool), ())):
            if meta.key is not None and bytes(meta.key) in upgraded:
                found.append((policy.priority(meta), pool, meta))
    found.sort(key=lambda c: c[0])  # stable: ties keep each pool's own order
    return [(pool, meta) for _, pool, meta in found]
