"""ContextTierManager look-ahead (segments, due agents, prefetch) over a real TQGPUCache."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import pytest

from contextkit.config import ConfigError
from contextkit.engine.sequence import close_sequence, open_sequence
from contextkit.engine.types import TokenSpan
from contextkit.loop.tiers import (
    ContextTier,
    ContextTierManager,
    ItemKind,
    PrefetchReport,
    SegmentInfo,
    TierManagerConfig,
)
from contextkit.pipeline.registration import register_call
from gpu_cache import (
    EVICTION_POLICIES,
    CacheConfig,
    CacheIdentity,
    InvalidNameError,
    PrefixPinManager,
    Tier,
    TQGPUCache,
)
from gpu_cache.config import NO_PIN_QUOTA

IDENTITY = CacheIdentity("test-tiers-lookahead", num_layers=2, num_kv_heads=2, head_dim=16)
BS = IDENTITY.block_size


def make_cache(device: int, host: int, policy: str = "semantic") -> TQGPUCache:
    return TQGPUCache(IDENTITY, CacheConfig(num_device_blocks=device, num_host_blocks=host,
                                            device="cpu", pins=NO_PIN_QUOTA,
                                            eviction_policy=policy))


def alloc(cache: TQGPUCache, n: int, tier: Tier, layer: str, importance: float = 0.5,
          tenant: str = "org-a") -> list[int]:
    ids = cache.allocate(n, tier, tenant=tenant, source_layer=layer, importance=importance)
    assert ids is not None
    return ids


def register_each(cache: TQGPUCache, manager: ContextTierManager,
                  blocks: dict[str, list[int]]) -> None:
    """Register each agent's blocks (of org-a) as one segment of their layer."""
    for agent, ids in blocks.items():
        layer = cache.metadata.get(ids[0]).source_layer
        manager.register_segments(agent, "org-a", [(layer, 0.5, ids)])


def tier_of(cache: TQGPUCache, ids: Sequence[int]) -> set[Tier]:
    return {cache.metadata.get(b).tier for b in ids}


def assert_no_leak(cache: TQGPUCache, manager: ContextTierManager) -> None:
    for tier in Tier:
        assert cache.num_free(tier) + cache.num_used(tier) == cache.capacity(tier)
        assert cache.num_used(tier) == len(cache.metadata.in_tier(tier))
    owned = [b for item in manager.items() for b in item.block_ids]
    assert len(owned) == len(set(owned)), "a block owned twice"
    assert all(b in cache.metadata for b in owned), "an owned block the cache freed"
    assert not [i for i in manager.items() if i.kind is ItemKind.SEGMENT and not i.block_ids]


# ---------------------------------------------------------------------- a real call
def agent_prompt(tenant: int, agent: int, turn: int) -> list[tuple[str, list[int]]]:
    """Layered token ids: the organisation's axioms, the agent's identity, its memories,
    and a user turn that changes every turn (each a whole number of blocks)."""
    org = 1000 * (tenant + 1)
    return [
        ("axioms", [org + i for i in range(2 * BS)]),
        ("identity", [50_000 + 100 * agent + i % 100 for i in range(2 * BS)]),
        ("memories", [60_000 + 100 * agent + i % 100 for i in range(BS)]),
        ("user_turn", [70_000 + 1000 * agent + 10 * turn + i % 10 for i in range(BS)]),
    ]


def run_call(cache: TQGPUCache, manager: ContextTierManager | None, agent: str, tenant: str,
             layers: list[tuple[str, list[int]]]) -> tuple[int, list[int], int]:
    """One request the way the engine serves it (open, write, close) and the pipeline's
    registration of its full keyed blocks, one segment per run of a layer.

    Returns:
        ``(cached_tokens, block ids of the prompt, blocks the open warmed)``.
    """
    ids: list[int] = []
    spans = []
    for layer, tokens in layers:
        spans.append(TokenSpan(len(ids), len(ids) + len(tokens), layer, 0.5))
        ids.extend(tokens)
    warmed_before = cache.stats.blocks_warmed
    seq = open_sequence(cache, ids, 0, tenant, spans, reuse=True)
    warmed_by_open = cache.stats.blocks_warmed - warmed_before
    close_sequence(cache, seq, ids, len(ids))
    chain = cache.lookup(seq.keys, tenant)
    if manager is not None:
        register_call(manager, cache, agent, tenant, chain)
    return seq.cached_tokens, chain, warmed_by_open


