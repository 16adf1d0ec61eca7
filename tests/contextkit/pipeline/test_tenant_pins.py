"""Tenant-fair pinning and per-tenant views with the real engine (packaged SmolLM2).

Engines are siblings of the session's model (``fresh``), so the weights load once.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from contextkit.engine.engine import Engine
from contextkit.pipeline.pipeline import CacheAwareContextPipeline
from gpu_cache import PinCapacityError, Tier
from gpu_cache.config import PinConfig

pytestmark = pytest.mark.slow

DEVICE = 32
#: The default pin quota: a quarter of the device tier per tenant, three quarters in all.
QUOTA, CAP = DEVICE // 4, DEVICE * 3 // 4


def tenant_prompt(name: str, version: int = 0, caps: int = 2) -> dict[str, Any]:
    return {
        "axioms": [f"Tell {name} the truth about what you checked.",
                   "Never delete data without a yes."],
        "identity": [f"You are the assistant of tenant {name}, version {version}."],
        "capabilities": [f"tool query_{i}(service): p95 and error rate of a service."
                         for i in range(caps)],
        "current_time": ["Now: 17:10 CET."],
    }


def pins_by_tenant(engine: Engine) -> Counter[str]:
    return Counter(m.tenant_slug for m in engine.cache.metadata.pinned())


def test_ten_tenants_fill_the_device_tier_and_the_eleventh_is_served(
        fresh: Callable[..., Engine]) -> None:
    engine = fresh("tq4", device=DEVICE, host=256)
    pipeline = CacheAwareContextPipeline(engine)
    states = []
    for i in range(10):
        tenant = f"tenant-{i}"
        pipeline.build(tenant_prompt(tenant), tenant=tenant)
        result = pipeline.generate("Status?", max_new_tokens=1, tenant=tenant)
        assert result.report.prompt_tokens > 0
        held = pins_by_tenant(engine)
        assert max(held.values()) <= QUOTA and sum(held.values()) <= CAP, held
        states.append(result.report)
    assert sum(pins_by_tenant(engine).values()) > DEVICE // 2  # the pins did fill the tier
    before = pins_by_tenant(engine)
    # The 11th tenant sends a long turn: more blocks than the pins leave free.
    late = "tenant-10"
    pipeline.build(tenant_prompt(late), tenant=late)
    question = "Summarise every incident of this week for the on-call handover. " * 12
    result = pipeline.generate(question, max_new_tokens=2, tenant=late)
    assert result.report.prompt_tokens > (DEVICE - CAP) * engine.cache.block_size
    assert result.text.strip()
    held = pins_by_tenant(engine)
    assert max(held.values()) <= QUOTA and sum(held.values()) <= CAP, held
    assert result.report.pin_state in ("pinned", "unpinned")
    # Served by demoting other tenants' pins (they stay cached as ordinary blocks).
    assert sum(held[t] for t in before) < sum(before.values())
    assert result.report.pinned_blocks == held[late]
    pin_states = [r.pin_state for r in states]
    assert pin_states[0] == "pinned" and "unpinned" in pin_states  # the cap was reached
    assert all(r.pin_reason for r in states if r.pin_state == "unpinned")
    # Every tenant is served again afterwards, reusing what is still cached.
    for i in range(3):
        tenant = f"tenant-{i}"
        again = pipeline.generate("Status?", max_new_tokens=1, tenant=tenant)
        assert again.report.reused_tokens > 0
        held = pins_by_tenant(engine)
        assert max(held.values()) <= QUOTA and sum(held.values()) <= CAP, held


def test_a_stable_prefix_over_the_quota_is_served_unpinned_with_the_reason(
        fresh: Callable[..., Engine], caplog: pytest.LogCaptureFixture) -> None:
    engine = fresh("tq4", device=DEVICE, host=64)
    pipeline = CacheAwareContextPipeline(engine, tenant="acme")
    pipeline.build(tenant_prompt("acme", caps=14))
    with caplog.at_level("INFO", logger="contextkit.pipeline.pipeline"):
        first = pipeline.generate("hi", max_new_tokens=1)
        second = pipeline.generate("and now?", max_new_tokens=1)
    assert first.text is not None and second.report.reused_tokens > 0  # served, and reused
    for result in (first, second):
        assert result.report.pin_state == "unpinned" and result.report.pinned_blocks == 0
        reason = result.report.pin_reason
        assert re.search(r"tenant 'acme'.*over its pin quota of 8", reason), reason
        assert "\n" not in reason and "num_device_blocks" in reason
    assert not list(engine.cache.metadata.pinned())
    warnings = [r for r in caplog.records if "served unpinned" in r.getMessage()]
    assert [r.levelname for r in warnings] == ["WARNING", "INFO"]  # warned once per agent


def test_strict_pinning_refuses_a_prefix_over_the_quota_before_any_work(
        fresh: Callable[..., Engine]) -> None:
    engine = fresh("tq4", device=DEVICE, host=64)
    pipeline = CacheAwareContextPipeline(engine, tenant="acme", pin_stable="strict")
    pipeline.build(tenant_prompt("acme", caps=14))
    with pytest.raises(PinCapacityError, match=r"tenant 'acme'.*quota of 8") as err:
        pipeline.generate("hi", max_new_tokens=1)
    message = str(err.value)
    assert "\n" not in message and "pin_stable=False" in message
    assert len(engine.cache.metadata) == 0  # nothing computed, nothing allocated
    # Without pinning the same prompt is served.
    unpinned = CacheAwareContextPipeline(engine, tenant="acme", pin_stable=False)
    unpinned.build(tenant_prompt("acme", caps=14))
    result = unpinned.generate("hi", max_new_tokens=1)
    assert result.report.pin_state == "off" and result.report.pinned_blocks == 0
    with pytest.raises(ValueError, match="pin_stable must be True, False or 'strict'"):
        CacheAwareContextPipeline(engine, pin_stable="always")  # type: ignore[arg-type]


def test_superseded_prefix_versions_release_their_pins(fresh: Callable[..., Engine]) -> None:
    engine = fresh("tq4", device=128, host=128)
    pipeline = CacheAwareContextPipeline(engine, tenant="acme")
    other = CacheAwareContextPipeline(engine, tenant="globex")
    other.build(tenant_prompt("globex"))
    other.generate("hi", max_new_tokens=1)
    globex = set(other.pinned_blocks())
    seen: list[set[int]] = []
    # A longer version, a shorter one, then one that only differs at its end.
    for version, caps in ((0, 2), (1, 8), (2, 1), (3, 1)):
        prompt = tenant_prompt("acme", version=min(version, 2), caps=caps)
        if version == 3:
            prompt["capabilities"] = ["tool restart(service): restart one replica safely."]
        pipeline.build(prompt)
        result = pipeline.generate("hi", max_new_tokens=1)
        pinned = {m.block_id for m in engine.cache.metadata.pinned() if m.tenant_slug == "acme"}
        # The tenant's pins are exactly the leading blocks of this request's prefix.
        assert pinned and pinned <= set(result.generation.block_ids)
        assert pinned == set(result.generation.block_ids[:len(pinned)])
        assert result.report.pinned_blocks == len(pinned)
        assert result.report.pin_state == "pinned"
        seen.append(pinned)
    assert len(seen[1]) > len(seen[0]) > len(seen[2])
    assert seen[3] & seen[2] and seen[3] != seen[2]  # shares its head, not its tail
    assert set(other.pinned_blocks()) == globex  # another tenant's pins are untouched
    # A second pipeline of the same tenant (a restarted process) supersedes them too.
    again = CacheAwareContextPipeline(engine, tenant="acme")
    again.build(tenant_prompt("acme", version=9))
    result = again.generate("hi", max_new_tokens=1)
    mine = {m.block_id for m in engine.cache.metadata.pinned() if m.tenant_slug == "acme"}
    assert mine and mine <= set(result.generation.block_ids)


def test_views_and_reports_show_the_callers_tenant_only(fresh: Callable[..., Engine]) -> None:
    engine = fresh("tq4", device=128, host=128)
    pipeline = CacheAwareContextPipeline(engine, tenant="acme")
    reports = {}
    for tenant in ("globex", "acme"):
        pipeline.build(tenant_prompt(tenant, caps=4), tenant=tenant)
        reports[tenant] = pipeline.generate("hi", max_new_tokens=1, tenant=tenant).report
    mine = {m.block_id for m in engine.cache.metadata.pinned() if m.tenant_slug == "acme"}
    theirs = {m.block_id for m in engine.cache.metadata.pinned() if m.tenant_slug == "globex"}
    assert mine and theirs
    assert set(pipeline.pinned_blocks()) == mine
    assert set(pipeline.pinned_blocks("globex")) == theirs
    assert set(pipeline.pinned_blocks(all_tenants=True)) == mine | theirs
    for tenant, report in reports.items():
        blocks = [m for m in engine.cache.metadata.all() if m.tenant_slug == tenant]
        assert report.pinned_blocks == sum(1 for m in blocks if m.pinned)
        assert sum(report.blocks_per_tier.values()) == len(blocks)
        assert report.blocks_per_tier[Tier.DEVICE.value] == sum(
            1 for m in blocks if m.tier is Tier.DEVICE)
    assert sum(reports["acme"].blocks_per_tier.values()) < len(engine.cache.metadata)


def test_pins_of_an_idle_tenant_expire_on_the_next_request(
        fresh: Callable[..., Engine]) -> None:
    engine = fresh("tq4", device=64, host=64, pins=PinConfig(idle_ttl_s=0.5))
    pipeline = CacheAwareContextPipeline(engine)
    pipeline.build(tenant_prompt("quiet"), tenant="quiet")
    first = pipeline.generate("hi", max_new_tokens=1, tenant="quiet")
    assert first.report.pin_state == "pinned" and pins_by_tenant(engine)["quiet"] > 0
    quiet = pipeline.pinned_blocks("quiet")
    time.sleep(0.6)
    pipeline.build(tenant_prompt("busy"), tenant="busy")
    pipeline.generate("hi", max_new_tokens=1, tenant="busy")
    assert set(pins_by_tenant(engine)) == {"busy"}
    # The idle tenant's blocks stay cached as ordinary blocks of their layer's priority.
    metas = [engine.cache.metadata.get(b) for b in quiet]
    assert all(not m.pinned and m.eviction_priority < 999 for m in metas)
    again = pipeline.generate("hi", max_new_tokens=1, tenant="quiet")
    assert again.report.reused_tokens > 0 and again.report.pin_state == "pinned"
