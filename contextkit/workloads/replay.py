"""A deterministic agent replay workload: a 10-layer SRE assistant and a 20-turn session.

Shared by the demo and the TTFT benchmark. The agent is *Atlas*, the SRE/DevOps
assistant of a small online retailer's platform team, helping the on-call engineer
through a checkout latency incident (investigate, find the deploy, roll back, write
the summary), then a cost question and sale capacity planning.

Per turn, ``current_time`` and ``system_state`` change (the platform snapshot is
regenerated from a seeded RNG, the turn index and the incident's phase), and
``memories`` change when the topic of the user message changes (about every 3-5
turns). ``axioms``, ``identity``, ``system_knowledge``, ``capabilities``,
``neurons``, ``affect`` and ``awareness`` stay byte-identical for the whole session.

At ``scale=1`` every layer holds 80-95% of its default token budget (SmolLM2
tokenizer), about 6K tokens in all. ``scale`` grows the layers that have expanded
budgets (``system_state``, ``neurons``, ``memories``, ``awareness``) so that the
whole prompt is about ``scale`` times the ``scale=1`` prompt, each layer growing in
proportion to its expanded-budget headroom (``scale=5``: about 30K tokens, every
expandable layer 1.6-1.8x over its expanded budget, for ``synthesize_for_budget`` to
trim). Everything is derived from ``random.Random`` instances seeded with strings
(SHA-512 based, independent of ``PYTHONHASHSEED``); nothing reads the wall clock.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from contextkit.prompt.markup import PromptLine, PromptSection, StructuredPrompt, render_marked
from contextkit.workloads.replay_content import (
    AFFECT,
    AWARENESS_BASE,
    AXIOMS,
    BASE_AWARENESS_LINES,
    BASE_MEMORY_TOKENS,
    BASE_NEURON_LINES,
    BASE_STATE_LINES,
    CAPABILITIES,
    CLUSTERS,
    CUSTOMER_FACING,
    DEPLOY_SIGNS,
    HANDOFF,
    IDENTITY,
    NEURONS_CORE,
    RELATED,
    SCRIPT,
    SERVICE_NAMES,
    SERVICES,
    SESSION_DAY,
    SYMPTOMS,
    SYSTEM_KNOWLEDGE,
    TOPIC_QUERIES,
    Lines,
    clamp_importance,
    confidence_importance,
    estimate_tokens,
    fill_tokens,
    multipliers,
    prompt_lines,
    random_date,
    seeded_rng,
    take_lines,
)
from contextkit.workloads.replay_memories import (
    GENERAL_MEMORIES,
    MEMORY_TEMPLATES,
    SLOT_CHOICES,
    ReplayMemory,
    memory_slots,
)

if TYPE_CHECKING:
    from contextkit.loop.reservations import MemoryCandidate
    from memory_graph.graph import MemoryGraph

__all__ = ["REPLAY_LAYERS", "AgentReplay", "ReplayTurn"]

REPLAY_LAYERS: tuple[str, ...] = (
    "axioms", "identity", "system_knowledge", "capabilities", "system_state", "current_time",
    "neurons", "memories", "affect", "awareness",
)

#: user messages (with the replies after them) that :meth:`AgentReplay.memory_candidates`
#: queries the memory graph with; measured on the 20-turn replay (see its docstring)
CANDIDATE_WINDOW = 3

@dataclass(frozen=True)
class ReplayTurn:
    """One scripted turn of the replay.

    Attributes:
        index: 0-based turn number.
        user_message: what the user says on this turn.
        topic: the conversation topic (``latency``, ``deploy``, ``rollback``,
            ``incident``, ``cost`` or ``capacity``); memories follow it.
        changed_layers: layers whose text differs from the previous turn, in
            :data:`REPLAY_LAYERS` order (all layers on turn 0).
    """

    index: int
    user_message: str
    topic: str
    changed_layers: tuple[str, ...]


class AgentReplay:
    """The deterministic replay: a layered system prompt per turn of a scripted session.

    Args:
        turns: number of turns (>= 1); beyond the 20 scripted messages the script
            repeats while the clock and the platform snapshot move on.
        seed: seed of every generated number and choice.
        scale: content multiplier of the expandable layers (``system_state``,
            ``neurons``, ``memories``, ``awareness``): 1.0 fits the default budgets
            (about 6K tokens); larger values grow the whole prompt about ``scale``-fold
            (5.0: about 30K tokens, beyond the expanded budgets, for trimming);
            values below 1 shrink those layers.
        memory_graph: when given, ``memories`` come from
            :func:`memory_graph.layer.memories_layer_lines` with a query that depends
            only on the topic (seed the graph with :meth:`seed_memory` first); the
            graph is queried once per topic and instance, so a new instance sees
            later graph changes. Otherwise memories are a scripted, topic-keyed
            selection of :meth:`memory_corpus`. Either way they are cut to the
            layer's size (about 960 tokens at ``scale=1``), best first.
        tenant: the memory graph tenant used for seeding and queries.

    Raises:
        ValueError: ``turns < 1`` or ``scale <= 0``.
    """

    def __init__(self, turns: int = 20, *, seed: int = 0, scale: float = 1.0,
                 memory_graph: MemoryGraph | None = None, tenant: str = "default") -> None:
        if turns < 1:
            raise ValueError(f"turns must be >= 1, got {turns}")
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        self.num_turns = int(turns)
        self.seed = int(seed)
        self.scale = float(scale)
        self.memory_graph = memory_graph
        self.tenant = tenant
        mult = multipliers(self.scale)
        self._state_lines = max(1, round(BASE_STATE_LINES * mult["system_state"]))
        self._neuron_lines = max(1, round(BASE_NEURON_LINES * mult["neurons"]))
        self._memory_tokens = max(1, round(BASE_MEMORY_TOKENS * mult["memories"]))
        self._awareness_lines = max(1, round(BASE_AWARENESS_LINES * mult["awareness"]))
        self._memories = self._build_memories(mult["memories"])
        self._topic_memories: dict[str, Lines] = {}
        self._built_topic: str | None = None  # the memories of the last built prompt
        self._times = self._build_times()
        self._constant: dict[str, tuple[PromptLine, ...]] = {
            "axioms": prompt_lines(AXIOMS),
            "identity": prompt_lines(IDENTITY),
            "system_knowledge": prompt_lines(SYSTEM_KNOWLEDGE),
            "capabilities": prompt_lines(CAPABILITIES),
            "neurons": prompt_lines(self._neurons()),
            "affect": prompt_lines(AFFECT),
            "awareness": prompt_lines(self._awareness()),
        }

    # ------------------------------------------------------------------ turns
    def _check(self, i: int) -> int:
        if not 0 <= i < self.num_turns:
            raise IndexError(f"turn {i} is out of range; this replay has turns 0.."
                             f"{self.num_turns - 1}")
        return i

    def _script(self, i: int) -> tuple[str, str, str]:
        return SCRIPT[i % len(SCRIPT)]

    def turn(self, i: int) -> ReplayTurn:
        """Turn ``i`` (0-based) with its message, topic and changed layers.

        Raises:
            IndexError: ``i`` outside ``0..num_turns-1``.
        """
        self._check(i)
        topic, message, _ = self._script(i)
        changed = REPLAY_LAYERS if i == 0 else _diff(self._sections(i - 1), self._sections(i))
        return ReplayTurn(i, message, topic, changed)

    def turns(self) -> list[ReplayTurn]:
        """All turns in order (each prompt is built once)."""
        out: list[ReplayTurn] = []
        prev: dict[str, tuple[PromptLine, ...]] | None = None
        for i in range(self.num_turns):
            cur = self._sections(i)
            changed = REPLAY_LAYERS if prev is None else _diff(prev, cur)
            topic, message, _ = self._script(i)
            out.append(ReplayTurn(i, message, topic, changed))
            prev = cur
        return out

    def build_system_message(self, turn: int) -> StructuredPrompt:
        """The layered system prompt of ``turn``: sections in :data:`REPLAY_LAYERS` order.

        Raises:
            IndexError: ``turn`` outside ``0..num_turns-1``.
        """
        self._check(turn)
        sections = self._sections(turn)
        self._built_topic = self._script(turn)[0]
        return StructuredPrompt(tuple(PromptSection(name, sections[name])
                                      for name in REPLAY_LAYERS))

    def build_marked(self, turn: int) -> str:
        """The prompt of ``turn`` as a ``[AXIOMS]...[/AXIOMS]...`` marker string."""
        return render_marked(self.build_system_message(turn))

    def _sections(self, i: int) -> dict[str, tuple[PromptLine, ...]]:
        topic, _, _ = self._script(i)
        out = dict(self._constant)
        out["system_state"] = prompt_lines(self._system_state(i))
        out["current_time"] = prompt_lines(self._current_time(i))
        out["memories"] = prompt_lines(self._memory_lines(topic))
        return out

    # ------------------------------------------------------------------ memories
    def memory_corpus(self) -> list[str]:
        """Texts of the replay's memories (topic episodes and decisions, then general facts)."""
        return [m.text for m in self._memories]

    def seed_memory(self, graph: MemoryGraph) -> int:
        """Add the memory corpus to ``graph`` for :attr:`tenant`, with typed edges.

        Node ids are deterministic (``replay:<tenant>:<seed>:<key>``); memories already
        present are skipped, so seeding twice adds nothing. ``created_at`` is each
        memory's date, so the recency signal is the same whatever the wall clock.

        Edges: ``same_topic`` (0.5) between consecutive memories of a topic,
        ``follow_up_of`` (0.8) from a decision or lesson to the latest episode before
        it, ``applies_to`` (0.6) from a general memory to the first memory of each
        topic it fits.

        Returns:
            The number of nodes added.
        """
        ids = [f"replay:{self.tenant}:{self.seed}:{m.key}" for m in self._memories]
        new = [i for i, nid in enumerate(ids) if nid not in graph]
        if new:
            graph.add_nodes(
                [self._memories[i].text for i in new], tenant=self.tenant,
                kinds=[self._memories[i].kind for i in new], node_ids=[ids[i] for i in new],
                created_at=[datetime.strptime(self._memories[i].date, "%Y-%m-%d")
                            .replace(tzinfo=UTC).timestamp() for i in new])
        fresh = set(new)
        edges = [(ids[a], ids[b], kind, w) for a, b, kind, w in self._memory_edges()
                 if a in fresh or b in fresh]
        if edges:
            graph.add_edges(edges)
        return len(new)

    def _memory_edges(self) -> list[tuple[int, int, str, float]]:
        first: dict[str, int] = {}
        prev: dict[str, int] = {}
        last_episode: dict[str, int] = {}
        edges: list[tuple[int, int, str, float]] = []
        for i, m in enumerate(self._memories):
            if m.general:
                edges.extend((i, first[t], "applies_to", 0.6) for t in m.topics if t in first)
                continue
            topic = m.topics[0]
            first.setdefault(topic, i)
            if topic in prev:
                edges.append((i, prev[topic], "same_topic", 0.5))
            if m.kind == "semantic" and topic in last_episode:
                edges.append((i, last_episode[topic], "follow_up_of", 0.8))
            if m.kind == "episodic":
                last_episode[topic] = i
            prev[topic] = i
        return edges

    def _build_memories(self, mult: float) -> list[ReplayMemory]:
        per_topic = max(1, round(9 * mult))
        out: list[ReplayMemory] = []
        for topic, templates in MEMORY_TEMPLATES.items():
            for j in range(per_topic):
                rng = seeded_rng(self.seed, "memory", topic, j)
                slots = memory_slots(rng)
                kind, template = templates[j % len(templates)]
                out.append(ReplayMemory(f"{topic}-{j}", template.format(**slots), kind, (topic,),
                                   round(rng.uniform(0.55, 1.0), 2), slots["date"], False))
        for j, (text, kind, topics, importance, date) in enumerate(GENERAL_MEMORIES):
            out.append(ReplayMemory(f"general-{j}", text, kind, topics, importance, date, True))
        return out

    def _memory_lines(self, topic: str) -> Lines:
        """The memories of ``topic``, computed (or queried) once per topic and instance."""
        cached = self._topic_memories.get(topic)
        if cached is None:
            cached = (self._scripted_memory_lines(topic) if self.memory_graph is None
                      else self._graph_memory_lines(topic))
            self._topic_memories[topic] = cached
        return list(cached)

    def _scripted_memory_lines(self, topic: str) -> Lines:
        """Best-first memories for ``topic``: its own, then general and related ones."""
        related = RELATED.get(topic, ())

        def relevance(m: ReplayMemory) -> float:
            if m.general:
                return 0.7 if topic in m.topics else 0.4
            if m.topics[0] == topic:
                return 1.0
            return 0.55 if m.topics[0] in related else 0.15

        scored = sorted(((relevance(m) * m.importance, i) for i, m in
                         enumerate(self._memories)), key=lambda s: (-s[0], s[1]))
        return fill_tokens([(self._memories[i].text, clamp_importance(score))
                            for score, i in scored], self._memory_tokens)

    def memory_candidates(self, history: Sequence[tuple[str, str]],
                          k: int = 2) -> list[MemoryCandidate]:
        """The memories layers the conversation is likely heading to, best first.

        The prediction uses only what the agent has seen: the last
        :data:`CANDIDATE_WINDOW` user messages of ``history`` and what followed them
        (the assistant's replies), queried against the memory graph
        (:meth:`~memory_graph.MemoryGraph.hybrid_query`, ``k=10``, ``hops=1``); never
        the script's future or the turn number. Hits are grouped by the topic of
        their node (a general memory spreads its score over the topics it fits),
        topics are ranked by score mass, the topic of the last prompt built
        (:meth:`build_system_message`) is dropped, and each of the best ``k`` gets its
        layer exactly as the replay will build it (same lines, same tokens).

        Args:
            history: ``(role, text)`` messages of the conversation so far.
            k: candidates returned at most.

        Returns:
            :class:`~contextkit.loop.reservations.MemoryCandidate` objects keyed by topic,
            ``score`` the topic's share of the hits' score mass; ``[]`` without a
            memory graph (scripted memories), with ``k <= 0`` or an empty history.
        """
        from contextkit.loop.reservations import MemoryCandidate

        if self.memory_graph is None or k <= 0:
            return []
        query = _recent_text(history, CANDIDATE_WINDOW)
        if not query:
            return []
        hits = self.memory_graph.hybrid_query(query, 10, 1, self.tenant)
        topics = self._node_topics()
        mass: dict[str, float] = {}
        by_topic: dict[str, list[Any]] = {}
        for hit in hits:
            fits = topics.get(hit.node_id, ())
            for topic in fits:
                mass[topic] = mass.get(topic, 0.0) + max(hit.score, 0.0) / len(fits)
                by_topic.setdefault(topic, []).append(hit)
        total = sum(mass.values()) or 1.0
        ranked = sorted((t for t in mass if t != self._built_topic), key=lambda t: (-mass[t], t))
        return [MemoryCandidate(topic, tuple(self._memory_lines(topic)),
                                tuple(by_topic[topic]), round(mass[topic] / total, 4))
                for topic in ranked[:k]]

    def _node_topics(self) -> dict[str, tuple[str, ...]]:
        """Graph node id -> the topics of the replay memory it holds."""
        return {f"replay:{self.tenant}:{self.seed}:{m.key}": m.topics for m in self._memories}

    def _graph_memory_lines(self, topic: str) -> Lines:
        from memory_graph.layer import memories_layer_lines

        assert self.memory_graph is not None
        avg = sum(estimate_tokens(m.text) for m in self._memories) / len(self._memories)
        k = max(4, math.ceil(self._memory_tokens / avg))
        lines = memories_layer_lines(self.memory_graph, TOPIC_QUERIES[topic], self.tenant,
                                     k=k, hops=1)
        return fill_tokens([(text, clamp_importance(imp)) for text, imp in lines],
                           self._memory_tokens)

    # ------------------------------------------------------------------ generated layers
    def _neurons(self) -> Lines:
        head = ("Learned heuristics; confidence is the share of past cases where this first "
                "check found the cause.", 0.9)
        return [head, *take_lines(self._neuron_stream(), self._neuron_lines - 1)]

    def _neuron_stream(self) -> Iterator[tuple[str, float]]:
        for text, conf, seen in NEURONS_CORE:
            yield f"{text} (confidence {conf:.2f}, seen {seen}x).", confidence_importance(conf)
        # (template, a, b): symptom -> first check, deploy sign -> cause, co-failing pair
        generated: list[tuple[str, str, str]] = []
        for svc in SERVICE_NAMES:
            generated.extend(("When {a} shows {b}, check {c} first", svc, symptom)
                             for symptom, _ in SYMPTOMS)
            generated.extend(("After {a} deploys, {b} usually means {c}", svc, sign)
                             for sign, _ in DEPLOY_SIGNS)
        generated.extend(("{a} and {b} degraded together in {c}% of past incidents; check both "
                          "when either alerts", SERVICE_NAMES[i], SERVICE_NAMES[j])
                         for i in range(len(SERVICE_NAMES))
                         for j in range(i + 1, len(SERVICE_NAMES)))
        seeded_rng(self.seed, "neuron-order").shuffle(generated)
        follow = dict(SYMPTOMS) | dict(DEPLOY_SIGNS)
        rounds = 0
        while True:  # later rounds (only at large scales) scope the pool to one cluster
            for n, (template, a, b) in enumerate(generated):
                rng = seeded_rng(self.seed, "neuron", rounds, n)
                c = follow.get(b) or str(rng.randrange(20, 75))
                text = template.format(a=a, b=b, c=c)
                if rounds:
                    cluster = CLUSTERS[rounds % len(CLUSTERS)][0]
                    variant = f" (variant {rounds // len(CLUSTERS)})" \
                        if rounds >= len(CLUSTERS) else ""
                    text = f"In {cluster}{variant}: {text[0].lower()}{text[1:]}"
                conf = rng.uniform(0.52, 0.92)
                yield (f"{text} (confidence {conf:.2f}, seen {rng.randrange(2, 41)}x).",
                       confidence_importance(conf))
            rounds += 1

    def _awareness(self) -> Lines:
        return take_lines(self._awareness_stream(), self._awareness_lines)

    def _awareness_stream(self) -> Iterator[tuple[str, float]]:
        yield from AWARENESS_BASE
        n = 0
        while True:
            rng = seeded_rng(self.seed, "awareness", n)
            svc = rng.choice(SERVICE_NAMES)
            date = random_date(rng)
            choice = n % 3
            if choice == 0:
                text = (f"Earlier session {date}: Jonas asked about {svc} "
                        f"{rng.choice(('latency', 'restarts', 'cost', 'replicas', 'errors'))}; "
                        f"he used the answer and asked for the PromQL.")
            elif choice == 1:
                status = rng.choice(SLOT_CHOICES["followup_status"])
                text = (f"Open thread from {date}: {svc} follow-up ticket "
                        f"PLAT-{rng.randrange(600, 811)} is {status}.")
            else:
                text = (f"Context: {svc} is owned by the {SERVICES[SERVICE_NAMES.index(svc)][1]}"
                        f" team; Jonas last touched its dashboards on {date}.")
            yield text, round(rng.uniform(0.2, 0.6), 2)
            n += 1

    # ------------------------------------------------------------------ per-turn layers
    def _build_times(self) -> list[datetime]:
        start = SESSION_DAY + timedelta(seconds=seeded_rng(self.seed, "start").randrange(0, 300))
        times = [start]
        for i in range(1, self.num_turns):
            times.append(times[-1] + timedelta(seconds=seeded_rng(self.seed, "dt", i)
                                               .randrange(50, 200)))
        return times

    def _current_time(self, i: int) -> Lines:
        now, start = self._times[i], self._times[0]
        lines: Lines = [(f"Now: {now:%A} {now.day} {now:%B %Y}, {now:%H:%M:%S} CET (UTC+1).",
                          1.0)]
        if now < HANDOFF:
            left = math.ceil((HANDOFF - now).total_seconds() / 60)
            lines.append((f"Business hours: yes, {left} min left; handoff to Tom at 18:00.",
                          0.6))
        else:
            lines.append(("Business hours: no; Tom Becker is on-call since 18:00.", 0.6))
        elapsed = int((now - start).total_seconds() // 60)
        lines.append((f"Session started {start:%H:%M}, {elapsed} min ago; turn {i + 1}.", 0.7))
        return lines

    def _system_state(self, i: int) -> Lines:
        return take_lines(self._state_stream(i), self._state_lines)

    def _state_stream(self, i: int) -> Iterator[tuple[str, float]]:
        _, _, phase = self._script(i)
        pos = i % len(SCRIPT)
        rng = seeded_rng(self.seed, "state", i)
        now = self._times[i]
        yield (f"Platform snapshot at {now:%H:%M:%S} CET (Prometheus, scrape age "
               f"{rng.randrange(2, 15)} s).", 0.9)
        status = {
            "degraded": "investigating" if pos else "acknowledged by Jonas Weber",
            "rolling_back": "mitigating, rollback of checkout-api in progress",
            "recovering": "mitigating, rollback done, p95 recovering",
            "recovered": "monitoring after rollback",
            "mitigated": "mitigated, summary drafted",
        }[phase]
        yield (f"Open: INC-2041 SEV2 checkout-api p95 above SLO since 16:58 CET, {status}, "
               f"commander Priya Raman.", 1.0)
        yield ("Open: INC-2039 SEV3 search-api 4xx from a scraping bot, rate limit applied, "
               "monitoring.", 0.45)
        alerts = {
            "degraded": "CheckoutP95AboveSLO (critical), PricingServiceHighRPS (warning)",
            "rolling_back": "CheckoutP95AboveSLO (critical), PricingServiceHighRPS (warning)",
            "recovering": "CheckoutP95AboveSLO (resolving)",
            "recovered": "none new",
            "mitigated": "none new",
        }[phase]
        yield f"Firing alerts besides SearchApi4xxRate: {alerts}.", 0.85
        if phase == "rolling_back":
            yield (f"Job rollback checkout-api v2.14.0 -> v2.13.2 (prod-eu): "
                   f"{rng.randrange(2, 5)}/6 pods replaced, PLAT-812.", 0.95)
        elif phase == "recovering":
            yield ("Job rollback checkout-api v2.14.0 -> v2.13.2 (prod-eu): 6/6 pods replaced, "
                   "waiting on caches.", 0.9)
        elif phase == "degraded":
            yield "checkout-api prod-eu runs v2.14.0 since 16:41 CET; no deploy in progress.", 0.7
        else:
            rolled = self._times[i - pos + 8]  # the turn the rollback ran
            yield (f"checkout-api prod-eu runs v2.13.2 since {rolled:%H:%M} CET (rollback); no "
                   "deploy in progress.", 0.7)
        yield from self._datastore_lines(rng, phase)
        services = [(s, c) for c in range(len(CLUSTERS)) for s in range(len(SERVICES))]
        for n, (s, c) in enumerate(services):
            yield self._service_line(rng, s, c, phase, pos)
            if n == 7:
                yield from self._queue_and_job_lines(rng, pos)
        k = 0
        while True:  # per-pod detail, only at larger scales
            svc = SERVICE_NAMES[k % len(SERVICE_NAMES)]
            pod = seeded_rng(self.seed, "pod", k).getrandbits(24)
            yield (f"Pod {svc}-{pod:06x} (prod-eu): restarts {rng.randrange(0, 3)}, CPU "
                   f"{rng.randrange(40, 900)}m, mem {rng.randrange(120, 1900)} MiB, node "
                   f"ip-10-0-{rng.randrange(1, 60)}-{rng.randrange(2, 250)}.", 0.2)
            k += 1

    def _datastore_lines(self, rng: random.Random, phase: str) -> Iterator[tuple[str, float]]:
        conns = rng.randrange(150, 230)
        yield (f"payments-db (RDS Postgres 15): {conns}/400 connections, CPU "
               f"{rng.randrange(28, 46)}%, replica lag {rng.randrange(4, 90)} ms, slow queries "
               f"{rng.randrange(0, 4)}/min.", 0.8)
        hit = rng.uniform(93.0, 97.5) if phase in ("degraded", "rolling_back") \
            else rng.uniform(97.0, 99.2)
        yield (f"redis-sessions: hit ratio {hit:.1f}%, memory {rng.uniform(3.2, 4.4):.1f}/6 GiB, "
               f"evictions {rng.randrange(0, 9)}/s.", 0.55)

    def _queue_and_job_lines(self, rng: random.Random, pos: int) -> Iterator[tuple[str, float]]:
        yield (f"Queue orders-events: lag {rng.randrange(40, 2400):,} msgs, "
               f"{rng.randrange(6, 9)} consumers.", 0.5)
        yield (f"Queue payment-callbacks: lag {rng.randrange(0, 300):,} msgs, "
               f"{rng.randrange(2, 5)} consumers.", 0.55)
        yield (f"Job reporting-etl hourly rollup: {min(99, 8 + pos * 4 + rng.randrange(0, 4))}% "
               f"done; CI queue {rng.randrange(0, 7)} waiting.", 0.3)

    def _service_line(self, rng: random.Random, s: int, c: int, phase: str,
                      pos: int) -> tuple[str, float]:
        name, _, base_rps, base_p95, replicas = SERVICES[s]
        cluster = CLUSTERS[c][0]
        profile = seeded_rng(self.seed, "profile", name, cluster)
        share = (1.0, 0.55, 0.04, 0.02)[c]
        rps = max(1, round(base_rps * share * profile.uniform(0.8, 1.2) * rng.uniform(0.9, 1.1)))
        p95 = base_p95 * profile.uniform(0.85, 1.2) * rng.uniform(0.92, 1.08)
        err = profile.uniform(0.01, 0.15) * rng.uniform(0.6, 1.4)
        cpu = profile.uniform(25, 60) * rng.uniform(0.9, 1.1)
        desired = replicas if c < 2 else max(1, replicas // 3)
        if c == 0 and name == "checkout-api":
            factor = {"degraded": 4.7, "rolling_back": 3.6, "recovering": 1.7}.get(phase, 1.0)
            p95 *= factor
            if factor > 1.5:
                err *= 9.0
                cpu *= 1.3
                desired = 9
        if c == 0 and name == "pricing-service":
            if phase in ("degraded", "rolling_back"):
                rps *= 3
                cpu *= 1.5
            if pos >= 3:
                desired = 8
        ready = desired - (1 if rng.random() < 0.08 else 0)
        p99 = p95 * rng.uniform(1.7, 2.4)
        importance = 0.9 if c == 0 and name in CUSTOMER_FACING[:4] else \
            (0.6 if c == 0 else (0.35 if c == 1 else 0.2))
        return (f"{name}@{cluster}: {ready}/{desired} ready, {rps} rps, p95 {round(p95)} ms, "
                f"p99 {round(p99)} ms, 5xx {err:.2f}%, CPU {round(min(cpu, 99))}%.", importance)



def _recent_text(history: Sequence[tuple[str, str]], window: int) -> str:
    """The text of the last ``window`` user messages of ``history`` and what followed them."""
    users = [i for i, (role, _) in enumerate(history) if role == "user"]
    start = users[-window] if len(users) >= window else (users[0] if users else len(history))
    return " ".join(text.strip() for _, text in history[start:] if text.strip())


def _diff(prev: dict[str, tuple[PromptLine, ...]],
          cur: dict[str, tuple[PromptLine, ...]]) -> tuple[str, ...]:
    def texts(lines: tuple[PromptLine, ...]) -> list[str]:
        return [line.text for line in lines]

    return tuple(name for name in REPLAY_LAYERS if texts(prev[name]) != texts(cur[name]))