# ---------------------------------------------------------------------- segments
def test_register_segments_owns_shared_blocks_once() -> None:
    cache = make_cache(device=64, host=64)
    manager = ContextTierManager(cache)
    _, chain_a, _ = run_call(cache, manager, "agent-0", "org-a", agent_prompt(0, 0, 0))
    _, chain_b, _ = run_call(cache, manager, "agent-1", "org-a", agent_prompt(0, 1, 0))
    assert chain_a[:2] == chain_b[:2] and set(chain_a[2:]).isdisjoint(chain_b[2:])

    items_a, items_b = manager.agent_items("agent-0"), manager.agent_items("agent-1")
    assert len(items_a) == len(items_b) == 4  # one item per layer
    assert items_a[0] == items_b[0]  # the organisation's axioms: one item, two agents
    axioms = manager.get(items_a[0])
    assert axioms.kind is ItemKind.SEGMENT and axioms.tier is ContextTier.PROMPT
    assert axioms.item_id.startswith("seg:org-a:") and axioms.block_ids == tuple(chain_a[:2])
    assert axioms.payload == SegmentInfo("axioms", frozenset({"agent-0", "agent-1"}))
    assert axioms.frequency == 1  # agent-1's call was an access of agent-0's item
    assert manager.get(items_b[1]).payload == SegmentInfo("identity", frozenset({"agent-1"}))
    assert manager.get(items_b[1]).relevance == 0.5
    owned = [b for i in manager.items() for b in i.block_ids]
    assert sorted(owned) == sorted(set(chain_a) | set(chain_b))
    assert_no_leak(cache, manager)

    # Next turn of agent-0: the user turn changed; the old one is no agent's any more.
    _, chain_a2, _ = run_call(cache, manager, "agent-0", "org-a", agent_prompt(0, 0, 1))
    new_items = manager.agent_items("agent-0")
    assert new_items[:3] == items_a[:3] and new_items[3] != items_a[3]
    assert manager.get(items_a[3]).payload == SegmentInfo("user_turn", frozenset())
    # Registering the same call again touches the same items and creates none.
    n = len(manager)
    touched = manager.register_segments(
        "agent-0", "org-a", [("axioms", 0.9, chain_a2[:2]), ("identity", 0.9, chain_a2[2:4])])
    assert touched == new_items[:2] and len(manager) == n
    assert manager.register_segments("agent-0", "org-a", []) == []


def test_register_segments_rejects_bad_input_in_one_line() -> None:
    manager = ContextTierManager(make_cache(device=8, host=8))
    with pytest.raises(InvalidNameError, match="agent"):
        manager.register_segments("bad name", "org-a", [])
    with pytest.raises(InvalidNameError, match="tenant"):
        manager.register_segments("agent-0", "", [])
    with pytest.raises(ValueError, match=r"importance of segment 'axioms' must be within"):
        manager.register_segments("agent-0", "org-a", [("axioms", 1.5, [0])])
    with pytest.raises(ValueError, match="integer >= 0"):
        manager.set_lookahead({"agent-0": 1.5})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=">= 0"):
        manager.set_lookahead({"agent-0": -1})
    with pytest.raises(ValueError, match="need_blocks"):
        manager.prefetch("agent-0", need_blocks=-1)
    with pytest.raises(ValueError, match="protect_horizon"):
        TierManagerConfig(protect_horizon=-1)
    manager.set_lookahead({"agent-0": 1, "agent-1": None})
    assert manager.lookahead() == {"agent-0": 1, "agent-1": None}
    manager.close()
    with pytest.raises(RuntimeError, match="closed"):
        manager.prefetch("agent-0")


def test_lookahead_settings_come_from_the_configuration() -> None:
    built = ContextTierManager.from_config(
        None, tiers={"protect_horizon": 3, "lookahead_weight": 0.25})
    assert built.config.protect_horizon == 3 and built.config.lookahead_weight == 0.25
    assert TierManagerConfig().protect_horizon == 2
    assert TierManagerConfig().lookahead_weight == 0.5
    with pytest.raises(ConfigError, match="lookahead_weight"):
        ContextTierManager.from_config(None, tiers={"lookahead_weight": -1.0})


