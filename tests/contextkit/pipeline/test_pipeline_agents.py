"""Many agents, one engine: per-agent pins and tier registration (packaged SmolLM2).

Engines are siblings of the session's model (``fresh``), so the weights load once;
prompts are small and the device tier small, so every test runs in seconds.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from contextkit.engine.engine import Engine
from contextkit.loop.tiers import ContextTierManager, ItemKind, SegmentInfo
from contextkit.pipeline.pipeline import CacheAwareContextPipeline, PipelineResult
from gpu_cache import InvalidNameError, Tier

pytestmark = pytest.mark.slow

ORG_AXIOMS = {
    "org-a": ["Organisation org-a: tell the operator the truth about what you checked.",
              "Never delete data without an explicit yes from the on-call engineer.",
              "Quote every figure with its unit and the time it was measured."],
    "org-b": ["Organisation org-b: answer in one short paragraph, then list sources.",
              "Escalate anything that touches billing to a human before acting.",
              "Prefer read-only tools; say when a tool call changed state."],
}


def agent_prompt(tenant: str, agent: str, *, version: int = 0, caps: int = 2,
                 axioms_version: int = 0) -> dict[str, Any]:
    """Org layers shared by the tenant's agents, then the agent's own identity."""
    axioms = list(ORG_AXIOMS[tenant])
    if axioms_version:
        axioms[0] = f"Policy revision {axioms_version}. {axioms[0]}"
    return {
        "axioms": axioms,
        "capabilities": [f"tool query_{i}(service): p95 latency and error rate of a service."
                         for i in range(caps)],
        "identity": [f"You are {agent} of {tenant}, version {version}: you watch the "
                     f"services of team {agent} and write their handover notes."],
        "current_time": ["Now: 17:10 CET."],
    }


def pinned(engine: Engine) -> set[int]:
    return {m.block_id for m in engine.cache.metadata.pinned()}


def run(pipeline: CacheAwareContextPipeline, prompt: dict[str, Any],
        message: str = "Status?") -> PipelineResult:
    pipeline.build(prompt)
    return pipeline.generate(message, max_new_tokens=1)


def pinned_of(engine: Engine, result: PipelineResult) -> set[int]:
    """The blocks of this call that are pinned now."""
    return pinned(engine) & set(result.generation.block_ids)


def test_another_agents_call_keeps_this_agents_pins(fresh: Callable[..., Engine]) -> None:
    engine = fresh("tq4", device=128, host=128)
    a = CacheAwareContextPipeline(engine, tenant="org-a", agent="agent-a")
    b = CacheAwareContextPipeline(engine, tenant="org-a", agent="agent-b")
    first = run(a, agent_prompt("org-a", "agent-a", caps=0))
    mine = pinned_of(engine, first)
    assert first.report.pin_state == "pinned" and mine
    other = run(b, agent_prompt("org-a", "agent-b"))
    theirs = pinned_of(engine, other)
    assert other.report.pin_state == "pinned" and theirs
    shared = mine & theirs
    assert shared and mine - theirs  # the org's leading blocks, then each agent's own
    # B's call (same tenant) left A's prefix pinned: every block of it.
    assert mine <= pinned(engine)
    # A's prefix changes from its first line on: A's superseded blocks are released,
    # except those B's live prefix holds.
    again = run(a, agent_prompt("org-a", "agent-a", axioms_version=1))
    new = pinned_of(engine, again)
    assert again.report.pin_state == "pinned" and new
    held = pinned(engine)
    assert held == new | theirs
    dropped_shared = shared - new  # A let go of them; B still holds them
    assert dropped_shared and dropped_shared <= held
    released = mine - new - theirs
    assert released and not released & held
    # B's next call with the same prefix keeps A's new prefix pinned too.
    run(b, agent_prompt("org-a", "agent-b"))
    assert pinned(engine) == new | theirs


def test_pins_no_live_agent_holds_are_released_by_the_tenants_next_call(
        fresh: Callable[..., Engine]) -> None:
    engine = fresh("tq4", device=128, host=128)
    b = CacheAwareContextPipeline(engine, tenant="org-a", agent="agent-b")
    theirs = pinned_of(engine, run(b, agent_prompt("org-a", "agent-b")))
    gone = CacheAwareContextPipeline(engine, tenant="org-a", agent="agent-gone")
    its = pinned_of(engine, run(gone, agent_prompt("org-a", "agent-gone", version=3)))
    other = CacheAwareContextPipeline(engine, tenant="org-b", agent="agent-x")
    foreign = pinned_of(engine, run(other, agent_prompt("org-b", "agent-x")))
    assert its - theirs and its - theirs <= pinned(engine)
    del gone
    gc.collect()
    # Still pinned until the tenant's next call: nothing runs when a pipeline goes away.
    assert its - theirs <= pinned(engine)
    run(b, agent_prompt("org-a", "agent-b"))
    assert pinned(engine) == theirs | foreign  # the dead agent's own blocks released
    # The same agent name on a new pipeline is the same agent (a restarted process):
    # its call supersedes the old pipeline's prefix, although that one is alive.
    b2 = CacheAwareContextPipeline(engine, tenant="org-a", agent="agent-b")
    now = pinned_of(engine, run(b2, agent_prompt("org-a", "agent-b", version=2)))
    assert pinned(engine) == now | foreign and theirs - now


def test_the_agent_name_is_checked_and_defaults_to_the_tenant(
        fresh: Callable[..., Engine]) -> None:
    engine = fresh("tq4", device=64, host=64)
    with pytest.raises(InvalidNameError, match="agent") as err:
        CacheAwareContextPipeline(engine, tenant="org-a", agent="agent a/../b")
    assert "\n" not in str(err.value)
    registry = RecordingRegistry()
    pipeline = CacheAwareContextPipeline(engine, tiers=registry)  # type: ignore[arg-type]
    assert pipeline.agent is None
    pipeline.build(agent_prompt("org-b", "agent-y"), tenant="org-b")
    pipeline.generate("Status?", max_new_tokens=1, tenant="org-b")
    assert [(agent, tenant) for agent, tenant, _ in registry.calls] == [("org-b", "org-b")]


class RecordingRegistry:
    """A tier manager's ``register_segments`` that records its calls (one item per
    segment, ids as the contract's: one per distinct block run)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, list[tuple[str, float, list[int]]]]] = []

    def register_segments(self, agent: str, tenant: str,
                          segments: Sequence[tuple[str, float, Sequence[int]]]) -> list[str]:
        self.calls.append((agent, tenant, [(layer, imp, list(ids))
                                           for layer, imp, ids in segments]))
        return [f"seg:{tenant}:{ids[0]}" for _, _, ids in segments]


