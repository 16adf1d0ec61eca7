"""ContextTierManager (OODA) and TierCacheBridge over a real TQGPUCache."""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from contextkit.bench import load
from contextkit.cli.commands import main
from contextkit.loop.tiers import (
    Action,
    ContextTier,
    ContextTierManager,
    CycleReport,
    Decision,
    ItemKind,
    ThresholdPolicy,
    Thresholds,
    TierCacheBridge,
    TierManagerConfig,
)
from contextkit.prompt.markup import SpilledLine, SpilloverQueue
from gpu_cache import CacheConfig, CacheIdentity, PrefixPinManager, Tier, TQGPUCache
from gpu_cache.config import NO_PIN_QUOTA, PinConfig

IDENTITY = CacheIdentity("test-tiers", num_layers=2, num_kv_heads=2, head_dim=16)


def make_cache(device: int = 32, host: int = 64, pins: PinConfig | None = None) -> TQGPUCache:
    return TQGPUCache(IDENTITY, CacheConfig(num_device_blocks=device, num_host_blocks=host,
                                            device="cpu", pins=pins or PinConfig()))


class FakeClock:
    """Wall-clock seconds that advance only when told (starts at the real time)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def tiers_of(cache: TQGPUCache, ids: list[int]) -> set[Tier]:
    return {cache.metadata.get(b).tier for b in ids}


# ---------------------------------------------------------------------- closed loop
def test_used_memory_is_warmed_and_idle_memory_spilled_then_evicted(
        caplog: pytest.LogCaptureFixture) -> None:
    cache, clock = make_cache(), FakeClock()
    hot = cache.allocate(2, Tier.HOST, source_layer="memories")
    cold = cache.allocate(2, Tier.DEVICE, source_layer="memories")
    assert hot is not None and cold is not None
    config = TierManagerConfig(recency_half_life_s=60, frequency_half_life_s=60)
    reports: list[CycleReport] = []
    with ContextTierManager(cache, config=config, clock=clock) as manager:
        manager.add_item("hot", tier=ContextTier.WORKING, block_ids=hot, relevance=0.5)
        manager.add_item("cold", tier=ContextTier.PROMPT, block_ids=cold, relevance=0.5)
        with caplog.at_level(logging.DEBUG, logger="contextkit.loop.tiers"):
            for _ in range(12):
                clock.advance(30)
                cache.metadata.touch(hot, now=clock())  # attention reads the hot memory
                reports.append(manager.run_once())
        hot_item, cold_item = manager.get("hot"), manager.get("cold")

    decisions = {(d.item_id, d.action): (i, d) for i, r in enumerate(reports)
                 for d in r.decisions}
    i_promote, promote = decisions[("hot", Action.PROMOTE)]
    i_demote, demote = decisions[("cold", Action.DEMOTE)]
    i_archive, archive = decisions[("cold", Action.ARCHIVE)]
    assert i_demote < i_archive
    assert promote.to_tier is ContextTier.PROMPT and promote.score >= promote.threshold
    assert "score" in promote.reason and ">=" in promote.reason
    assert demote.score < demote.threshold and archive.to_tier is ContextTier.ARCHIVE

    # The bridge moved the blocks with the decisions.
    assert sorted(reports[i_promote].act.warmed) == sorted(hot)
    assert sorted(reports[i_demote].act.spilled) == sorted(cold)
    assert sorted(reports[i_archive].act.removed) == sorted(cold)
    assert reports[i_promote].metrics.bytes_moved == 2 * cache.bytes_per_block
    assert reports[i_archive].metrics.bytes_freed == 2 * cache.bytes_per_block
    assert reports[i_promote].metrics.actions["promote"] == 1
    assert reports[i_promote].metrics.blocks_moved["warmed"] == 2

    assert hot_item.tier is ContextTier.PROMPT and tiers_of(cache, hot) == {Tier.DEVICE}
    assert hot_item.frequency > 2.5
    assert cold_item.tier is ContextTier.ARCHIVE and cold_item.block_ids == ()
    assert all(b not in cache.metadata for b in cold)
    assert cache.num_used(Tier.DEVICE) == 2 and cache.num_used(Tier.HOST) == 0
    assert any("decision: promote hot" in r.message for r in caplog.records)
    assert any("tier cycle" in r.message for r in caplog.records)


def test_thresholds_follow_ddr_occupancy() -> None:
    cache = make_cache(device=8, host=20)
    policy = ThresholdPolicy()
    base = Thresholds()
    manager = ContextTierManager(cache, config=TierManagerConfig(thresholds=base))

    low = manager.run_once()  # host tier empty: < 50%
    assert low.suggestion is not None and low.suggestion.applied
    assert low.metrics.thresholds_before == base
    assert manager.thresholds.promote == pytest.approx(base.promote - policy.step)
    assert manager.thresholds.demote == base.demote
    assert "lower promotion" in low.metrics.threshold_reason

    filler = cache.allocate(17, Tier.HOST)  # 85% > 80%
    assert filler is not None
    before = manager.thresholds
    high = manager.run_once()
    assert high.metrics.host_occupancy == pytest.approx(0.85)
    assert manager.thresholds.demote == pytest.approx(before.demote + policy.step)
    assert manager.thresholds.archive == pytest.approx(before.archive + policy.step)
    assert manager.thresholds.promote == pytest.approx(base.promote)  # relaxed back
    assert "raise demotion" in high.metrics.threshold_reason

    cache.remove_blocks(filler[:5])  # 60%: inside the band, nothing moves
    before = manager.thresholds
    mid = manager.run_once()
    assert mid.suggestion is None and manager.thresholds == before
    assert mid.metrics.thresholds_after == mid.metrics.thresholds_before

    for _ in range(20):  # repeated pressure stays within the bounds
        if cache.num_free(Tier.HOST):
            cache.allocate(min(3, cache.num_free(Tier.HOST)), Tier.HOST)
        manager.run_once()
    th = manager.thresholds
    assert th.demote <= policy.max_demote and th.archive < th.demote < th.promote
    manager.close()


def test_apply_thresholds_false_only_records_suggestions() -> None:
    cache = make_cache(host=10)
    bridge = TierCacheBridge(cache, apply_thresholds=False)
    manager = ContextTierManager(bridge=bridge)
    assert manager.cache is cache
    report = manager.run_once()
    assert report.suggestion is not None and not report.suggestion.applied
    assert report.suggestion.after.promote < report.suggestion.before.promote
    assert manager.thresholds == TierManagerConfig().thresholds
    assert "not applied" in report.metrics.threshold_reason


# ---------------------------------------------------------------------- the bridge's limits
def test_pinned_and_in_use_blocks_are_never_moved() -> None:
    cache, clock = make_cache(), FakeClock()
    prefix = cache.allocate(2, Tier.DEVICE, source_layer="axioms")
    busy = cache.allocate(1, Tier.DEVICE, source_layer="memories")
    assert prefix is not None and busy is not None
    PrefixPinManager(cache).pin(prefix)
    cache.acquire(busy)
    manager = ContextTierManager(cache, clock=clock)
    old = clock() - 1e5
    cache.metadata.touch(prefix + busy, now=old)  # last attended long ago
    manager.add_item("prefix", kind=ItemKind.SEGMENT, tier=ContextTier.PROMPT,
                     block_ids=prefix, relevance=0.0, last_access=old)
    manager.add_item("busy", tier=ContextTier.PROMPT, block_ids=busy, relevance=0.0,
                     last_access=old)

    demoted = manager.run_once()
    assert {d.action for d in demoted.decisions} == {Action.DEMOTE}
    assert Counter(s.reason for s in demoted.act.skipped) == {"pinned": 2, "in_use": 1}
    assert demoted.metrics.blocks_skipped == {"pinned": 2, "in_use": 1}
    assert demoted.act.spilled == [] and demoted.metrics.bytes_moved == 0

    archived = manager.run_once()
    assert {d.action for d in archived.decisions} == {Action.ARCHIVE}
    assert archived.act.removed == [] and len(archived.act.skipped) == 3
    assert tiers_of(cache, prefix + busy) == {Tier.DEVICE}
    assert all(cache.metadata.get(b).pinned for b in prefix)
    assert manager.get("prefix").block_ids == tuple(prefix)  # still owned, still cached


def test_blocks_freed_meanwhile_and_full_tiers_do_not_crash() -> None:
    cache, clock = make_cache(device=2, host=8, pins=NO_PIN_QUOTA), FakeClock()
    pinned = cache.allocate(2, Tier.DEVICE, source_layer="axioms")
    mine = cache.allocate(2, Tier.HOST, source_layer="memories")
    gone = cache.allocate(1, Tier.HOST, source_layer="memories")
    assert pinned is not None and mine is not None and gone is not None
    PrefixPinManager(cache).pin(pinned)  # the device tier is full of pins
    manager = ContextTierManager(cache, clock=clock)
    manager.add_item("wanted", block_ids=mine, relevance=1.0)
    manager.add_item("orphan", block_ids=gone, relevance=1.0)
    cache.remove_blocks(gone)  # freed by someone else before the cycle
    manager.record_access("wanted", 20)

    report = manager.run_once()  # promotion wants VRAM; warm_blocks returns None
    assert manager.get("wanted").tier is ContextTier.PROMPT
    assert {s.reason for s in report.act.skipped} == {"tier_full"}
    assert tiers_of(cache, mine) == {Tier.HOST}
    assert manager.get("orphan").block_ids == ()  # Observe forgot the freed block

    # A decision naming blocks evicted between Decide and Act: reported, not raised.
    bridge = TierCacheBridge(cache)
    doomed = cache.allocate(2, Tier.HOST, source_layer="memories")
    assert doomed is not None
    cache.remove_blocks(doomed[:1])
    for action, to_tier in ((Action.ARCHIVE, ContextTier.ARCHIVE),
                            (Action.PROMOTE, ContextTier.PROMPT)):
        act = bridge.act([Decision("x", ItemKind.MEMORY, action, ContextTier.WORKING, to_tier,
                                   0.0, 0.1, tuple(doomed))])
        assert doomed[0] in act.gone
    assert doomed[1] not in cache.metadata  # the archive freed the block still there


def test_without_a_cache_tiers_are_still_managed() -> None:
    clock, queue = FakeClock(), SpilloverQueue()
    config = TierManagerConfig(recency_half_life_s=60)
    manager = ContextTierManager(config=config, spillover=queue, clock=clock)
    assert manager.cache is None and manager.bridge.cache is None
    line = SpilledLine("memories", "the user prefers tea", 0.9, clock())
    queue.put([line, SpilledLine("memories", "an old fact", 0.1, clock() - 3600)])
    first = manager.run_once()
    assert len(manager) == 2 and first.metrics.spilled_lines == 2
    assert {i.kind for i in manager.items()} == {ItemKind.SPILLED_LINE}
    queue.put([line])  # spilled again: the same item, counted as demand
    manager.add_item("node:1", block_ids=[7, 8], relevance=1.0)  # ids mean nothing here
    for _ in range(3):
        clock.advance(60)
        manager.record_access("node:1", 3)
        report = manager.run_once()
        assert report.act.warmed == report.act.spilled == report.act.removed == []
        assert report.suggestion is None and report.metrics.host_occupancy is None
    assert len(manager) == 3
    assert manager.get("node:1").tier is ContextTier.PROMPT
    assert manager.items(ContextTier.ARCHIVE)[0].payload.text == "an old fact"
    assert manager.thresholds == config.thresholds
    counts = manager.tier_counts()
    assert sum(counts.values()) == 3 and counts["prompt"] >= 1


def test_prompt_capacity_and_move_cap() -> None:
    clock = FakeClock()
    config = TierManagerConfig(max_prompt_items=3, max_moves_per_cycle=5)
    manager = ContextTierManager(config=config, clock=clock)
    for i in range(10):
        manager.add_item(f"m{i}", relevance=i / 10)
        manager.record_access(f"m{i}", 50)
    report = manager.run_once()
    assert len(report.decisions) == 3  # only 3 fit the prompt, best scores first
    assert {d.item_id for d in report.decisions} == {"m7", "m8", "m9"}
    for i in range(10):
        manager.add_item(f"idle{i}", relevance=0.0, last_access=clock() - 1e6)
    assert len(manager.run_once().decisions) == 5


def test_items_api_and_errors() -> None:
    manager = ContextTierManager()
    manager.add_item("a", block_ids=[1, 2])
    with pytest.raises(ValueError, match="already tracked"):
        manager.add_item("a")
    with pytest.raises(ValueError, match="belong to another item"):
        manager.add_item("b", block_ids=[2])
    with pytest.raises(ValueError, match="relevance"):
        manager.add_item("c", relevance=2.0)
    with pytest.raises(KeyError, match="not tracked"):
        manager.record_access("nope")
    assert manager.remove_item("a").block_ids == (1, 2)
    manager.add_item("b", block_ids=[2])  # the block is free again
    assert "b" in manager and "a" not in manager
    with pytest.raises(ValueError, match="sum to 1"):
        TierManagerConfig(frequency_weight=0.9)
    with pytest.raises(ValueError, match="archive < demote < promote"):
        Thresholds(promote=0.3, demote=0.4)
    with pytest.raises(ValueError, match="another cache"):
        ContextTierManager(make_cache(), bridge=TierCacheBridge(make_cache()))


def test_reservations_go_through_the_reserver() -> None:
    from memory_graph import GraphBlockReserver, Node, NodeKind

    cache, clock = make_cache(), FakeClock()
    reserver = GraphBlockReserver(cache, count_tokens=lambda text: len(text.split()))
    nodes = [Node(f"n{i}", "default", NodeKind.SEMANTIC, "word " * 20, clock())
             for i in range(2)]
    wanted = reserver.reserve(nodes[:1])
    idle = reserver.reserve(nodes[1:])
    manager = ContextTierManager(bridge=TierCacheBridge(cache, reserver=reserver), clock=clock)
    manager.track_reservation(wanted, relevance=1.0)
    idle_id = manager.track_reservation(idle, relevance=0.0)
    manager.set_relevance(idle_id, 0.0)
    manager.record_access(f"reservation:{wanted.reservation_id}", 20)
    clock.advance(7200)
    manager.record_access(f"reservation:{wanted.reservation_id}", 20)
    report = manager.run_once()
    assert reserver.get(wanted.reservation_id).state.value == "warmed"
    assert tiers_of(cache, list(wanted.block_ids)) == {Tier.DEVICE}
    assert reserver.get(idle.reservation_id).state.value == "released"
    assert len(report.act.reservations) == 2
    manager.run_once()
    assert manager.get(idle_id).block_ids == ()  # freed by the reserver, forgotten
    reserver.close()


# ---------------------------------------------------------------------- scheduling
def test_scheduled_cycles_under_concurrent_requests() -> None:
    cache = make_cache(device=64, host=512)
    prefix = cache.allocate(4, Tier.DEVICE, source_layer="axioms")
    assert prefix is not None
    PrefixPinManager(cache).pin(prefix)
    config = TierManagerConfig(interval_s=0.05, misfire_grace_s=1.0, recency_half_life_s=0.3,
                               frequency_half_life_s=1.0)
    manager = ContextTierManager(cache, config=config)
    manager.add_item("prefix", kind=ItemKind.SEGMENT, tier=ContextTier.PROMPT,
                     block_ids=prefix, relevance=0.0)
    reports: list[CycleReport] = []
    manager.subscribe(reports.append)
    allocated: list[int] = []
    failures: list[BaseException] = []
    deadline = time.monotonic() + 3.0

    def request(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[int] = []
        try:
            while time.monotonic() < deadline:
                if len(mine) < 60 and rng.random() < 0.05:  # bounded: host never fills
                    tier = rng.choice([Tier.DEVICE, Tier.HOST])
                    ids = cache.allocate(rng.randint(1, 3), tier, source_layer="memories")
                    if ids is not None:
                        mine += ids
                        allocated.extend(ids)
                        manager.add_item(f"r{seed}-{ids[0]}", block_ids=ids,
                                         relevance=rng.random(),
                                         tier=ContextTier(int(tier is Tier.HOST)))
                hot = mine[:6] if rng.random() < 0.9 else mine  # most blocks go idle
                sample = rng.sample(hot, min(len(hot), 3))
                with cache.locked():  # check + acquire atomically: the bridge may free
                    live = [b for b in sample if b in cache.metadata]
                    cache.acquire(live)
                cache.metadata.touch(live)
                time.sleep(0.002)
                cache.release(live)
        except BaseException as exc:
            failures.append(exc)

    manager.start()
    manager.start()  # idempotent
    threads = [threading.Thread(target=request, args=(k,), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=15)
    assert not any(t.is_alive() for t in threads), "request threads deadlocked"
    closer = threading.Thread(target=manager.close, daemon=True)
    closer.start()
    closer.join(timeout=15)
    assert not closer.is_alive(), "close() deadlocked"
    manager.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        manager.run_once()

    assert failures == [] and manager.num_errors == 0
    assert len(reports) >= 5 and len(manager.metrics()) == len(reports)
    removed = [b for r in reports for b in r.act.removed]
    moved = {b for r in reports for b in r.act.warmed + r.act.spilled + r.act.removed}
    assert len(removed) == len(set(removed)), "a block was freed twice"
    assert set(removed) <= set(allocated)
    for bid in allocated:  # every block is cached, or was freed by the bridge; not both
        assert (bid in cache.metadata) != (bid in set(removed))
    assert removed and any(r.act.warmed for r in reports) and any(r.act.spilled
                                                                   for r in reports)
    by_tier = Counter(m.tier for m in cache.metadata.all())
    assert by_tier[Tier.DEVICE] == cache.num_used(Tier.DEVICE)
    assert by_tier[Tier.HOST] == cache.num_used(Tier.HOST)
    assert all(m.ref_count == 0 for m in cache.metadata.all())
    assert not moved & set(prefix)
    assert all(cache.metadata.get(b).pinned and cache.metadata.get(b).tier is Tier.DEVICE
               for b in prefix)
    assert any(s.reason == "pinned" for r in reports for s in r.act.skipped)


# ---------------------------------------------------------------------- reporting
def test_prometheus_metrics_on_a_private_registry() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    cache, clock = make_cache(), FakeClock()
    blocks = cache.allocate(1, Tier.HOST, source_layer="memories")
    manager = ContextTierManager(cache, prometheus=True, clock=clock)
    manager.add_item("m", block_ids=blocks or [], relevance=1.0)
    manager.record_access("m", 20)
    manager.run_once()
    manager.run_once()
    registry = manager.prometheus_registry
    assert isinstance(registry, prometheus_client.CollectorRegistry)
    value = registry.get_sample_value
    assert value("contextkit_tier_cycles_total") == 2
    assert value("contextkit_tier_actions_total", {"action": "promote"}) == 1
    assert value("contextkit_tier_blocks_total", {"move": "warmed"}) == 1
    assert value("contextkit_tier_bytes_moved_total") == cache.bytes_per_block
    assert value("contextkit_tier_cycle_seconds_count") == 2
    assert value("contextkit_tier_items", {"tier": "prompt"}) == 1
    assert value("contextkit_tier_threshold", {"name": "promote"}) == manager.thresholds.promote
    shared = prometheus_client.CollectorRegistry()
    other = ContextTierManager(prometheus=True, registry=shared)
    assert other.prometheus_registry is shared
    assert ContextTierManager().prometheus_registry is None


def test_write_status_and_contextkit_status(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    cache = make_cache()
    manager = ContextTierManager(cache, config=TierManagerConfig(history=3))
    manager.add_item("m", relevance=0.1)
    for _ in range(5):
        manager.run_once()
    assert [m.cycle for m in manager.metrics()] == [3, 4, 5]
    path = manager.write_status(tmp_path / "tier-manager.json", last=2)
    doc = json.loads(path.read_text())
    assert [c["cycle"] for c in doc["cycles"]] == [4, 5]
    assert doc["items_by_tier"]["working"] == 1 and "promote" in doc["thresholds"]

    store = tmp_path / "store"
    store.mkdir()
    assert main(["status", "--store", f"file://{store}", "--tier-status", str(path),
                 "--json"]) == 0
    out = capsys.readouterr().out
    status = json.loads(out.strip().splitlines()[-1])
    assert status["tier_manager"]["last_cycle"]["cycle"] == 5
    assert "tier manager" in out and "thresholds" in out
    # A missing tier-status file is a one-line error (exit 2), not silently ignored.
    assert main(["status", "--store", f"file://{store}", "--tier-status",
                 str(tmp_path / "missing.json"), "--json"]) == 2
    captured = capsys.readouterr()
    assert "missing.json" in captured.err and "Traceback" not in captured.err
    assert "tier_manager" not in captured.out


def test_bench_ooda_reports_its_fields(capsys: pytest.CaptureFixture[str]) -> None:
    assert load("ooda").HELP
    assert main(["bench", "ooda", "--items", "3000", "--cycles", "3", "--warmup", "1",
                 "--device-blocks", "128", "--host-blocks", "256", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("items", "cycle_ms_p50", "interval_s", "overhead_fraction", "blocks_moved",
                "machine"):
        assert key in result
    assert result["items"] == 3000 and result["interval_s"] == 60.0
    assert result["overhead_fraction"] == pytest.approx(result["cycle_ms_p50"] / 1e3 / 60.0)
    assert result["blocks_moved"] > 0


@pytest.mark.parametrize("field", ["interval_s", "recency_half_life_s", "misfire_grace_s",
                                   "frequency_scale"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_tier_settings_refuse_non_finite_numbers(field: str, value: float) -> None:
    # nan compares false with every bound, so it used to pass the range checks
    with pytest.raises(ValueError, match=f"finite.*{field}"):
        TierManagerConfig(**{field: value})


def test_tier_settings_refuse_a_negative_misfire_grace() -> None:
    with pytest.raises(ValueError, match="misfire_grace_s must be >= 0"):
        TierManagerConfig(misfire_grace_s=-1.0)