# ---------------------------------------------------------------------- prefetch order
def four_agents(cache: TQGPUCache, manager: ContextTierManager) -> dict[str, list[int]]:
    """agent-a's blocks on the host; b, c, d, e fill the 12 device blocks."""
    blocks = {
        "agent-a": alloc(cache, 3, Tier.HOST, "identity"),
        "agent-b": alloc(cache, 3, Tier.DEVICE, "identity"),
        "agent-c": alloc(cache, 3, Tier.DEVICE, "identity"),
        "agent-d": alloc(cache, 3, Tier.DEVICE, "current_time"),  # priority 10
        "agent-e": alloc(cache, 3, Tier.DEVICE, "axioms"),  # priority 100
    }
    register_each(cache, manager, blocks)
    assert cache.num_free(Tier.DEVICE) == 0
    # b is next but one, c further; d and e are not expected again.
    manager.set_lookahead({"agent-a": 1, "agent-b": 2, "agent-c": 5, "agent-e": None})
    return blocks


def test_prefetch_spills_the_never_due_first_and_warms_the_due_agent() -> None:
    cache = make_cache(device=12, host=12)
    manager = ContextTierManager(cache)
    blocks = four_agents(cache, manager)

    report = manager.prefetch("agent-a")
    assert isinstance(report, PrefetchReport) and report.agent == "agent-a"
    # Room for a's 3 blocks: the never-due agents go first, the lower layer first.
    assert sorted(report.spilled) == sorted(blocks["agent-d"])
    assert sorted(report.warmed) == sorted(blocks["agent-a"]) and report.removed == []
    assert tier_of(cache, blocks["agent-a"]) == {Tier.DEVICE}
    assert tier_of(cache, blocks["agent-d"]) == {Tier.HOST}
    assert tier_of(cache, blocks["agent-b"] + blocks["agent-c"] + blocks["agent-e"]) == {
        Tier.DEVICE}
    assert report.bytes_moved == 6 * cache.bytes_per_block
    assert report.started_at <= report.finished_at
    assert report.duration_s == pytest.approx(report.finished_at - report.started_at)
    # Bytes moved, not items: both still stand in the prompt tier (a cycle decides).
    assert {i.tier for i in manager.items()} == {ContextTier.PROMPT}

    # Six more free blocks for a's turn: e (never due), then c (due furthest); b stays.
    report = manager.prefetch("agent-a", need_blocks=6)
    assert report.warmed == []
    assert sorted(report.spilled) == sorted(blocks["agent-e"] + blocks["agent-c"])
    assert report.spilled[:3] == sorted(blocks["agent-e"], reverse=True)  # tail first
    assert cache.num_free(Tier.DEVICE) == 6
    assert tier_of(cache, blocks["agent-b"]) == {Tier.DEVICE}
    assert_no_leak(cache, manager)
    cycle = manager.run_once()
    assert cycle.metrics.prefetch == {"calls": 2, "warmed": 3, "spilled": 9, "removed": 0}
    assert manager.run_once().metrics.prefetch == {}


