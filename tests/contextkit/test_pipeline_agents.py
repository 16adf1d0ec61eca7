"""Many agents, one engine: per-agent pins and tier registration (packaged SmolLM2).

Engines are siblings of the session's model (``fresh``), so the weights load once;
prompts are small and the device tier small, so every test runs in seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from contextkit.engine import Engine
from contextkit.pipeline import CacheAwareContextPipeline, PipelineResult

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
    first = run(a, agent_prompt("org-a", "agent-a"))
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
