"""TQGPUCache tiers, moves, eviction by semantic priority, pinning, keys and tenants."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from gpu_cache import (
    BlockStateError,
    CacheConfig,
    CacheIdentity,
    CacheIdentityError,
    PinCapacityError,
    PrefixPinManager,
    Tier,
    TQGPUCache,
    UnknownBlockError,
)
from gpu_cache.config import NO_PIN_QUOTA


def make_cache(device_blocks: int = 8, host_blocks: int = 8, layers: int = 3,
               policy: str = "semantic") -> TQGPUCache:
    """A single-tenant cache whose pins are bounded by the device tier alone (the
    quotas are tested in test_pin_quota.py)."""
    identity = CacheIdentity("test-model", num_layers=layers, num_kv_heads=2, head_dim=8,
                             block_size=4)
    return TQGPUCache(identity, CacheConfig(num_device_blocks=device_blocks,
                                            num_host_blocks=host_blocks,
                                            eviction_policy=policy, pins=NO_PIN_QUOTA))


def fill(cache: TQGPUCache, block_ids: list[int], seed: int) -> dict[str, torch.Tensor]:
    """Write random bytes into blocks; return them as exported."""
    gen = torch.Generator().manual_seed(seed)
    for bid in block_ids:
        meta = cache.metadata.get(bid)
        store = cache.storage(meta.tier)
        store.k_packed[:, meta.slot] = torch.randint(0, 256, store.k_packed[:, 0].shape,
                                                     generator=gen, dtype=torch.uint8)
        store.v_packed[:, meta.slot] = torch.randint(0, 256, store.v_packed[:, 0].shape,
                                                     generator=gen, dtype=torch.uint8)
        store.k_norms[:, meta.slot] = torch.rand(store.k_norms[:, 0].shape, generator=gen)
        store.v_norms[:, meta.slot] = torch.rand(store.v_norms[:, 0].shape, generator=gen)
    return cache.export_blocks(block_ids)


def assert_same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_layout_is_5d_and_bytes_per_token_has_no_overhead() -> None:
    identity = CacheIdentity("llama3-8b-shape", num_layers=32, num_kv_heads=8, head_dim=128)
    cache = TQGPUCache(identity, CacheConfig(num_device_blocks=2, num_host_blocks=2))
    dev = cache.storage(Tier.DEVICE)
    assert dev.k_packed.shape == (32, 2, 16, 8, 64) and dev.k_packed.dtype == torch.uint8
    assert dev.k_norms.shape == (32, 2, 16, 8) and dev.k_norms.dtype == torch.float32
    assert cache.bytes_per_token == 34816
    assert dev.nbytes == 2 * 16 * 34816  # the tensors hold exactly that, nothing hidden


@pytest.mark.parametrize("layers", [1, 3, 32])
def test_warm_and_spill_are_four_copies_and_bit_exact(layers: int) -> None:
    cache = make_cache(layers=layers)
    ids = cache.allocate(5)
    assert ids is not None
    before = fill(cache, ids, seed=layers)
    assert cache.spill_blocks(ids) == ids
    assert cache.stats.last_move_copies == 4
    assert all(cache.metadata.get(b).tier is Tier.HOST for b in ids)
    assert cache.num_used(Tier.DEVICE) == 0 and cache.num_used(Tier.HOST) == 5
    assert cache.warm_blocks(ids) == ids
    assert cache.stats.last_move_copies == 4
    assert_same_bytes(before, cache.export_blocks(ids))


def test_scattered_slots_move_bit_exact() -> None:
    cache = make_cache(device_blocks=10, host_blocks=10)
    ids = cache.allocate(10)
    assert ids is not None
    before = fill(cache, ids, seed=7)
    chosen = [ids[7], ids[1], ids[4], ids[9]]  # non-contiguous, unordered
    cache.spill_blocks(chosen)
    cache.spill_blocks([ids[0], ids[5]])
    cache.warm_blocks([ids[5], ids[9], ids[1]])
    assert cache.stats.last_move_copies == 4
    assert_same_bytes(before, cache.export_blocks(ids))


def test_allocate_returns_none_when_full_and_changes_nothing() -> None:
    cache = make_cache(device_blocks=4, host_blocks=0)
    ids = cache.allocate(4, source_layer="axioms")
    assert ids is not None
    PrefixPinManager(cache).pin(ids)
    assert cache.allocate(1) is None
    assert cache.num_used(Tier.DEVICE) == 4 and len(cache.metadata) == 4
    assert cache.allocate(5, Tier.HOST) is None


def test_eviction_follows_semantic_priority_and_never_touches_pins() -> None:
    cache = make_cache(device_blocks=6, host_blocks=2)
    layers = ["axioms", "user_turn", "memories", "capabilities", "affect", "user_turn"]
    ids = {}
    for layer in layers:
        got = cache.allocate(1, source_layer=layer)
        assert got is not None
        ids.setdefault(layer, []).extend(got)
    PrefixPinManager(cache).pin(ids["axioms"] + ids["capabilities"])

    new = cache.allocate(2, source_layer="neurons")  # forces 2 evictions
    assert new is not None
    # affect (priority 14) goes first, then the older user_turn block (15): to the host.
    assert cache.metadata.get(ids["affect"][0]).tier is Tier.HOST
    assert [cache.metadata.get(b).tier for b in ids["user_turn"]] == [Tier.HOST, Tier.DEVICE]

    cache.allocate(1, source_layer="neurons")  # next: the other user_turn; host full
    assert cache.metadata.get(ids["user_turn"][1]).tier is Tier.HOST
    assert ids["affect"][0] not in cache.metadata  # the host dropped its lowest priority

    cache.allocate(1, source_layer="neurons")  # then memories (35)
    assert cache.metadata.get(ids["memories"][0]).tier is Tier.HOST
    for bid in ids["axioms"] + ids["capabilities"]:
        meta = cache.metadata.get(bid)
        assert meta.tier is Tier.DEVICE and meta.pinned and meta.eviction_priority == 999
    # 6 device slots, 2 pinned: asking for 5 cannot be met without evicting a pin.
    assert cache.allocate(5, source_layer="neurons") is None
    assert all(cache.metadata.get(b).tier is Tier.DEVICE
               for b in ids["axioms"] + ids["capabilities"])


def test_eviction_breaks_ties_by_importance_then_last_attended() -> None:
    cache = make_cache(device_blocks=3, host_blocks=0)
    low = cache.allocate(1, source_layer="memories", importance=0.2)
    high = cache.allocate(1, source_layer="memories", importance=0.9)
    stale = cache.allocate(1, source_layer="memories", importance=0.9)
    assert low and high and stale
    cache.metadata.touch(high, now=2_000_000_000.0)
    cache.metadata.touch(stale, now=1_000_000_000.0)
    assert cache.allocate(1) is not None
    assert low[0] not in cache.metadata  # lowest importance first
    with pytest.raises(UnknownBlockError, match="evicted"):
        cache.warm_blocks(low)
    assert cache.allocate(1) is not None
    assert stale[0] not in cache.metadata and high[0] in cache.metadata


def test_semantic_eviction_keeps_a_prompts_blocks_a_prefix() -> None:
    # A cached block is reusable only behind its whole cached prefix: once chained as
    # one prompt, a low-priority layer in the middle (affect, 14) is worth keeping as
    # long as what follows it, so the tail goes first and what stays is a prefix.
    cache = make_cache(device_blocks=4, host_blocks=0)
    chain = []
    for layer in ("axioms", "affect", "memories", "neurons"):
        got = cache.allocate(1, source_layer=layer, importance=0.5)
        assert got is not None
        chain += got
    cache.metadata.touch(chain, now=1_000.0)  # one request attended them together
    cache.metadata.chain(chain)
    assert [cache.metadata.effective(b) for b in chain] == [(100, 0.5), (14, 0.5),
                                                            (14, 0.5), (14, 0.5)]
    evicted = []
    for _ in range(3):
        assert cache.allocate(1, source_layer="user_turn") is not None
        evicted += [b for b in chain if b not in cache.metadata and b not in evicted]
    assert evicted == [chain[3], chain[2], chain[1]]  # tail first; axioms stay
    assert chain[0] in cache.metadata


def test_lru_policy_ignores_semantics() -> None:
    cache = make_cache(device_blocks=2, host_blocks=0, policy="lru")
    axioms = cache.allocate(1, source_layer="axioms")
    turn = cache.allocate(1, source_layer="user_turn")
    assert axioms and turn
    cache.metadata.touch(axioms, now=1.0)
    cache.metadata.touch(turn, now=2.0)
    cache.allocate(1)
    assert axioms[0] not in cache.metadata and turn[0] in cache.metadata


def test_pinning_more_than_fits_fails_and_keeps_existing_pins() -> None:
    cache = make_cache(device_blocks=4, host_blocks=8)
    pins = PrefixPinManager(cache)
    first = cache.allocate(3, source_layer="identity")
    assert first is not None
    pins.pin(first)
    extra = cache.allocate(2, Tier.HOST, source_layer="rules")
    assert extra is not None
    with pytest.raises(PinCapacityError, match=r"quota of 4 .*of 4 device blocks"):
        pins.pin(extra)
    assert pins.pinned_ids() == sorted(first)
    assert all(cache.metadata.get(b).tier is Tier.DEVICE for b in first)
    assert all(not cache.metadata.get(b).pinned for b in extra)
    assert all(cache.metadata.get(b).tier is Tier.HOST for b in extra)


def test_pin_warms_host_blocks_and_rejects_volatile_layers() -> None:
    cache = make_cache()
    pins = PrefixPinManager(cache)
    host_ids = cache.allocate(2, Tier.HOST, source_layer="axioms")
    assert host_ids is not None
    assert pins.pin(host_ids) == host_ids
    assert all(cache.metadata.get(b).tier is Tier.DEVICE for b in host_ids)
    with pytest.raises(BlockStateError, match="unpin it"):
        cache.spill_blocks(host_ids)
    turn = cache.allocate(1, source_layer="user_turn")
    assert turn is not None
    with pytest.raises(BlockStateError, match="not pinnable"):
        pins.pin(turn)
    pins.unpin(host_ids)
    assert cache.metadata.get(host_ids[0]).eviction_priority == 100
    assert cache.spill_blocks(host_ids) == host_ids


def test_broken_contracts_raise_typed_errors_that_say_what_to_do() -> None:
    cache = make_cache()
    ids = cache.allocate(2)
    assert ids is not None
    with pytest.raises(UnknownBlockError, match="allocate it first"):
        cache.warm_blocks([12345])
    cache.remove_blocks(ids[:1])
    with pytest.raises(BlockStateError, match="double free"):
        cache.remove_blocks(ids[:1])
    with pytest.raises(ValueError, match="duplicate"):
        cache.spill_blocks([ids[1], ids[1]])
    cache.spill_blocks(ids[1:])
    with pytest.raises(BlockStateError, match="warm_blocks"):
        cache.block_table(ids[1:])
    with pytest.raises(ValueError, match="num_device_blocks"):
        CacheConfig(num_device_blocks=0, num_host_blocks=1)


def test_in_use_blocks_are_not_evicted() -> None:
    cache = make_cache(device_blocks=2, host_blocks=0)
    ids = cache.allocate(2, source_layer="user_turn")
    assert ids is not None
    cache.acquire(ids)
    assert cache.allocate(1) is None
    cache.release(ids[:1])
    assert cache.allocate(1) is not None
    assert ids[0] not in cache.metadata and ids[1] in cache.metadata
    cache.release(ids[1:])
    with pytest.raises(BlockStateError, match="released more often"):
        cache.release(ids[1:])


def test_same_tokens_in_two_tenants_never_match() -> None:
    cache = make_cache()
    tokens = list(range(100, 112))  # three full blocks
    keys_a = cache.block_keys(tokens, tenant="acme")
    keys_b = cache.block_keys(tokens, tenant="globex")
    assert len(keys_a) == 3 and not set(keys_a) & set(keys_b)
    ids = cache.allocate(3, tenant="acme")
    assert ids is not None
    for bid, key in zip(ids, keys_a, strict=True):
        cache.set_key(bid, key)
    assert cache.lookup(keys_a, tenant="acme") == ids
    assert cache.lookup(keys_b, tenant="globex") == []
    assert cache.lookup(keys_a, tenant="globex") == []  # even with a leaked key


def test_keys_chain_over_the_prefix_and_lookup_is_longest_prefix() -> None:
    cache = make_cache()
    a = cache.block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], tenant="t")
    b = cache.block_keys([1, 2, 3, 4, 0, 6, 7, 8], tenant="t")
    assert len(a) == 2  # the partial third block has no key
    assert a[0] == b[0] and a[1] != b[1]
    ids = cache.allocate(2, tenant="t")
    assert ids is not None
    cache.set_key(ids[0], a[0])
    cache.set_key(ids[1], a[1])
    assert cache.lookup(b, tenant="t") == ids[:1]
    other = TQGPUCache(CacheIdentity("other-model", 3, 2, 8, block_size=4),
                       CacheConfig(num_device_blocks=2, num_host_blocks=0))
    assert other.block_keys([1, 2, 3, 4], tenant="t")[0] != a[0]


def test_export_import_round_trip_restores_bytes_metadata_and_keys() -> None:
    src = make_cache()
    ids = src.allocate(3, tenant="acme", source_layer="rules", importance=0.7)
    assert ids is not None
    data = fill(src, ids, seed=3)
    keys = src.block_keys(list(range(12)), tenant="acme")
    metas = []
    for i, (bid, key) in enumerate(zip(ids, keys, strict=True)):
        src.set_key(bid, key)
        metas.append({"source_layer": "rules", "importance": 0.7, "tenant_slug": "acme",
                      "token_range": (4 * i, 4 * i + 4), "key": key, "num_tokens": 4})
    dst = make_cache()
    new_ids = dst.import_blocks(data, metas)
    assert new_ids is not None
    assert all(dst.metadata.get(b).tier is Tier.HOST for b in new_ids)
    assert dst.lookup(keys, tenant="acme") == new_ids
    assert dst.metadata.get(new_ids[2]).token_range == (8, 12)
    assert_same_bytes(data, dst.export_blocks(new_ids))


def test_identity_mismatch_names_every_differing_field() -> None:
    a = CacheIdentity("m1", 4, 2, 64)
    b = CacheIdentity("m2", 4, 2, 64, block_size=32)
    with pytest.raises(CacheIdentityError, match=r"model_id.*block_size"):
        a.check_compatible(b, what="shadow")
    a.check_compatible(CacheIdentity("m1", 4, 2, 64))
    with pytest.raises(CacheIdentityError, match="newer"):
        CacheIdentity.from_dict({**a.to_dict(), "future_field": 1})


def test_concurrent_callers_leave_consistent_books() -> None:
    cache = make_cache(device_blocks=16, host_blocks=16)
    errors: list[BaseException] = []
    stop = threading.Event()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[int] = []
        try:
            for _ in range(300):
                if stop.is_set():
                    break
                op = rng.random()
                if op < 0.4:
                    got = cache.allocate(rng.randint(1, 3),
                                         source_layer=rng.choice(["memories", "user_turn"]))
                    mine.extend(got or [])
                mine = [b for b in mine if b in cache.metadata]  # others may evict ours
                if not mine:
                    continue
                pick = rng.sample(mine, min(len(mine), 2))
                try:
                    if op < 0.6:
                        cache.spill_blocks(pick)
                    elif op < 0.8:
                        cache.warm_blocks(pick)
                    else:
                        cache.remove_blocks(pick)
                except UnknownBlockError as exc:  # evicted by another thread meanwhile
                    assert "evicted" in str(exc)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    stop.set()
    assert not errors, errors
    for tier in Tier:
        metas = cache.metadata.in_tier(tier)
        assert cache.num_used(tier) == len(metas)
        slots = [m.slot for m in metas]
        assert len(set(slots)) == len(slots)
        assert not cache.storage(tier).free[slots].any()