def test_prefetch_archives_far_agents_only_and_never_the_protected() -> None:
    cache = make_cache(device=6, host=9)
    manager = ContextTierManager(cache)
    blocks = {
        "agent-a": alloc(cache, 3, Tier.HOST, "identity"),  # due now
        "agent-b": alloc(cache, 3, Tier.HOST, "current_time"),  # due in 2: protected
        "agent-c": alloc(cache, 3, Tier.HOST, "axioms"),  # due in 3: fair game
        "agent-d": alloc(cache, 6, Tier.DEVICE, "identity"),  # due in 4
    }
    register_each(cache, manager, blocks)
    manager.set_lookahead({"agent-a": 1, "agent-b": 2, "agent-c": 3, "agent-d": 4})
    assert cache.num_free(Tier.DEVICE) == cache.num_free(Tier.HOST) == 0
    [c_item] = manager.agent_items("agent-c")

    report = manager.prefetch("agent-a", need_blocks=2)
    # d's 5 blocks go down; a's 3 come up and give back 3 host slots; the other 2 (and
    # a swap buffer: both tiers were full) come from c, never from b (lower layer,
    # but due within protect_horizon=2).
    assert sorted(report.warmed) == sorted(blocks["agent-a"])
    assert len(report.spilled) == 5 and set(report.spilled) <= set(blocks["agent-d"])
    assert set(report.removed) <= set(blocks["agent-c"]) and len(report.removed) == 3
    assert tier_of(cache, blocks["agent-b"]) == {Tier.HOST}
    assert cache.num_free(Tier.DEVICE) == 2
    assert c_item not in manager  # every block archived: the segment's row is dropped
    assert_no_leak(cache, manager)

    # b's turn next: a is not expected any more, so a's blocks make the room; b's
    # warms give back the host slots the spills take: nothing is archived.
    manager.set_lookahead({"agent-b": 1, "agent-d": 2})
    report = manager.prefetch("agent-b", need_blocks=1)
    assert sorted(report.warmed) == sorted(blocks["agent-b"]) and report.removed == []
    assert set(report.spilled) <= set(blocks["agent-a"]) and len(report.spilled) == 2
    assert cache.num_free(Tier.DEVICE) == 1
    assert_no_leak(cache, manager)


def _org_reuse_case(blocks_known: bool) -> tuple[TQGPUCache, PrefetchReport, dict[str, list[int]]]:
    """Both tiers full; a new agent of org-a (no items yet) is due and will reuse the
    organisation's blocks, which agent-c (due furthest) registered."""
    cache = make_cache(device=4, host=4)
    manager = ContextTierManager(cache)
    blocks = {
        "agent-c": alloc(cache, 2, Tier.HOST, "capabilities"),  # the org blocks; due in 7
        "agent-d": alloc(cache, 2, Tier.HOST, "axioms"),  # due in 5
        "agent-e": alloc(cache, 4, Tier.DEVICE, "identity"),  # due in 4
    }
    register_each(cache, manager, blocks)
    manager.set_lookahead({"agent-new": 1, "agent-c": 7, "agent-d": 5, "agent-e": 4})
    reuse = blocks["agent-c"] if blocks_known else []
    report = manager.prefetch("agent-new", need_blocks=2, blocks=reuse)
    assert_no_leak(cache, manager)
    return cache, report, blocks


def test_prefetch_keeps_and_warms_the_blocks_the_turn_will_reuse() -> None:
    # Told what the turn reuses (plan_turn's lookup), prefetch warms the org blocks and
    # archives the next-furthest agent's instead.
    cache, report, blocks = _org_reuse_case(blocks_known=True)
    assert sorted(report.warmed) == sorted(blocks["agent-c"])
    assert tier_of(cache, blocks["agent-c"]) == {Tier.DEVICE}
    assert set(report.removed) == set(blocks["agent-d"])
    assert cache.num_free(Tier.DEVICE) >= 2
    # Not told, it archives them: the lower layer priority (capabilities 80 < axioms 100).
    cache, report, blocks = _org_reuse_case(blocks_known=False)
    assert set(report.removed) & set(blocks["agent-c"])
    assert not all(b in cache.metadata for b in blocks["agent-c"])


def test_prefetch_with_both_tiers_full_of_protected_blocks_moves_nothing() -> None:
    cache = make_cache(device=3, host=6)
    manager = ContextTierManager(cache)
    mine = alloc(cache, 3, Tier.HOST, "identity")
    next_but_one = alloc(cache, 3, Tier.HOST, "current_time")
    later = alloc(cache, 3, Tier.DEVICE, "identity")
    register_each(cache, manager, {"agent-a": mine, "agent-b": next_but_one, "agent-d": later})
    manager.set_lookahead({"agent-a": 1, "agent-b": 2, "agent-d": 4})
    evictions = cache.stats.evictions

    report = manager.prefetch("agent-a")
    # No free slot in either tier: swapping d down and a up needs a buffer, and the
    # only host blocks to archive for it are b's, due within protect_horizon. So
    # nothing moves, and the cache evicts nothing on prefetch's behalf.
    assert report.warmed == report.spilled == report.removed == []
    assert {(s.block_id, s.reason) for s in report.skipped} == {(b, "tier_full") for b in mine}
    assert cache.stats.evictions == evictions
    assert tier_of(cache, mine + next_but_one) == {Tier.HOST}
    assert tier_of(cache, later) == {Tier.DEVICE}
    assert_no_leak(cache, manager)

    # With b no longer protected, its blocks give the buffer and the swap happens.
    manager.set_lookahead({"agent-a": 1, "agent-b": 3, "agent-d": 4})
    report = manager.prefetch("agent-a")
    assert sorted(report.warmed) == sorted(mine) and sorted(report.spilled) == sorted(later)
    assert sorted(report.removed) == sorted(next_but_one)
    assert_no_leak(cache, manager)