def test_each_call_registers_its_blocks_as_layer_runs(fresh: Callable[..., Engine]) -> None:
    engine = fresh("tq4", device=128, host=128)
    registry = RecordingRegistry()
    a = CacheAwareContextPipeline(engine, tenant="org-a", agent="agent-a",
                                  tiers=registry)  # type: ignore[arg-type]
    untiered = CacheAwareContextPipeline(engine, tenant="org-a", agent="agent-b")
    result = run(a, agent_prompt("org-a", "agent-a", caps=6),
                 "Which services breached their p95 target this morning, and why?")
    assert len(registry.calls) == 1
    agent, tenant, segments = registry.calls[0]
    assert (agent, tenant) == ("agent-a", "org-a")
    cache = engine.cache
    kept = [b for b in result.generation.block_ids
            if b in cache.metadata and cache.metadata.get(b).key is not None]
    # Every kept block once, in prompt order; each run one layer, runs alternate.
    assert [b for _, _, ids in segments for b in ids] == kept
    layers = [layer for layer, _, _ in segments]
    assert all(x != y for x, y in itertools.pairwise(layers))
    for layer, importance, ids in segments:
        metas = [cache.metadata.get(b) for b in ids]
        assert {m.source_layer for m in metas} == {layer}
        assert importance == max(m.importance for m in metas)
    assert layers[0] == "axioms" and "capabilities" in layers and "identity" in layers
    assert result.report.tier_items == len(segments)
    # A pipeline without tiers= registers nothing and reports 0.
    assert run(untiered, agent_prompt("org-a", "agent-b")).report.tier_items == 0
    assert len(registry.calls) == 1


