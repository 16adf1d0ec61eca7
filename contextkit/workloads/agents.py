"""A deterministic multi-agent workload: many agents of several tenants taking turns.

Shared by ``contextkit bench agents`` and the demo. Each agent is one
:class:`~contextkit.workloads.replay.AgentReplay` (its own seed and scale) wearing its
organisation's layers: ``axioms``, ``system_knowledge`` and ``capabilities`` are
identical for every agent of a tenant (an organisation header line, the replay's
axioms, and the organisation's own selection of the replay's rules and tools) and
differ across tenants; ``identity`` is the agent's own (its name, role and
organisation). Sections come in the order ``axioms``, ``system_knowledge``,
``capabilities``, ``identity``, then the rest in :data:`~contextkit.workloads.replay.REPLAY_LAYERS`
order, so the agents of one tenant share their leading ~1.25K tokens. Per agent turn,
``system_state``, ``current_time`` and ``memories`` change as in the replay (the
agent's own replay turn); the user message is that turn's replay message.

Sizes with the defaults (6 agents, agent ``i`` in tenant ``i % 3``, 36 steps, SmolLM2
tokenizer): the organisation layers are about 1.25K tokens (axioms ~200, rules ~370,
tools ~690), the identity ~240; replay scales of 0.05-0.26 (the ladder
``_BASE_SCALES``, cycled over the agents, times the workload ``scale``) give prompts of
2.1K-2.8K tokens at ``scale=1`` (2.05K-2.85K over seeds 0-3 and 2-12 agents), within
1.5K-3K; ``scale`` grows only the replay's expandable layers.

The schedule (seeded): an opening round-robin over all agents; then, when there is
room (``steps >= 3 * num_agents + returners``), one agent (two from 4 agents on)
pauses after the opening for at least ``2 * num_agents`` steps and returns at about
two thirds of the run, while the others alternate round-robin passes (a seeded
order) and bursts (one agent 2-3 steps in a row); after the return everyone takes
part. With the defaults (seed 0): steps 0-5 a round-robin, 6-23 passes over the 4
other agents with two 3-step bursts, then agent-0 and agent-3 (both of org-a) return
at steps 24-25 after pauses of 23 and 21 steps, then 10 mixed steps with one more
burst (``rrrrrrrrrrBBBrrrrBBBrrrrRRrrrrrrBBBr``); the agents take 3-9 turns each.
Every agent has at least 2 turns. :meth:`MultiAgentWorkload.lookahead` gives each
agent's steps until its next turn (KVFlow's steps-to-execution), for a tier manager
to spill the agents due furthest and warm the next one. Everything derives from
string-seeded ``random.Random`` instances; nothing reads the clock.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass
from numbers import Real

from contextkit.prompt.markup import PromptLine, PromptSection, StructuredPrompt
from contextkit.workloads.replay import REPLAY_LAYERS, AgentReplay

__all__ = ["AgentSpec", "AgentStep", "MultiAgentWorkload"]

#: The layers an organisation shares among its agents, first in every prompt.
ORG_LAYERS: tuple[str, ...] = ("axioms", "system_knowledge", "capabilities")
#: Section order of every agent's prompt.
SECTION_ORDER: tuple[str, ...] = (
    *ORG_LAYERS, "identity", *(name for name in REPLAY_LAYERS
                               if name not in (*ORG_LAYERS, "identity")))

STEP_KINDS: tuple[str, ...] = ("round_robin", "burst", "return")

# replay scale per agent (cycled) at workload scale 1: 2.1K-2.8K-token prompts
_BASE_SCALES: tuple[float, ...] = (0.05, 0.18, 0.1, 0.22, 0.14, 0.26)
_ORG_NAMES: tuple[str, ...] = (
    "Brightloom", "Northwind Freight", "Kestrel Health", "Aurora Games", "Tidewater Bank",
    "Juniper Labs", "Marlow Insurance", "Cobalt Energy",
)
# (role, what the agent does), cycled over the agents
_ROLES: tuple[tuple[str, str], ...] = (
    ("incident responder", "You triage alerts and drive incidents to mitigation."),
    ("release manager", "You watch deploys, canaries and rollbacks and keep the release log."),
    ("cost analyst", "You explain cloud spend and propose savings with their risks."),
    ("capacity planner", "You forecast load and size replicas, pools and limits ahead of events."),
    ("on-call scribe", "You keep incident timelines, status updates and handoff notes."),
    ("database steward", "You watch database health, slow queries and connection pools."),
    ("security reviewer", "You review access changes, secrets handling and exposed endpoints."),
    ("platform guide", "You answer developers' questions about the platform and its runbooks."),
)
# lines of the replay's rules and tools every organisation keeps (importance at least)
_ORG_KEEP_IMPORTANCE = 0.85
_ORG_EXTRA_RULES = 4
_ORG_EXTRA_TOOLS = 9
_BURST_LENGTHS = (2, 3)


@dataclass(frozen=True)
class AgentSpec:
    """One agent of the workload.

    Attributes:
        name: ``agent-0``, ``agent-1``, ... (valid per :func:`gpu_cache.validate_name`).
        tenant: ``org-a``, ``org-b``, ...; agent ``i`` belongs to tenant ``i % num_tenants``.
        seed: the seed of the agent's replay.
        scale: the agent's :class:`~contextkit.workloads.replay.AgentReplay` scale (its entry of
            the base ladder times the workload scale); at workload scale 1.0 it gives a
            1.5K-3K-token prompt.
    """

    name: str
    tenant: str
    seed: int
    scale: float


@dataclass(frozen=True)
class AgentStep:
    """One step of the schedule.

    Attributes:
        step: 0-based position in the schedule.
        agent: the agent acting.
        tenant: its tenant.
        agent_turn: 0-based turn of this agent (its own replay turn index).
        user_message: what the user says to the agent on this turn.
        kind: ``round_robin``, ``burst`` or ``return``: the part of the schedule
            that placed this step.
    """

    step: int
    agent: str
    tenant: str
    agent_turn: int
    user_message: str
    kind: str


def _tenant_name(index: int) -> str:
    """``org-a`` .. ``org-z``, then ``org-aa``, ``org-ab``, ... (spreadsheet columns)."""
    letters = ""
    n = index + 1
    while n:
        n, rem = divmod(n - 1, 26)
        letters = chr(ord("a") + rem) + letters
    return f"org-{letters}"


def _org_name(index: int) -> str:
    name = _ORG_NAMES[index % len(_ORG_NAMES)]
    return name if index < len(_ORG_NAMES) else f"{name} {index // len(_ORG_NAMES) + 1}"


def _rng(seed: int, *parts: object) -> random.Random:
    """A generator seeded from a string (SHA-512 based; PYTHONHASHSEED does not matter)."""
    return random.Random(":".join(str(p) for p in ("contextkit-agents", seed, *parts)))


def _count(value: object, name: str, minimum: int, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}; {hint}")
    return value


def _select(lines: tuple[PromptLine, ...], extra: int, rng: random.Random,
            skip: int = 0) -> list[PromptLine]:
    """The lines at or above the keep importance plus ``extra`` drawn others, in order."""
    body = lines[skip:]
    keep = {i for i, line in enumerate(body) if line.importance >= _ORG_KEEP_IMPORTANCE}
    rest = [i for i in range(len(body)) if i not in keep]
    keep.update(rng.sample(rest, min(extra, len(rest))))
    return [*lines[:skip], *(body[i] for i in sorted(keep))]


class MultiAgentWorkload:
    """Agents of several tenants taking turns in a seeded schedule.

    Args:
        num_agents: agents (>= 2), named ``agent-0``...
        num_tenants: tenants (1..num_agents); agent ``i`` belongs to tenant
            ``i % num_tenants``.
        steps: length of the schedule (>= ``2 * num_agents``, so that every agent
            has at least 2 turns; from ``3 * num_agents + 1`` or ``+ 2`` on it also
            holds the pause-and-return part).
        seed: seed of the schedule, the organisations' selections and the agents'
            replay seeds.
        scale: multiplies every agent's replay scale (1.0: 1.5K-3K-token prompts).

    Raises:
        ValueError: any argument outside those ranges (one line saying what to pass).
    """

    num_agents: int
    num_tenants: int
    num_steps: int
    seed: int
    scale: float
    agents: tuple[AgentSpec, ...]
    schedule: tuple[str, ...]

    def __init__(self, num_agents: int = 6, *, num_tenants: int = 3, steps: int = 36,
                 seed: int = 0, scale: float = 1.0) -> None:
        num_agents = _count(num_agents, "num_agents", 2, "a workload needs at least 2 agents")
        num_tenants = _count(num_tenants, "num_tenants", 1,
                             f"pass 1..num_agents ({num_agents}) tenants")
        if num_tenants > num_agents:
            raise ValueError(f"num_tenants must be at most num_agents ({num_agents}), got "
                             f"{num_tenants}; every tenant needs an agent")
        steps = _count(steps, "steps", 2 * num_agents,
                       f"every agent needs 2 turns, so pass at least 2 x {num_agents} steps")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if (isinstance(scale, bool) or not isinstance(scale, Real)
                or not math.isfinite(scale) or not scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {scale!r}; 1.0 gives "
                             "1.5K-3K-token prompts")
        self.num_agents = num_agents
        self.num_tenants = num_tenants
        self.num_steps = steps
        self.seed = seed
        self.scale = float(scale)
        self.agents = tuple(
            AgentSpec(name=f"agent-{i}", tenant=_tenant_name(i % num_tenants),
                      seed=seed * 1009 + i,
                      scale=_BASE_SCALES[i % len(_BASE_SCALES)] * self.scale)
            for i in range(num_agents))
        self._by_name: dict[str, AgentSpec] = {a.name: a for a in self.agents}
        self._index: dict[str, int] = {a.name: i for i, a in enumerate(self.agents)}
        plan = self._plan()
        self.schedule = tuple(agent for agent, _ in plan)
        self._kinds: tuple[str, ...] = tuple(kind for _, kind in plan)
        self._turns: dict[str, list[int]] = {a.name: [] for a in self.agents}
        self._agent_turn: list[int] = []
        for i, agent in enumerate(self.schedule):
            self._agent_turn.append(len(self._turns[agent]))
            self._turns[agent].append(i)
        self._replays: dict[str, AgentReplay] = {
            a.name: AgentReplay(len(self._turns[a.name]), seed=a.seed, scale=a.scale)
            for a in self.agents}
        self._org: dict[str, dict[str, tuple[PromptLine, ...]]] = {}

    # ------------------------------------------------------------------ schedule
    @property
    def returners(self) -> tuple[str, ...]:
        """The agents that pause after the opening and return later (may be empty)."""
        return tuple(dict.fromkeys(a for a, k in zip(self.schedule, self._kinds, strict=True)
                                   if k == "return"))

    def _plan(self) -> list[tuple[str, str]]:
        """The schedule as (agent, kind) pairs."""
        rng = _rng(self.seed, "schedule", self.num_agents, self.num_steps)
        names = [a.name for a in self.agents]
        n, total = len(names), self.num_steps
        plan = [(name, "round_robin") for name in names]
        num_returners = 1 if n < 4 else 2
        if total < 3 * n + num_returners:
            plan += self._fill(rng, names, total - len(plan), plan[-1][0])
            return plan
        returners = sorted(rng.sample(names, num_returners), key=names.index)
        # the last opening step is n - 1: a return at 3n or later pauses >= 2n steps
        ret_start = min(max(3 * n, (2 * total) // 3), total - num_returners)
        active = [name for name in names if name not in returners]
        plan += self._fill(rng, active, ret_start - len(plan), plan[-1][0])
        plan += [(name, "return") for name in returners]
        plan += self._fill(rng, names, total - len(plan), plan[-1][0])
        return plan

    @staticmethod
    def _fill(rng: random.Random, active: list[str], length: int,
              prev: str) -> list[tuple[str, str]]:
        """``length`` steps of round-robin passes over ``active`` alternating with bursts.

        A pass comes first, so every active agent gets a turn when ``length`` allows; a
        burst is never cut below 2 steps (a pass fills the end instead); no part starts
        with the agent that acted just before (when there is a choice).
        """
        out: list[tuple[str, str]] = []
        burst = False
        bursters: list[str] = []  # a seeded rotation, so bursts spread over the agents
        while len(out) < length:
            if burst and length - len(out) >= _BURST_LENGTHS[0]:
                if not bursters:
                    bursters = rng.sample(active, len(active))
                pick = next((a for a in bursters if a != prev), bursters[0])
                bursters.remove(pick)
                size = min(rng.choice(_BURST_LENGTHS), length - len(out))
                out += [(pick, "burst")] * size
            else:
                order = rng.sample(active, len(active))
                if len(order) > 1 and order[0] == prev:
                    order = order[1:] + order[:1]
                out += [(agent, "round_robin") for agent in order]
            prev = out[-1][0]
            burst = not burst
        return out[:length]

    def agent(self, name: str) -> AgentSpec:
        """The spec of agent ``name``.

        Raises:
            KeyError: an unknown name (the message lists the known ones).
        """
        try:
            return self._by_name[name]
        except (KeyError, TypeError):
            raise KeyError(f"unknown agent {name!r}; this workload has "
                           f"{', '.join(self._by_name)}") from None

    def _check_step(self, i: int, *, allow_before: bool = False) -> int:
        low = -1 if allow_before else 0
        if isinstance(i, bool) or not isinstance(i, int) or not low <= i < self.num_steps:
            where = "-1 (before the first step).." if allow_before else "0.."
            raise IndexError(f"step {i!r} is out of range; this workload has steps "
                             f"{where}{self.num_steps - 1}")
        return i

    def step(self, i: int) -> AgentStep:
        """Step ``i`` of the schedule.

        Raises:
            IndexError: ``i`` outside ``0..num_steps-1``.
        """
        self._check_step(i)
        name = self.schedule[i]
        turn = self._agent_turn[i]
        return AgentStep(step=i, agent=name, tenant=self._by_name[name].tenant,
                         agent_turn=turn, user_message=self._replays[name].turn(turn).user_message,
                         kind=self._kinds[i])

    def steps(self) -> list[AgentStep]:
        """Every step in order."""
        return [self.step(i) for i in range(self.num_steps)]

    def turns_of(self, agent: str) -> tuple[int, ...]:
        """The steps at which ``agent`` acts, in order.

        Raises:
            KeyError: an unknown agent.
        """
        return tuple(self._turns[self.agent(agent).name])

    # ------------------------------------------------------------------ look-ahead
    def steps_to_next(self, agent: str, i: int) -> int | None:
        """Steps after step ``i`` until ``agent``'s next turn (1: the next step).

        ``i = -1`` asks before the first step. ``None``: the agent does not act again.

        Raises:
            KeyError: an unknown agent.
            IndexError: ``i`` outside ``-1..num_steps-1``.
        """
        turns = self._turns[self.agent(agent).name]
        self._check_step(i, allow_before=True)
        at = bisect.bisect_right(turns, i)
        return turns[at] - i if at < len(turns) else None

    def lookahead(self, i: int) -> dict[str, int | None]:
        """:meth:`steps_to_next` of every agent as seen after step ``i`` (``-1``: before
        the first step), in agent order.

        Raises:
            IndexError: ``i`` outside ``-1..num_steps-1``.
        """
        self._check_step(i, allow_before=True)
        return {a.name: self.steps_to_next(a.name, i) for a in self.agents}

    def upcoming(self, i: int, horizon: int) -> list[str]:
        """The distinct agents due in steps ``i+1..i+horizon``, in order of first turn.

        Raises:
            IndexError: ``i`` outside ``-1..num_steps-1``.
            ValueError: ``horizon < 0``.
        """
        self._check_step(i, allow_before=True)
        if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 0:
            raise ValueError(f"horizon must be an int >= 0 (steps to look ahead), got "
                             f"{horizon!r}")
        return list(dict.fromkeys(self.schedule[i + 1:i + 1 + horizon]))

    # ------------------------------------------------------------------ prompts
    def _org_sections(self, tenant: str, base: StructuredPrompt) -> dict[str,
                                                                         tuple[PromptLine, ...]]:
        """The organisation layers of ``tenant`` (built once, so identical for its agents)."""
        org = self._org.get(tenant)
        if org is not None:
            return org
        index = next(i for i in range(self.num_tenants) if _tenant_name(i) == tenant)
        name = _org_name(index)
        rng = _rng(self.seed, "org", tenant)

        def lines(layer: str) -> tuple[PromptLine, ...]:
            section = base.section(layer)
            assert section is not None, layer
            return section.lines

        org = {
            "axioms": (PromptLine(f"Organisation {name} (tenant {tenant}): these rules bind "
                                  f"every agent of {name}.", 1.0), *lines("axioms")),
            "system_knowledge": (
                PromptLine(f"{name} operating rules, shared by every agent of {name}.", 1.0),
                *_select(lines("system_knowledge"), _ORG_EXTRA_RULES, rng)),
            # the first tools line is the calling convention; the tools are the org's pick
            "capabilities": (
                PromptLine(f"Tools enabled for {name}; others are not available.", 1.0),
                *_select(lines("capabilities"), _ORG_EXTRA_TOOLS, rng, skip=1)),
        }
        self._org[tenant] = org
        return org

    def _identity(self, spec: AgentSpec, base: StructuredPrompt) -> tuple[PromptLine, ...]:
        index = self._index[spec.name]
        role, duty = _ROLES[index % len(_ROLES)]
        org = _org_name(next(i for i in range(self.num_tenants)
                             if _tenant_name(i) == spec.tenant))
        section = base.section("identity")
        assert section is not None
        # the replay's first two lines name its own assistant and company
        return (PromptLine(f"You are {spec.name}, the {role} agent of {org} (tenant "
                           f"{spec.tenant}).", 1.0),
                PromptLine(duty, 0.9),
                *section.lines[2:])

    def system_prompt(self, i: int) -> StructuredPrompt:
        """The layered system prompt of the agent acting at step ``i`` (its agent turn).

        Sections: ``axioms``, ``system_knowledge``, ``capabilities`` (the tenant's),
        ``identity`` (the agent's), then the replay's other layers in
        :data:`~contextkit.workloads.replay.REPLAY_LAYERS` order.

        Raises:
            IndexError: ``i`` outside ``0..num_steps-1``.
        """
        self._check_step(i)
        spec = self._by_name[self.schedule[i]]
        base = self._replays[spec.name].build_system_message(self._agent_turn[i])
        own = {s.layer: s.lines for s in base.sections}
        own.update(self._org_sections(spec.tenant, base))
        own["identity"] = self._identity(spec, base)
        return StructuredPrompt(tuple(PromptSection(layer, own[layer])
                                      for layer in SECTION_ORDER))

    def describe(self) -> dict[str, object]:
        """A JSON-ready summary: sizes, agents, tenants, returners and the schedule."""
        return {
            "num_agents": self.num_agents,
            "num_tenants": self.num_tenants,
            "num_steps": self.num_steps,
            "seed": self.seed,
            "scale": self.scale,
            "agents": [{"name": a.name, "tenant": a.tenant, "scale": a.scale,
                        "turns": len(self._turns[a.name])} for a in self.agents],
            "returners": list(self.returners),
            "schedule": list(self.schedule),
            "kinds": list(self._kinds),
        }