def test_items_of_no_agent_go_first_and_reservations_are_left_to_the_reserver() -> None:
    cache = make_cache(device=6, host=12)
    manager = ContextTierManager(cache)
    mine = alloc(cache, 2, Tier.HOST, "identity")
    due_later = alloc(cache, 2, Tier.DEVICE, "current_time")
    memory = alloc(cache, 2, Tier.DEVICE, "axioms")
    reserved = alloc(cache, 2, Tier.DEVICE, "memories")
    manager.register_segments("agent-a", "org-a", [("identity", 0.5, mine)])
    manager.register_segments("agent-b", "org-a", [("current_time", 0.5, due_later)])
    manager.add_item("memory", block_ids=memory)  # no agent: never due, whatever its layer
    manager.add_item("reservation", kind=ItemKind.RESERVATION, block_ids=reserved)
    manager.set_lookahead({"agent-a": 1, "agent-b": 9})

    report = manager.prefetch("agent-a", need_blocks=2)
    assert sorted(report.spilled) == sorted(memory + due_later)
    assert tier_of(cache, reserved) == {Tier.DEVICE} and sorted(report.warmed) == mine
    assert cache.num_free(Tier.DEVICE) == 2

    idle = ContextTierManager(None)  # no cache: nothing to move, nothing fails
    assert idle.register_segments("agent-a", "org-a", [("identity", 0.5, [1, 2])])
    empty = idle.prefetch("agent-a", need_blocks=4)
    assert empty.warmed == empty.spilled == empty.removed == [] and empty.bytes_moved == 0


def test_prefetch_never_moves_pinned_or_in_use_blocks() -> None:
    cache = make_cache(device=12, host=12)
    manager = ContextTierManager(cache)
    blocks = four_agents(cache, manager)
    PrefixPinManager(cache).pin(blocks["agent-e"])
    cache.acquire(blocks["agent-d"][:2])  # a reader holds two of d's blocks

    report = manager.prefetch("agent-a", need_blocks=3)
    assert tier_of(cache, blocks["agent-e"]) == {Tier.DEVICE}
    assert tier_of(cache, blocks["agent-d"][:2]) == {Tier.DEVICE}
    reasons = {(s.block_id, s.reason) for s in report.skipped}
    assert {(b, "pinned") for b in blocks["agent-e"]} <= reasons
    assert {(b, "in_use") for b in blocks["agent-d"][:2]} <= reasons
    # The 6 blocks: d's movable one (never due), c (due furthest), then b's tail.
    assert sorted(report.spilled) == sorted(blocks["agent-d"][2:] + blocks["agent-c"]
                                            + blocks["agent-b"][1:])
    assert sorted(report.warmed) == sorted(blocks["agent-a"])
    assert cache.num_free(Tier.DEVICE) == 3
    assert_no_leak(cache, manager)
    cache.release(blocks["agent-d"][:2])


