"""The multi-agent workload: schedule, look-ahead, shared organisation layers, prompt sizes."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from contextkit.engine.engine import Engine
from contextkit.engine.models import load_tokenizer
from contextkit.pipeline.pipeline import CacheAwareContextPipeline
from contextkit.prompt.layers import LayerConfig
from contextkit.prompt.markup import (
    StructuredPrompt,
    coerce_prompt,
    render_marked,
    synthesize_for_budget,
)
from contextkit.workloads.agents import AgentSpec, AgentStep, MultiAgentWorkload
from contextkit.workloads.replay import REPLAY_LAYERS, AgentReplay
from gpu_cache import validate_name, validate_tenant

CONFIG = LayerConfig()
ORG = ("axioms", "system_knowledge", "capabilities")
ORDER = (*ORG, "identity", "system_state", "current_time", "neurons", "memories", "affect",
         "awareness")
# (num_agents, num_tenants, steps, seed): the defaults and awkward corners
SHAPES = [
    pytest.param(6, 3, 36, 0, id="defaults"),
    pytest.param(6, 3, 36, 7, id="defaults-seed7"),
    pytest.param(3, 2, 10, 1, id="3-agents-returns-just-fit"),
    pytest.param(4, 1, 14, 2, id="one-tenant-14-steps"),
    pytest.param(8, 4, 60, 3, id="8-agents-60-steps"),
    pytest.param(12, 3, 40, 4, id="12-agents-40-steps"),
]
SHORT = [  # too short for a pause of 2 x num_agents: round-robin and bursts only
    pytest.param(6, 3, 12, 0, id="6-agents-12-steps"),
    pytest.param(2, 1, 4, 0, id="2-agents-4-steps"),
]


@pytest.fixture(scope="module")
def count_tokens() -> Callable[[str], int]:
    tokenizer = load_tokenizer()
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def workload() -> MultiAgentWorkload:
    return MultiAgentWorkload()


def lines(prompt: StructuredPrompt, layer: str) -> list[str]:
    section = prompt.section(layer)
    assert section is not None, f"layer {layer} is missing"
    return [line.text for line in section.lines]


def pipeline_tokens(prompt: StructuredPrompt, count: Callable[[str], int]) -> int:
    """Tokens of the prompt as the pipeline renders it: each section marked, newline-ended."""
    return sum(count(render_marked(StructuredPrompt((s,))) + "\n") for s in prompt.sections)


def first_prompt_of_each_agent(w: MultiAgentWorkload) -> dict[str, StructuredPrompt]:
    out: dict[str, StructuredPrompt] = {}
    for i, name in enumerate(w.schedule):
        out.setdefault(name, w.system_prompt(i))
    return out


# ---------------------------------------------------------------------------- agents


def test_defaults_are_six_agents_of_three_tenants_with_valid_names(
        workload: MultiAgentWorkload) -> None:
    assert [a.name for a in workload.agents] == [f"agent-{i}" for i in range(6)]
    assert [a.tenant for a in workload.agents] == ["org-a", "org-b", "org-c"] * 2
    assert workload.num_steps == len(workload.schedule) == 36
    for spec in workload.agents:
        assert validate_name(spec.name, "agent") == spec.name
        assert validate_tenant(spec.tenant) == spec.tenant
        assert workload.agent(spec.name) is spec
    assert len({a.seed for a in workload.agents}) == 6
    scales = [a.scale for a in workload.agents]
    assert len(set(scales)) == 6 and all(0 < s < 1 for s in scales)


def test_tenant_names_go_past_z() -> None:
    w = MultiAgentWorkload(28, num_tenants=28, steps=56)
    assert [a.tenant for a in w.agents][24:] == ["org-y", "org-z", "org-aa", "org-ab"]
    for spec in w.agents:
        validate_tenant(spec.tenant)


def test_workload_scale_multiplies_every_agent_scale_and_grows_the_prompts(
        count_tokens: Callable[[str], int]) -> None:
    one, two = MultiAgentWorkload(), MultiAgentWorkload(scale=2.0)
    assert one.schedule == two.schedule
    for a, b in zip(one.agents, two.agents, strict=True):
        assert b.scale == pytest.approx(2 * a.scale)
    for i, spec in enumerate(two.agents):  # the opening: every agent's first prompt
        small, large = one.system_prompt(i), two.system_prompt(i)
        assert pipeline_tokens(large, count_tokens) > pipeline_tokens(small, count_tokens)
        own = AgentReplay(len(two.turns_of(spec.name)), seed=spec.seed,
                          scale=spec.scale).build_system_message(0)
        for layer in ("system_state", "neurons", "memories", "awareness"):
            assert lines(large, layer) == lines(own, layer), (spec.name, layer)
        assert len(lines(large, "neurons")) > len(lines(small, "neurons"))
        for layer in (*ORG, "identity", "affect"):  # only the replay's expandable layers grow
            assert lines(small, layer) == lines(large, layer)


# ---------------------------------------------------------------------------- determinism


def test_same_arguments_give_the_same_workload_and_another_seed_another_schedule() -> None:
    a, b = MultiAgentWorkload(seed=5), MultiAgentWorkload(seed=5)
    assert a.schedule == b.schedule
    assert a.agents == b.agents
    assert a.steps() == b.steps()
    assert [render_marked(a.system_prompt(i)) for i in range(a.num_steps)] == \
        [render_marked(b.system_prompt(i)) for i in range(b.num_steps)]
    assert a.describe() == b.describe()
    assert MultiAgentWorkload(seed=6).schedule != a.schedule
    # the agents' replays are seeded too: another seed, another platform snapshot
    assert lines(MultiAgentWorkload(seed=6).system_prompt(0), "system_state") != \
        lines(a.system_prompt(0), "system_state")


# ---------------------------------------------------------------------------- schedule


def runs(schedule: tuple[str, ...]) -> list[tuple[str, int, int]]:
    """Maximal runs of one agent: (agent, first step, length)."""
    out: list[tuple[str, int, int]] = []
    for i, name in enumerate(schedule):
        if out and out[-1][0] == name:
            out[-1] = (name, out[-1][1], out[-1][2] + 1)
        else:
            out.append((name, i, 1))
    return out


@pytest.mark.parametrize(("agents", "tenants", "steps", "seed"), SHAPES + SHORT)
def test_every_agent_acts_at_least_twice_and_steps_agree_with_the_schedule(
        agents: int, tenants: int, steps: int, seed: int) -> None:
    w = MultiAgentWorkload(agents, num_tenants=tenants, steps=steps, seed=seed)
    assert len(w.schedule) == w.num_steps == steps
    seen: dict[str, int] = {}
    replays = {a.name: AgentReplay(w.schedule.count(a.name), seed=a.seed, scale=a.scale)
               for a in w.agents}
    for i, st in enumerate(w.steps()):
        assert isinstance(st, AgentStep)
        assert (st.step, st.agent) == (i, w.schedule[i])
        assert st.tenant == w.agent(st.agent).tenant
        assert st.agent_turn == seen.get(st.agent, 0)
        assert st.user_message == replays[st.agent].turn(st.agent_turn).user_message
        assert st.kind in ("round_robin", "burst", "return")
        assert w.turns_of(st.agent)[st.agent_turn] == i
        seen[st.agent] = st.agent_turn + 1
    assert set(seen) == {a.name for a in w.agents}
    assert min(seen.values()) >= 2, seen
    # the opening is one round-robin pass over every agent, in order
    assert w.schedule[:agents] == tuple(a.name for a in w.agents)
    assert all(w.step(i).kind == "round_robin" for i in range(agents))


@pytest.mark.parametrize(("agents", "tenants", "steps", "seed"), SHAPES)
def test_schedule_mixes_round_robin_bursts_and_returns_after_long_pauses(
        agents: int, tenants: int, steps: int, seed: int) -> None:
    w = MultiAgentWorkload(agents, num_tenants=tenants, steps=steps, seed=seed)
    kinds = [st.kind for st in w.steps()]
    assert {"round_robin", "burst", "return"} <= set(kinds)
    # bursts: one agent 2-3 steps in a row, nothing else labelled burst
    for name, start, length in runs(w.schedule):
        labels = set(kinds[start:start + length])
        if "burst" in labels:
            assert labels == {"burst"} and 2 <= length <= 3, (name, start, length)
        else:
            assert length == 1, f"{name} acts {length} times in a row at step {start}"
    # returns: 1-2 agents, each back after a pause of at least 2 x num_agents steps
    returns = [i for i, k in enumerate(kinds) if k == "return"]
    assert 1 <= len(returns) <= 2
    assert list(w.returners) == [w.schedule[i] for i in returns]
    for i in returns:
        name = w.schedule[i]
        before = [j for j in range(i) if w.schedule[j] == name]
        assert before, f"{name} returns at step {i} without an early turn"
        assert i - before[-1] - 1 >= 2 * agents, (name, before[-1], i)
        assert before[-1] < agents  # it acted early: in the opening round
    # round-robin: a stretch where every agent acting between opening and returns
    # takes one turn, all different
    active = len({w.schedule[j] for j in range(agents, returns[0])})
    stretch = next(j for j in range(agents, returns[0]) if kinds[j] == "round_robin")
    window = w.schedule[stretch:stretch + active]
    assert len(set(window)) == active and set(kinds[stretch:stretch + active]) == {"round_robin"}


@pytest.mark.parametrize(("agents", "tenants", "steps", "seed"), SHORT)
def test_a_schedule_too_short_for_a_pause_has_no_returns(
        agents: int, tenants: int, steps: int, seed: int) -> None:
    w = MultiAgentWorkload(agents, num_tenants=tenants, steps=steps, seed=seed)
    assert w.returners == ()
    assert "return" not in {st.kind for st in w.steps()}
    assert w.schedule[agents:2 * agents] != () and \
        set(w.schedule[agents:2 * agents]) == {a.name for a in w.agents}


def test_the_default_schedule_has_the_documented_shape(workload: MultiAgentWorkload) -> None:
    kinds = [st.kind for st in workload.steps()]
    assert [i for i, k in enumerate(kinds) if k == "return"] == [24, 25]
    returners = set(workload.returners)
    assert len(returners) == 2
    assert not returners & set(workload.schedule[6:24])
    assert returners <= set(workload.schedule[26:])
    assert kinds[6:24].count("burst") >= 4
    # exactly as the module docstring tells it
    letter = {"round_robin": "r", "burst": "B", "return": "R"}
    assert "".join(letter[k] for k in kinds) == "rrrrrrrrrrBBBrrrrBBBrrrrRRrrrrrrBBBr"
    assert workload.returners == ("agent-0", "agent-3")
    assert sorted(len(workload.turns_of(a.name)) for a in workload.agents)[::5] == [3, 9]


# ---------------------------------------------------------------------------- look-ahead


def scan_next(schedule: tuple[str, ...], agent: str, i: int) -> int | None:
    for j in range(i + 1, len(schedule)):
        if schedule[j] == agent:
            return j - i
    return None


@pytest.mark.parametrize(("agents", "tenants", "steps", "seed"), SHAPES + SHORT)
def test_lookahead_matches_a_direct_scan_of_the_schedule(
        agents: int, tenants: int, steps: int, seed: int) -> None:
    w = MultiAgentWorkload(agents, num_tenants=tenants, steps=steps, seed=seed)
    names = [a.name for a in w.agents]
    for i in range(-1, steps):
        expected = {name: scan_next(w.schedule, name, i) for name in names}
        assert w.lookahead(i) == expected, i
        assert list(w.lookahead(i)) == names
        for name in names:
            assert w.steps_to_next(name, i) == expected[name]
        if i + 1 < steps:
            assert w.steps_to_next(w.schedule[i + 1], i) == 1
        for horizon in range(0, steps + 2):
            want: list[str] = []
            for j in range(i + 1, min(steps, i + 1 + horizon)):
                if w.schedule[j] not in want:
                    want.append(w.schedule[j])
            assert w.upcoming(i, horizon) == want, (i, horizon)
    assert all(v is None for v in w.lookahead(steps - 1).values())


def test_returners_are_foreseen_far_ahead_then_due(workload: MultiAgentWorkload) -> None:
    returner = workload.returners[0]
    back = workload.turns_of(returner)[1]
    assert workload.steps_to_next(returner, 6) == back - 6 >= 12
    assert workload.steps_to_next(returner, back - 1) == 1
    assert returner not in workload.upcoming(6, 12)
    assert workload.upcoming(back - 1, 1) == [returner]


# ---------------------------------------------------------------------------- prompts


def test_sections_come_in_the_contract_order_and_the_stable_ones_lead(
        workload: MultiAgentWorkload) -> None:
    assert set(ORDER) == set(REPLAY_LAYERS)
    for i in range(workload.num_steps):
        prompt = workload.system_prompt(i)
        assert tuple(s.layer for s in prompt.sections) == ORDER
        assert coerce_prompt(prompt, CONFIG) is prompt  # the pipeline takes it as it is
    stable = [CONFIG.get(layer).stable for layer in ORDER]
    assert stable[:4] == [True] * 4 and not any(stable[4:])


@pytest.mark.parametrize(("agents", "tenants", "steps", "seed"), [SHAPES[0], SHAPES[5]])
def test_org_layers_are_shared_within_a_tenant_and_differ_across_tenants(
        agents: int, tenants: int, steps: int, seed: int) -> None:
    w = MultiAgentWorkload(agents, num_tenants=tenants, steps=steps, seed=seed)
    by_tenant: dict[str, dict[str, list[str]]] = {}
    for i in range(steps):
        prompt, tenant = w.system_prompt(i), w.step(i).tenant
        org = {layer: lines(prompt, layer) for layer in ORG}
        # identical for every agent and every turn of a tenant
        assert by_tenant.setdefault(tenant, org) == org, (i, tenant)
    assert len(by_tenant) == tenants
    tenant_names = sorted(by_tenant)
    for a in tenant_names:
        for b in tenant_names:
            if a < b:
                for layer in ORG:
                    assert by_tenant[a][layer] != by_tenant[b][layer], (a, b, layer)
        # the organisation picks its own tools: not merely another header line
        assert any(by_tenant[a]["capabilities"][1:] != by_tenant[b]["capabilities"][1:]
                   for b in tenant_names if b != a)
    # each org layer is the replay's text (or a selection of it) under a tenant header
    replay = AgentReplay(1).build_system_message(0)
    for org in by_tenant.values():
        assert org["axioms"][1:] == lines(replay, "axioms")
        for layer in ("system_knowledge", "capabilities"):
            kept = org[layer][1:]
            assert set(kept) <= set(lines(replay, layer))
            assert len(kept) < len(lines(replay, layer))


def test_identity_is_each_agents_own(workload: MultiAgentWorkload) -> None:
    prompts = first_prompt_of_each_agent(workload)
    identities = {name: lines(p, "identity") for name, p in prompts.items()}
    assert len({tuple(v) for v in identities.values()}) == workload.num_agents
    for name, text in identities.items():
        spec = workload.agent(name)
        assert f"You are {name}," in text[0] and spec.tenant in text[0]
        assert not any("Atlas" in line for line in text)
    # an agent keeps its identity across its turns
    for name in identities:
        for i in workload.turns_of(name):
            assert lines(workload.system_prompt(i), "identity") == identities[name]


def test_state_and_time_change_per_agent_turn_as_in_the_agents_replay(
        workload: MultiAgentWorkload) -> None:
    for spec in workload.agents:
        turns = workload.turns_of(spec.name)
        replay = AgentReplay(len(turns), seed=spec.seed, scale=spec.scale)
        for t, i in enumerate(turns):
            prompt = workload.system_prompt(i)
            own = replay.build_system_message(t)
            for layer in ORDER[4:]:
                assert lines(prompt, layer) == lines(own, layer), (spec.name, t, layer)
        first, second = (workload.system_prompt(i) for i in turns[:2])
        assert lines(first, "current_time") != lines(second, "current_time")
        assert lines(first, "system_state") != lines(second, "system_state")
        for layer in (*ORG, "identity", "affect"):
            assert lines(first, layer) == lines(second, layer)


@pytest.mark.parametrize(("agents", "tenants", "steps", "seed"),
                         [SHAPES[0], SHAPES[1], SHAPES[4], SHORT[1]])
def test_each_prompt_is_1500_to_3000_tokens_at_scale_1_and_fits_the_budgets(
        agents: int, tenants: int, steps: int, seed: int,
        count_tokens: Callable[[str], int]) -> None:
    w = MultiAgentWorkload(agents, num_tenants=tenants, steps=steps, seed=seed)
    sizes: dict[str, list[int]] = {}
    for i in range(steps):
        prompt = w.system_prompt(i)
        tokens = pipeline_tokens(prompt, count_tokens)
        assert 1500 <= tokens <= 3000, (i, w.schedule[i], tokens)
        sizes.setdefault(w.schedule[i], []).append(tokens)
        for section in prompt.sections:  # the pipeline keeps every line
            _, spilled = synthesize_for_budget(section.lines, CONFIG.get(section.layer).budget,
                                               count_tokens)
            assert not spilled, (i, section.layer)
    if agents >= 6:  # the agents differ in size: the smallest and largest 500+ apart
        means = [sum(v) / len(v) for v in sizes.values()]
        assert max(means) - min(means) >= 500, means


def test_org_layers_are_the_leading_shared_tokens(count_tokens: Callable[[str], int],
                                                  workload: MultiAgentWorkload) -> None:
    prompts = first_prompt_of_each_agent(workload)
    a, b = (prompts[s.name] for s in workload.agents if s.tenant == "org-a")
    shared = StructuredPrompt(a.sections[:3])
    assert shared == StructuredPrompt(b.sections[:3])
    assert 1000 <= pipeline_tokens(shared, count_tokens) <= 1500


def test_pipelines_of_one_tenant_reuse_the_org_blocks_on_the_real_model(
        fresh: Callable[..., Engine], workload: MultiAgentWorkload) -> None:
    """Driven as the bench drives it: one pipeline per agent over one engine."""
    engine = fresh(device=640, host=64)
    pipelines: dict[str, CacheAwareContextPipeline] = {}
    reused: dict[str, int] = {}
    for i in (0, 3, 1):  # agent-0 and agent-3 of org-a, then agent-1 of org-b
        st = workload.step(i)
        pipeline = pipelines.setdefault(st.agent, CacheAwareContextPipeline(
            engine, tenant=st.tenant, agent=st.agent))
        built = pipeline.build(workload.system_prompt(i))
        assert built.stable_layers == ORDER[:4]
        assert built.report.spilled_lines == 0
        result = pipeline.generate(st.user_message, max_new_tokens=1)
        assert 1500 <= result.generation.prompt_tokens <= 3100
        reused[st.agent] = result.generation.reused_tokens
    assert reused["agent-0"] == 0
    # the org layers (~1.25K tokens) come from agent-0's blocks; identity differs
    assert 1000 <= reused["agent-3"] <= 1500, reused
    assert reused["agent-1"] < 16, reused  # another tenant shares nothing past the header


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize(("kwargs", "match"), [
    pytest.param({"num_agents": 1}, "num_agents must be an int >= 2", id="one-agent"),
    pytest.param({"num_agents": 2.5}, "num_agents must be an int", id="float-agents"),
    pytest.param({"num_agents": True}, "num_agents must be an int", id="bool-agents"),
    pytest.param({"num_tenants": 0}, "num_tenants must be an int >= 1", id="no-tenant"),
    pytest.param({"num_tenants": 7}, "num_tenants must be at most num_agents", id="7-of-6"),
    pytest.param({"steps": 11}, "every agent needs 2 turns", id="11-steps"),
    pytest.param({"scale": 0.0}, "scale must be a finite number > 0", id="scale-0"),
    pytest.param({"scale": float("nan")}, "scale must be", id="scale-nan"),
    pytest.param({"scale": "1"}, "scale must be", id="scale-str"),
    pytest.param({"seed": "0"}, "seed must be an int", id="seed-str"),
])
def test_bad_arguments_raise_one_line_value_errors(kwargs: dict[str, object],
                                                   match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        MultiAgentWorkload(**kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


def test_bad_names_and_indices_say_what_exists(workload: MultiAgentWorkload) -> None:
    with pytest.raises(KeyError, match="agent-0, agent-1") as err:
        workload.agent("agent-9")
    assert "\n" not in str(err.value)
    with pytest.raises(KeyError, match="unknown agent"):
        workload.steps_to_next("nobody", 0)
    for bad in (-1, 36):
        with pytest.raises(IndexError, match=r"steps 0\.\.35"):
            workload.step(bad)
        with pytest.raises(IndexError, match=r"steps 0\.\.35"):
            workload.system_prompt(bad)
    for bad in (-2, 36):
        with pytest.raises(IndexError, match=r"-1 \(before the first step\)\.\.35"):
            workload.lookahead(bad)
        with pytest.raises(IndexError):
            workload.steps_to_next("agent-0", bad)
        with pytest.raises(IndexError):
            workload.upcoming(bad, 1)
    with pytest.raises(ValueError, match="horizon must be an int >= 0"):
        workload.upcoming(0, -1)


def test_specs_are_frozen(workload: MultiAgentWorkload) -> None:
    spec = workload.agents[0]
    assert isinstance(spec, AgentSpec)
    with pytest.raises(AttributeError):
        spec.scale = 2.0  # type: ignore[misc]