def pressure_prompt(i: int, rnd: int) -> dict[str, Any]:
    """Another agent's prompt made of high-priority layers only (axioms, identity):
    once the conversation blocks are gone, semantic eviction has to choose among
    stable-layer blocks, and the older ones go first."""
    return {
        "axioms": [f"Organisation org-{i}, rule {k}: check the runbook of service {k} "
                   f"before acting (round {rnd})." for k in range(4)],
        "identity": [f"You are agent-{i}, reviewer {k} of the deployment queue "
                     f"(round {rnd})." for k in range(3)],
    }


def fill_device(engine: Engine, watch: set[int], *, pin_a: bool) -> list[tuple[bool, str]]:
    """Agent A (org-a) calls once, then other agents' calls overfill the device tier;
    returns (pinned, tier) of A's prefix blocks after each of their calls."""
    cache = engine.cache
    a = CacheAwareContextPipeline(engine, tenant="org-a", agent="agent-a", pin_stable=pin_a)
    first = run(a, agent_prompt("org-a", "agent-a", caps=0))
    full = first.report.pinned_blocks if pin_a else 0
    watch.update(first.generation.block_ids[:max(full, 6)])
    others = [CacheAwareContextPipeline(engine, tenant=f"org-{i}", agent=f"agent-{i}",
                                        pin_stable=False) for i in range(3)]
    states: list[tuple[bool, str]] = []
    for rnd in range(2):
        for i, pipeline in enumerate(others):
            run(pipeline, pressure_prompt(i, rnd))
            for bid in sorted(watch):
                meta = cache.metadata.get(bid) if bid in cache.metadata else None
                states.append((False, "gone") if meta is None else (meta.pinned, meta.tier.name))
    return states


def test_pins_survive_pressure_from_other_agents(fresh: Callable[..., Engine]) -> None:
    engine = fresh("tq4", device=32, host=128, eviction_policy="semantic")
    mine: set[int] = set()
    states = fill_device(engine, mine, pin_a=True)
    assert mine and engine.cache.num_used(Tier.HOST) > 0  # the tier was overfilled
    assert set(states) == {(True, "DEVICE")}  # pinned, on the device, after every call
    again = run(CacheAwareContextPipeline(engine, tenant="org-a", agent="agent-a"),
                agent_prompt("org-a", "agent-a", caps=0))
    assert again.report.reused_tokens >= len(mine) * engine.cache.block_size
    # The same traffic without A's pins spills or evicts A's prefix.
    control = fresh("tq4", device=32, host=128, eviction_policy="semantic")
    states = fill_device(control, set(), pin_a=False)
    assert any(tier != "DEVICE" for _, tier in states)


def test_agents_register_with_the_real_tier_manager(fresh: Callable[..., Engine]) -> None:
    engine = fresh("tq4", device=32, host=128, eviction_policy="semantic")
    cache = engine.cache
    tiers = ContextTierManager(cache)
    names = [("org-a", "agent-a"), ("org-a", "agent-b"), ("org-b", "agent-c")]
    pipes = {agent: CacheAwareContextPipeline(engine, tenant=tenant, agent=agent, tiers=tiers,
                                              pin_stable=False) for tenant, agent in names}
    results = {agent: run(pipes[agent], agent_prompt(tenant, agent, caps=0))
               for tenant, agent in names}
    items = [i for i in tiers.items() if i.kind is ItemKind.SEGMENT]
    owned = [b for i in items for b in i.block_ids]
    assert len(owned) == len(set(owned))  # a block shared by two agents is owned once
    for tenant, agent in names:
        ids = tiers.agent_items(agent)
        assert ids and results[agent].report.tier_items == len(ids)
        blocks = {b for i in ids for b in tiers.get(i).block_ids}
        kept = {b for b in results[agent].generation.block_ids if b in cache.metadata}
        assert kept <= blocks  # every block of the call is in one of its items
        assert all(tiers.get(i).tenant == tenant for i in ids)
    shared = set(tiers.agent_items("agent-a")) & set(tiers.agent_items("agent-b"))
    assert shared and not shared & set(tiers.agent_items("agent-c"))
    for item_id in shared:  # the org's leading blocks: one item, both agents
        info = tiers.get(item_id).payload
        assert isinstance(info, SegmentInfo) and info.agents == {"agent-a", "agent-b"}
    # Other agents' traffic spills agent-a's blocks; the manager warms them before its turn.
    for rnd in range(2):
        run(pipes["agent-c"], agent_prompt("org-b", "agent-c", version=rnd + 1, caps=4),
            "List every incident of this week, service by service. " * 3)
    mine = [b for i in tiers.agent_items("agent-a") for b in tiers.get(i).block_ids]
    assert any(cache.metadata.get(b).tier is Tier.HOST for b in mine if b in cache.metadata)
    tiers.set_lookahead({"agent-a": 1, "agent-b": 2, "agent-c": None})
    report = tiers.prefetch("agent-a")
    assert report.warmed and all(cache.metadata.get(b).tier is Tier.DEVICE
                                 for b in mine if b in cache.metadata)
    again = run(pipes["agent-a"], agent_prompt("org-a", "agent-a", caps=0))
    assert again.generation.warmed_tokens == 0 and again.report.reused_tokens > 0
    for tier in (Tier.DEVICE, Tier.HOST):  # no block leaked
        assert cache.num_free(tier) + cache.num_used(tier) == cache.capacity(tier)