def test_prefetch_before_the_turn_serves_the_whole_prompt_from_the_device() -> None:
    """The order the bench follows: look-ahead, prefetch (timed), then the turn."""
    prompt = agent_prompt(0, 0, 0)
    prompt_blocks = sum(len(t) for _, t in prompt) // BS  # 6
    results = {}
    for prefetch in (False, True):
        cache = make_cache(device=2 * prompt_blocks, host=4 * prompt_blocks)
        manager = ContextTierManager(cache)
        agents = [("agent-0", 0, 0), ("agent-1", 1, 1), ("agent-2", 2, 2)]
        for name, tenant, agent in agents:  # three tenants: nothing shared
            run_call(cache, manager, name, f"org-{tenant}", agent_prompt(tenant, agent, 0))
        mine = [b for i in manager.agent_items("agent-0") for b in manager.get(i).block_ids]
        on_host = [b for b in mine if cache.metadata.get(b).tier is Tier.HOST]
        assert len(mine) == prompt_blocks and on_host  # agent-2's call pushed them down
        manager.set_lookahead({"agent-0": 1, "agent-1": 2, "agent-2": 3})
        report = manager.prefetch("agent-0", need_blocks=1) if prefetch else None
        turn_started = time.perf_counter()
        cached, chain, warmed_by_open = run_call(cache, manager, "agent-0", "org-0", prompt)
        assert chain == mine
        results[prefetch] = (report, turn_started, cached, warmed_by_open, on_host)
        assert_no_leak(cache, manager)

    _, _, cached, warmed_by_open, on_host = results[False]
    assert cached == prompt_blocks * BS and warmed_by_open == len(on_host)  # the turn warms
    report, turn_started, cached, warmed_by_open, on_host = results[True]
    assert report is not None and report.finished_at < turn_started
    assert sorted(report.warmed) == sorted(on_host)
    # The room came from the other agents' lowest effective priorities (their prompts'
    # tails), the agent due furthest first among equals.
    agent_1, agent_2 = ({b for i in manager.agent_items(a) for b in manager.get(i).block_ids}
                        for a in ("agent-1", "agent-2"))
    assert report.spilled and set(report.spilled) <= agent_1 | agent_2
    assert report.spilled[0] in agent_2
    effective = [cache.metadata.effective(b)[0] for b in report.spilled]
    assert effective == sorted(effective)
    assert cached == prompt_blocks * BS and warmed_by_open == 0  # all found on the device


# ---------------------------------------------------------------------- policies
def test_lru_and_semantic_pick_different_victims_on_one_cache_state() -> None:
    victims = {}
    for policy in ("lru", "semantic"):
        cache = make_cache(device=3, host=8, policy=policy)
        axioms = alloc(cache, 1, Tier.DEVICE, "axioms")
        memories = alloc(cache, 1, Tier.DEVICE, "memories")
        clock = alloc(cache, 1, Tier.DEVICE, "current_time")
        now = time.time()
        cache.metadata.touch(axioms, now=now - 100)  # the stable prefix: read long ago
        cache.metadata.touch(memories, now=now - 50)
        cache.metadata.touch(clock, now=now)  # the clock: read just now
        order = [m.block_id for m in cache.metadata.eviction_order(
            Tier.DEVICE, EVICTION_POLICIES[policy])]
        # One more block on a full device tier: the policy's first victim goes down.
        assert alloc(cache, 1, Tier.DEVICE, "user_turn") is not None
        [spilled] = [m.block_id for m in cache.metadata.in_tier(Tier.HOST)]
        assert spilled == order[0]
        victims[policy] = (order, spilled, axioms[0], clock[0])
    lru_order, lru_victim, axioms_id, _ = victims["lru"]
    sem_order, sem_victim, _, clock_id = victims["semantic"]
    assert lru_victim == axioms_id  # recency only: the prefix every call reuses
    assert sem_victim == clock_id  # semantics: the volatile clock
    assert lru_order != sem_order


# ---------------------------------------------------------------------- orient
def test_orient_due_term_keeps_the_next_agents_items_up() -> None:
    cache = make_cache(device=16, host=16)
    due = alloc(cache, 2, Tier.DEVICE, "memories")
    never = alloc(cache, 2, Tier.DEVICE, "memories")
    now = [time.time()]
    manager = ContextTierManager(cache, config=TierManagerConfig(lookahead_weight=0.5),
                                 clock=lambda: now[0])
    [due_item] = manager.register_segments("agent-0", "org-a", [("memories", 0.2, due)])
    [never_item] = manager.register_segments("agent-1", "org-a", [("memories", 0.2, never)])
    now[0] += 1e5  # both idle for a day: recency ~0
    manager.set_lookahead({"agent-0": 1, "agent-1": None})

    first = manager.run_once()
    # Scores 0.05 (relevance only) + 0.5 for the agent due next: it stays in the
    # prompt; the never-due one is demoted (spilled), then archived (freed).
    assert manager.get(due_item).score - manager.get(never_item).score == pytest.approx(0.5)
    assert {(d.item_id, d.action.value) for d in first.decisions} == {(never_item, "demote")}
    assert tier_of(cache, never) == {Tier.HOST} and tier_of(cache, due) == {Tier.DEVICE}
    second = manager.run_once()
    assert {(d.item_id, d.action.value) for d in second.decisions} == {(never_item, "archive")}
    assert never_item not in manager and all(b not in cache.metadata for b in never)
    assert manager.get(due_item).tier is ContextTier.PROMPT

    manager.set_lookahead({"agent-0": 4})  # 0.5 / 4 = 0.125: not enough to stay
    assert manager.run_once().decisions[0].action.value == "demote"
    assert tier_of(cache, due) == {Tier.HOST}
    manager.set_lookahead({"agent-0": 1})  # due again: promoted and warmed
    promoted = manager.run_once()
    assert [(d.item_id, d.action.value) for d in promoted.decisions] == [(due_item, "promote")]
    assert sorted(promoted.act.warmed) == sorted(due)


