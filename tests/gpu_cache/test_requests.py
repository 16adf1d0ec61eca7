"""RequestBlockManager: a request's cached prefix, new blocks, labels and keys."""

from __future__ import annotations

import pytest

from gpu_cache import (
    BlockAnnotation,
    CacheConfig,
    CacheIdentity,
    RequestBlockManager,
    RequestBlocks,
    Tier,
    TQGPUCache,
)
from gpu_cache.config import NO_PIN_QUOTA

BS = 4


def make_cache(device_blocks: int = 8, host_blocks: int = 8) -> TQGPUCache:
    identity = CacheIdentity("test-model", num_layers=2, num_kv_heads=2, head_dim=8,
                             block_size=BS)
    return TQGPUCache(identity, CacheConfig(num_device_blocks=device_blocks,
                                            num_host_blocks=host_blocks, pins=NO_PIN_QUOTA))


def cached_prefix(cache: TQGPUCache, tokens: list[int], tenant: str = "acme",
                  tier: Tier = Tier.DEVICE) -> list[int]:
    """Full blocks of ``tokens`` allocated in ``tier`` and registered by key."""
    keys = cache.block_keys(tokens, tenant)
    ids = cache.allocate(len(keys), tier, tenant=tenant)
    assert ids is not None
    RequestBlockManager(cache).set_keys(ids, keys)
    return ids


def refs(cache: TQGPUCache, block_ids: list[int]) -> list[int]:
    return [cache.metadata.get(b).ref_count for b in block_ids]


def test_lookup_finds_the_longest_cached_prefix_of_the_tenant() -> None:
    cache = make_cache()
    blocks = RequestBlockManager(cache)
    tokens = list(range(3 * BS))
    held = cached_prefix(cache, tokens[: 2 * BS])
    keys = cache.block_keys(tokens, "acme")
    assert blocks.lookup(keys, "acme") == held
    assert blocks.lookup(keys, "acme", max_blocks=1) == held[:1]
    assert blocks.lookup(keys, "acme", max_blocks=-3) == []
    assert blocks.lookup(cache.block_keys(tokens, "globex"), "globex") == []


def test_a_new_request_gets_fresh_labelled_blocks() -> None:
    cache = make_cache()
    notes = [BlockAnnotation(source_layer="axioms", importance=0.9, token_range=(0, BS),
                             num_tokens=BS),
             BlockAnnotation(token_range=(BS, 2 * BS), num_tokens=1)]
    got = RequestBlockManager(cache).allocate(2, "acme", source_layer="memories",
                                              importance=0.3, annotations=notes)
    assert got is not None
    assert got.num_reused == got.num_warmed == 0 and got.tier is Tier.DEVICE
    assert got.new_block_ids == got.block_ids and got.reused_block_ids == []
    assert got.num_new == len(got.block_ids) == 2
    first, second = (cache.metadata.get(b) for b in got.block_ids)
    assert (first.source_layer, first.importance, first.token_range, first.num_tokens) == (
        "axioms", 0.9, (0, BS), BS)
    # an annotation's None fields keep what the allocation gave
    assert (second.source_layer, second.importance, second.token_range, second.num_tokens) == (
        "memories", 0.3, (BS, 2 * BS), 1)
    assert {first.tenant_slug, second.tenant_slug} == {"acme"}
    assert refs(cache, got.block_ids) == [0, 0]  # not held unless asked
    assert cache.num_used(Tier.DEVICE) == 2


def test_a_request_reuses_its_cached_prefix_and_allocates_the_rest() -> None:
    cache = make_cache()
    held = cached_prefix(cache, list(range(2 * BS)))
    notes = [BlockAnnotation(source_layer=f"layer{j}") for j in range(5)]
    got = RequestBlockManager(cache).allocate(5, "acme", reuse=held, annotations=notes,
                                              hold=True)
    assert got is not None
    assert got.block_ids[:2] == held == got.reused_block_ids
    assert got.num_reused == 2 and got.num_new == 3 and got.num_warmed == 0
    assert not set(got.new_block_ids) & set(held)
    assert refs(cache, got.block_ids) == [1] * 5
    # only the new positions are labelled; the reused blocks keep theirs
    layers = [cache.metadata.get(b).source_layer for b in got.block_ids]
    assert layers == ["unassigned", "unassigned", "layer2", "layer3", "layer4"]
    cache.release(got.block_ids)


def test_reused_blocks_are_released_again_unless_held() -> None:
    cache = make_cache()
    held = cached_prefix(cache, list(range(2 * BS)))
    got = RequestBlockManager(cache).allocate(3, "acme", reuse=held)
    assert got is not None and got.num_reused == 2
    assert refs(cache, got.block_ids) == [0, 0, 0]


