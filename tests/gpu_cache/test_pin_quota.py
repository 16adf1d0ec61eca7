"""Tenant-fair pinning: per-tenant quota, global cap, idle TTL, reclaim; tenant checks."""

from __future__ import annotations

import pytest

from gpu_cache import (
    CacheConfig,
    CacheIdentity,
    InvalidNameError,
    PinCapacityError,
    PrefixPinManager,
    Tier,
    TQGPUCache,
)
from gpu_cache.config import NO_PIN_QUOTA, PinConfig

IDENTITY = CacheIdentity("test-model", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
T0 = 1_000_000.0  # a fixed clock: tests pass ``now`` explicitly


def make_cache(device: int = 32, host: int = 64, pins: PinConfig | None = None) -> TQGPUCache:
    config = CacheConfig(num_device_blocks=device, num_host_blocks=host,
                         pins=pins if pins is not None else PinConfig())
    return TQGPUCache(IDENTITY, config)


def prefix(cache: TQGPUCache, tenant: str, n: int, *, at: float = T0,
           tier: Tier = Tier.DEVICE) -> list[int]:
    """``n`` axioms blocks of ``tenant``, last attended at ``at``."""
    ids = cache.allocate(n, tier, tenant=tenant, source_layer="axioms")
    assert ids is not None
    cache.metadata.touch(ids, now=at)
    return ids


def pins_by_tenant(cache: TQGPUCache) -> dict[str, int]:
    out: dict[str, int] = {}
    for meta in cache.metadata.pinned():
        out[meta.tenant_slug] = out.get(meta.tenant_slug, 0) + 1
    return out


def test_config_defaults_and_checks() -> None:
    config = PinConfig()
    assert (config.tenant_share, config.total_share, config.idle_ttl_s) == (0.25, 0.75, 600.0)
    assert CacheConfig(num_device_blocks=4, num_host_blocks=0).pins == config
    assert (config.tenant_quota(32), config.total_cap(32)) == (8, 24)
    assert (config.tenant_quota(3), config.total_cap(3)) == (1, 2)  # never below one block
    assert (NO_PIN_QUOTA.tenant_quota(32), NO_PIN_QUOTA.total_cap(32)) == (32, 32)
    with pytest.raises(ValueError, match="tenant_share"):
        PinConfig(tenant_share=0.0)
    with pytest.raises(ValueError, match="total_share"):
        PinConfig(tenant_share=0.5, total_share=0.25)
    with pytest.raises(ValueError, match="idle_ttl_s"):
        PinConfig(idle_ttl_s=-1.0)


def test_a_tenant_never_pins_beyond_its_quota() -> None:
    cache = make_cache()
    pins = PrefixPinManager(cache)
    assert pins.tenant_quota == 8 and pins.total_cap == 24
    big = prefix(cache, "acme", 9)
    with pytest.raises(PinCapacityError, match=r"tenant 'acme'.*quota of 8") as err:
        pins.pin(big, now=T0)
    assert "tenant_share" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(PinCapacityError, match="quota of 8"):
        pins.try_pin(big, now=T0)  # the tenant's own excess is an error in both forms
    assert cache.metadata.pinned() == []
    assert pins.pin(big[:8], now=T0) == big[:8]
    with pytest.raises(PinCapacityError, match="quota"):
        pins.pin(big[8:], now=T0)
    assert pins_by_tenant(cache) == {"acme": 8}
    assert pins.pin(big[:8], now=T0) == []  # already pinned: nothing new, no error


def test_the_global_cap_leaves_room_and_later_tenants_are_served_unpinned() -> None:
    cache = make_cache()
    pins = PrefixPinManager(cache)
    for i in range(4):
        result = pins.try_pin(prefix(cache, f"t{i}", 6), now=T0)
        assert result.pinned and result.refused is None
    assert sum(pins_by_tenant(cache).values()) == 24
    late = prefix(cache, "late", 4)
    result = pins.try_pin(late, now=T0)
    assert result.pinned == [] and result.refused is not None
    assert "24 of 32" in result.refused
    with pytest.raises(PinCapacityError, match="24 of 32"):
        pins.pin(late, now=T0)
    assert "late" not in pins_by_tenant(cache)
    # 8 device blocks stay usable for unpinned work, whatever the pins
    assert cache.allocate(8, tenant="late", source_layer="user_turn") is not None


def test_idle_tenants_are_unpinned_after_the_ttl_and_may_spill() -> None:
    cache = make_cache(device=16, host=64, pins=PinConfig(idle_ttl_s=60.0))
    pins = PrefixPinManager(cache)
    old = prefix(cache, "old", 4, at=T0)
    pins.pin(old, now=T0)
    busy = prefix(cache, "busy", 4, at=T0)
    pins.pin(busy, now=T0)
    assert pins.release_idle(now=T0 + 59.0) == []
    cache.metadata.touch(busy, now=T0 + 50.0)  # busy keeps reading its prefix
    assert sorted(pins.release_idle(now=T0 + 61.0)) == sorted(old)
    assert pins_by_tenant(cache) == {"busy": 4}
    # Demoted pins are ordinary high-priority blocks: their layer's priority, still cached...
    metas = [cache.metadata.get(b) for b in old]
    assert all(not m.pinned and m.eviction_priority == 100 and m.tier is Tier.DEVICE
               for m in metas)
    # ...that eviction may now spill to DDR (never drop while DDR has room).
    assert cache.allocate(12, tenant="new", source_layer="user_turn") is not None
    assert all(cache.metadata.get(b).tier is Tier.HOST for b in old)
    assert all(cache.metadata.get(b).tier is Tier.DEVICE for b in busy)


def test_pinning_again_counts_as_activity_and_ttl_none_never_expires() -> None:
    cache = make_cache(pins=PinConfig(idle_ttl_s=None))
    pins = PrefixPinManager(cache)
    ids = prefix(cache, "a", 2, at=0.0)
    pins.pin(ids, now=1.0)
    assert pins.release_idle(now=1e12) == []
    cache2 = make_cache(pins=PinConfig(idle_ttl_s=10.0))
    pins2 = PrefixPinManager(cache2)
    ids2 = prefix(cache2, "a", 2, at=0.0)  # attended long ago, pinned just now
    pins2.pin(ids2, now=T0)
    assert pins2.release_idle(now=T0 + 5.0) == []
    assert sorted(pins2.release_idle(now=T0 + 11.0)) == ids2


def test_pinning_reclaims_idle_pins_under_the_cap_first() -> None:
    cache = make_cache(pins=PinConfig(idle_ttl_s=60.0))
    pins = PrefixPinManager(cache)
    for i in range(4):
        pins.pin(prefix(cache, f"t{i}", 6, at=T0), now=T0)
    for i in (1, 2, 3):  # t0 goes quiet, the others keep reading their prefixes
        cache.metadata.touch([m.block_id for m in cache.metadata.pinned()
                              if m.tenant_slug == f"t{i}"], now=T0 + 100.0)
    result = pins.try_pin(prefix(cache, "late", 4, at=T0 + 100.0), now=T0 + 100.0)
    assert result.refused is None and len(result.pinned) == 4
    assert pins_by_tenant(cache) == {"t1": 6, "t2": 6, "t3": 6, "late": 4}
    assert len(result.demoted) == 6


def test_reclaim_demotes_idle_then_over_quota_then_least_recent_tenants() -> None:
    cache = make_cache(device=32, pins=PinConfig(idle_ttl_s=60.0))
    pins = PrefixPinManager(cache)
    now = T0 + 100.0
    idle, recent, older = (prefix(cache, t, n) for t, n in (("idle", 4), ("recent", 6),
                                                             ("older", 6)))
    for ids in (idle, recent, older):
        pins.pin(ids, now=T0)
    cache.metadata.touch(recent, now=now)  # reads after pinning keep a pin active
    cache.metadata.touch(older, now=now - 30.0)
    # Pins made before the quota existed (a low-level flag, as an old snapshot would).
    hog = prefix(cache, "hog", 10, at=now)
    for bid in hog:
        cache.set_pinned(bid, True, now=now)
    assert pins.over_quota() == {"hog": 2}

    # Need 4: the idle tenant goes first (all of it: the TTL applies anyway).
    assert sorted(pins.reclaim(4, for_tenant="new", now=now)) == sorted(idle)
    # Need 2 more: the over-quota tenant's excess (its last blocks), nothing else.
    got = pins.reclaim(2, for_tenant="new", now=now)
    assert sorted(got) == hog[8:]
    assert pins_by_tenant(cache) == {"recent": 6, "older": 6, "hog": 8}
    # Need 5: the least recently active tenant, whole.
    assert sorted(pins.reclaim(5, for_tenant="new", now=now)) == sorted(older)
    # Blocks the caller protects (its own hits) are never demoted.
    mine = prefix(cache, "new", 2, at=now)
    pins.pin(mine, now=now)
    got = pins.reclaim(100, for_tenant="new", protect=mine, now=now)
    assert set(got) == set(recent) | set(hog[:8])
    assert pins_by_tenant(cache) == {"new": 2}


def test_unpin_tenant_releases_a_superseded_prefix() -> None:
    cache = make_cache()
    pins = PrefixPinManager(cache)
    v1 = prefix(cache, "acme", 5)
    pins.pin(v1, now=T0)
    other = prefix(cache, "globex", 3)
    pins.pin(other, now=T0)
    v2 = v1[:2] + prefix(cache, "acme", 4)  # a new version sharing two blocks, longer
    released = pins.unpin_tenant("acme", keep=v2)
    assert sorted(released) == v1[2:]
    pins.pin(v2, now=T0)
    assert pins.pinned_ids("acme") == sorted(v2) and pins.pinned_ids("globex") == other
    assert all(cache.metadata.get(b).eviction_priority == 100 for b in v1[2:])


def test_cache_entry_points_check_the_tenant() -> None:
    cache = make_cache()
    for bad in ("", "a\nb", "x y", "../etc"):
        with pytest.raises(InvalidNameError, match="tenant"):
            cache.allocate(1, tenant=bad)
        with pytest.raises(InvalidNameError, match="tenant"):
            cache.block_keys([1, 2, 3, 4], bad)
        with pytest.raises(InvalidNameError, match="tenant"):
            cache.lookup([], bad)
    assert len(cache.metadata) == 0 and cache.num_used(Tier.DEVICE) == 0


def test_import_checks_every_record_before_allocating() -> None:
    cache = make_cache()
    ids = prefix(cache, "acme", 2)
    exported = cache.export_blocks(ids)
    good = {"source_layer": "axioms", "importance": 0.5, "token_range": (0, 4),
            "tenant_slug": "acme", "num_tokens": 4}
    used = (cache.num_used(Tier.DEVICE), cache.num_used(Tier.HOST), len(cache.metadata))
    for field, value, match in (("importance", 1.5, "importance"),
                                ("importance", "high", "importance"),
                                ("tenant_slug", "", "tenant"),
                                ("tenant_slug", "a\nb", "tenant"),
                                ("num_tokens", 99, "num_tokens"),
                                ("token_range", (4,), "token_range"),
                                ("source_layer", 7, "source_layer")):
        bad = dict(good, **{field: value})
        with pytest.raises(ValueError, match=match):
            cache.import_blocks(exported, [good, bad])
        assert (cache.num_used(Tier.DEVICE), cache.num_used(Tier.HOST),
                len(cache.metadata)) == used, field
    assert cache.import_blocks(exported, [good, good]) is not None