def test_rows_of_segments_whose_blocks_are_gone_are_dropped() -> None:
    cache = make_cache(device=8, host=8)
    manager = ContextTierManager(cache)
    manager.add_item("memory", block_ids=alloc(cache, 1, Tier.DEVICE, "memories"))
    seg = alloc(cache, 2, Tier.DEVICE, "memories")
    [item] = manager.register_segments("agent-0", "org-a", [("memories", 0.5, seg)])
    cache.remove_blocks(seg[:1])
    manager.run_once()
    assert manager.get(item).block_ids == (seg[1],)
    cache.remove_blocks(seg[1:])
    manager.prefetch("agent-1")  # any pass over the table forgets them
    assert item not in manager and manager.agent_items("agent-0") == []
    assert "memory" in manager and len(manager) == 1  # other items keep their rows


# ---------------------------------------------------------------------- no leaks
def test_no_block_leaks_after_a_random_many_agent_workload() -> None:
    rng = random.Random(15)
    cache = make_cache(device=14, host=20)
    manager = ContextTierManager(cache, config=TierManagerConfig(protect_horizon=1))
    pins = PrefixPinManager(cache)
    agents = [(f"agent-{i}", i % 3, i) for i in range(6)]
    turns = dict.fromkeys(range(6), 0)
    pinned: list[int] = []
    moved = {"warmed": 0, "spilled": 0, "removed": 0}
    for step in range(120):
        op = rng.random()
        name, tenant, agent = agents[rng.randrange(6)]
        if op < 0.45:
            turns[agent] += 1
            _, chain, _ = run_call(cache, manager, name, f"org-{tenant}",
                                   agent_prompt(tenant, agent, turns[agent]))
            if agent == 0 and not pinned:
                pinned = chain[:2]  # org-0's axioms stay on the device throughout
                pins.pin(pinned)
        elif op < 0.75:
            manager.set_lookahead({a[0]: rng.choice([None, 1, 2, 3, 5]) for a in agents})
            report = manager.prefetch(name, need_blocks=rng.randrange(4))
            assert set(report.spilled).isdisjoint(pinned)
            for key in moved:
                moved[key] += len(getattr(report, key))
        elif op < 0.9:
            manager.run_once()
        elif len(manager):
            manager.remove_item(rng.choice(manager.items()).item_id)
        assert_no_leak(cache, manager)
        assert all(cache.metadata.get(b).pinned for b in pinned), step
        assert tier_of(cache, pinned) <= {Tier.DEVICE}
    assert min(moved.values()) > 0, moved  # the workload made prefetch do all three
    assert cache.stats.evictions > 0  # and the cache evicted on its own in between


def test_an_agents_blocks_go_tail_first_even_past_a_low_priority_middle_layer() -> None:
    # agent-b's prompt: axioms, affect (priority 14) in the middle, then memories (35).
    # Spilling the affect block would void the memories after it: the tail goes first.
    cache = make_cache(device=5, host=5)
    manager = ContextTierManager(cache)
    chain = [alloc(cache, 1, Tier.DEVICE, layer)[0]
             for layer in ("axioms", "affect", "memories", "memories")]
    cache.metadata.chain(chain)  # one prompt, as the engine records every request
    manager.register_segments("agent-b", "org-a", [
        ("axioms", 0.5, chain[:1]), ("affect", 0.5, chain[1:2]), ("memories", 0.5, chain[2:])])
    manager.set_lookahead({"agent-a": 1, "agent-b": 3})
    report = manager.prefetch("agent-a", need_blocks=3)
    assert sorted(report.spilled) == chain[2:] and report.removed == []
    assert tier_of(cache, chain[:2]) == {Tier.DEVICE}
    assert_no_leak(cache, manager)