def test_reused_host_blocks_are_warmed_to_the_device() -> None:
    cache = make_cache()
    held = cached_prefix(cache, list(range(3 * BS)))
    assert cache.spill_blocks(held[1:]) == held[1:]
    got = RequestBlockManager(cache).allocate(4, "acme", reuse=held, hold=True)
    assert got is not None
    assert got.block_ids[:3] == held and got.num_reused == 3 and got.num_warmed == 2
    assert all(cache.metadata.get(b).tier is Tier.DEVICE for b in got.block_ids)
    cache.release(got.block_ids)


def test_host_tier_requests_are_allocated_and_held_there() -> None:
    cache = make_cache(device_blocks=2, host_blocks=4)
    got = RequestBlockManager(cache).allocate(
        3, "acme", tier=Tier.HOST, source_layer="memories", hold=True,
        annotations=[BlockAnnotation(token_range=(j * BS, (j + 1) * BS)) for j in range(3)])
    assert got is not None and got.tier is Tier.HOST and got.num_new == 3
    metas = [cache.metadata.get(b) for b in got.block_ids]
    assert {m.tier for m in metas} == {Tier.HOST} and {m.source_layer for m in metas} == {
        "memories"}
    assert [m.token_range for m in metas] == [(0, BS), (BS, 2 * BS), (2 * BS, 3 * BS)]
    assert refs(cache, got.block_ids) == [1, 1, 1]


def test_a_full_tier_gives_none_and_changes_nothing() -> None:
    cache = make_cache(device_blocks=4, host_blocks=2)
    held = cached_prefix(cache, list(range(BS)))
    busy = cache.allocate(3, Tier.DEVICE, tenant="globex")
    assert busy is not None
    cache.acquire(busy)  # in use: nothing on the device can be evicted
    blocks = RequestBlockManager(cache)
    assert blocks.allocate(2, "acme", reuse=held, hold=True) is None
    assert refs(cache, held) == [0]  # the reused prefix is not left held
    assert cache.num_free(Tier.DEVICE) == 0 and cache.num_used(Tier.HOST) == 0
    assert blocks.allocate(3, "acme", tier=Tier.HOST) is None  # more than the tier holds
    assert blocks.lookup(cache.block_keys(list(range(BS)), "acme"), "acme") == held


def test_a_host_prefix_that_cannot_be_warmed_gives_none() -> None:
    cache = make_cache(device_blocks=2, host_blocks=4)
    held = cached_prefix(cache, list(range(2 * BS)), tier=Tier.HOST)
    busy = cache.allocate(2, Tier.DEVICE, tenant="globex")
    assert busy is not None
    cache.acquire(busy)
    assert RequestBlockManager(cache).allocate(3, "acme", reuse=held, hold=True) is None
    assert refs(cache, held) == [0, 0]
    assert all(cache.metadata.get(b).tier is Tier.HOST for b in held)


def test_set_keys_registers_full_blocks_and_keeps_an_equal_cached_block() -> None:
    cache = make_cache()
    blocks = RequestBlockManager(cache)
    tokens = list(range(2 * BS))
    keys = cache.block_keys(tokens, "acme")
    first = blocks.allocate(2, "acme")
    assert first is not None
    assert blocks.set_keys(first.block_ids, keys, tenant="acme") == []
    assert blocks.lookup(keys, "acme") == first.block_ids
    assert [cache.metadata.get(b).num_tokens for b in first.block_ids] == [BS, BS]
    # an equal block is already cached: the new one is not registered
    again = blocks.allocate(2, "acme")
    assert again is not None
    assert blocks.set_keys(again.block_ids, keys, tenant="acme") == again.block_ids
    assert blocks.lookup(keys, "acme") == first.block_ids
    # without a tenant every block is registered: the key moves to the new block
    assert blocks.set_keys(again.block_ids[:1], keys[:1]) == []
    assert blocks.lookup(keys[:1], "acme") == again.block_ids[:1]


def test_broken_contracts_raise() -> None:
    cache = make_cache()
    blocks = RequestBlockManager(cache)
    held = cached_prefix(cache, list(range(2 * BS)))
    with pytest.raises(ValueError, match="reuse at most"):
        blocks.allocate(1, "acme", reuse=held)
    with pytest.raises(ValueError, match="one per block"):
        blocks.allocate(3, "acme", annotations=[BlockAnnotation()])
    with pytest.raises(ValueError, match="one key per block"):
        blocks.set_keys(held, cache.block_keys(list(range(BS)), "acme"))
    assert refs(cache, held) == [0, 0] and cache.num_used(Tier.DEVICE) == 2


def test_request_blocks_is_a_slotted_result() -> None:
    got = RequestBlocks(block_ids=[7, 8, 9], num_reused=1, num_warmed=1, tier=Tier.DEVICE)
    assert got.reused_block_ids == [7] and got.new_block_ids == [8, 9] and got.num_new == 2
    assert not hasattr(got, "__dict__")