def test_agents_of_one_tenant_share_its_pin_quota(fresh: Callable[..., Engine],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    engine = fresh("tq4", device=32, host=128)  # quota: 8 blocks per tenant
    a = CacheAwareContextPipeline(engine, tenant="org-a", agent="agent-a")
    b = CacheAwareContextPipeline(engine, tenant="org-a", agent="agent-b")
    mine = pinned_of(engine, run(a, agent_prompt("org-a", "agent-a", caps=0)))
    assert mine and len(mine) <= 8
    with caplog.at_level("INFO", logger="contextkit.pipeline.pipeline"):
        first = run(b, agent_prompt("org-a", "agent-b", caps=0))
        second = run(b, agent_prompt("org-a", "agent-b", caps=0))
    # B's own blocks would take the tenant past its quota: B is served, unpinned, and
    # A keeps its pins; the reason names the agents sharing the quota.
    for result in (first, second):
        assert result.report.pin_state == "unpinned"
        assert "shared by the tenant's agents agent-a, agent-b" in result.report.pin_reason
        assert "\n" not in result.report.pin_reason
    assert pinned(engine) == mine
    warnings = [r for r in caplog.records if "served unpinned" in r.getMessage()]
    assert [r.levelname for r in warnings] == ["WARNING", "INFO"]  # warned once


def test_from_config_takes_the_agent_and_the_tier_manager(fresh: Callable[..., Engine]) -> None:
    engine = fresh("tq4", device=64, host=64)
    registry = RecordingRegistry()
    pipeline = CacheAwareContextPipeline.from_config(
        engine, pipeline={"tenant": "org-a"}, agent="agent-a",
        tiers=registry)  # type: ignore[arg-type]
    assert (pipeline.tenant, pipeline.agent, pipeline.tiers) == ("org-a", "agent-a", registry)
    result = run(pipeline, agent_prompt("org-a", "agent-a", caps=0))
    assert registry.calls[0][:2] == ("agent-a", "org-a") and result.report.tier_items > 0


def test_plan_turn_predicts_what_generate_reuses_and_allocates(
        fresh: Callable[..., Engine]) -> None:
    engine = fresh("tq4", device=128, host=128)
    a = CacheAwareContextPipeline(engine, tenant="org-a", agent="agent-a")
    b = CacheAwareContextPipeline(engine, tenant="org-a", agent="agent-b")
    run(a, agent_prompt("org-a", "agent-a"))
    b.build(agent_prompt("org-a", "agent-b"))
    plan = b.plan_turn("Status?", max_new_tokens=1)
    assert (plan.agent, plan.tenant) == ("agent-b", "org-a")
    bs = engine.cache.block_size
    # B's first turn: the org's leading blocks that A registered, nothing of its own.
    assert plan.reuse_block_ids and len(plan.reuse_block_ids) * bs < plan.prompt_tokens
    assert plan.need_blocks == -(-(plan.prompt_tokens + 1) // bs) - len(plan.reuse_block_ids)
    result = b.generate("Status?", max_new_tokens=1)
    g = result.generation
    assert g.prompt_tokens == plan.prompt_tokens
    assert g.reused_tokens == len(plan.reuse_block_ids) * bs
    assert tuple(g.block_ids[: len(plan.reuse_block_ids)]) == plan.reuse_block_ids
    with pytest.raises(RuntimeError, match="embedded engine"):
        CacheAwareContextPipeline().plan_turn("Status?")