def test_an_agent_not_seen_yet_protects_its_tenants_blocks() -> None:
    # agent-new of org-a has not run; its first turn will reuse org-a's blocks, which
    # only agent-c (due furthest) registered. Told the tenant, prefetch for agent-x
    # spills org-b's blocks instead.
    def case(tenants: dict[str, str] | None) -> tuple[TQGPUCache, list[int], list[int]]:
        cache = make_cache(device=4, host=2)
        manager = ContextTierManager(cache)
        org_a = alloc(cache, 2, Tier.DEVICE, "axioms", tenant="org-a")
        org_b = alloc(cache, 2, Tier.DEVICE, "axioms", tenant="org-b")
        manager.register_segments("agent-c", "org-a", [("axioms", 0.5, org_a)])
        manager.register_segments("agent-d", "org-b", [("axioms", 0.5, org_b)])
        manager.set_lookahead({"agent-x": 1, "agent-new": 2, "agent-c": 9, "agent-d": 5},
                              tenants=tenants)
        manager.prefetch("agent-x", need_blocks=2)
        assert_no_leak(cache, manager)
        return cache, org_a, org_b

    cache, org_a, org_b = case({"agent-new": "org-a"})
    assert tier_of(cache, org_a) == {Tier.DEVICE} and tier_of(cache, org_b) == {Tier.HOST}
    cache, org_a, org_b = case(None)  # not told: agent-c's blocks are the furthest due
    assert tier_of(cache, org_a) == {Tier.HOST} and tier_of(cache, org_b) == {Tier.DEVICE}


def test_a_served_prompt_is_evicted_tail_first_under_semantic_priority() -> None:
    # The engine chains every request's blocks (open_sequence): the affect block in the
    # middle (priority 14) stays as long as the memories after it, which go first.
    cache = make_cache(device=5, host=0)
    layers = [("axioms", [7 + i for i in range(2 * BS)]),
              ("affect", [900 + i for i in range(BS)]),
              ("memories", [1900 + i for i in range(2 * BS)])]
    _, chain, _ = run_call(cache, None, "agent-a", "org-a", layers)
    assert len(chain) == 5
    assert cache.allocate(2, Tier.DEVICE, source_layer="user_turn") is not None
    assert [b in cache.metadata for b in chain] == [True, True, True, False, False]


def test_a_segment_that_replaced_the_agents_previous_one_goes_before_stable_blocks() -> None:
    # agent-b's system_state changed between its calls: its new state block will most
    # likely change again before agent-b reads it, so it goes before agent-c's stable
    # identity although agent-b is due sooner.
    cache = make_cache(device=5, host=5)
    manager = ContextTierManager(cache)
    axioms = alloc(cache, 1, Tier.DEVICE, "axioms")
    state_1, state_2 = alloc(cache, 1, Tier.DEVICE, "system_state"), \
        alloc(cache, 1, Tier.DEVICE, "system_state")
    identity_c = alloc(cache, 2, Tier.DEVICE, "identity")
    manager.register_segments("agent-b", "org-a", [("axioms", 0.5, axioms),
                                                   ("system_state", 0.5, state_1)])
    manager.register_segments("agent-b", "org-a", [("axioms", 0.5, axioms),
                                                   ("system_state", 0.5, state_2)])
    manager.register_segments("agent-c", "org-a", [("identity", 0.5, identity_c)])
    manager.set_lookahead({"agent-a": 1, "agent-b": 2, "agent-c": 6})
    report = manager.prefetch("agent-a", need_blocks=2)
    # state_1 no agent holds any more, state_2 is volatile: both before c's identity.
    assert sorted(report.spilled) == sorted(state_1 + state_2)
    assert tier_of(cache, identity_c + axioms) == {Tier.DEVICE}
    assert_no_leak(cache, manager)
