"""Memory reservations in the agent loop: the real SmolLM2 engine, a real MemoryGraph on
SQLite with the packaged embedder, small prompts."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from contextkit.engine.engine import Engine
from contextkit.loop.reservations import MemoryCandidate, MemoryReservations
from contextkit.loop.tiers import ContextTierManager, ItemKind
from contextkit.pipeline.pipeline import CacheAwareContextPipeline
from contextkit.prompt.chatml import ChatML
from gpu_cache import Tier
from memory_graph import GraphBlockReserver, MemoryGraph, SentenceTransformerEmbedder

pytestmark = pytest.mark.slow

CAPS = [f"tool metrics_query_{i}(service, window): p95, p99 and error rate." for i in range(4)]
TOPICS = {
    "billing": ["Invoices for the Acme account are generated on the first of each month.",
                "The billing service retries failed card charges three times.",
                "Refunds above 500 euros need a second approver in finance."],
    "deploys": ["Deploys of checkout-api go out through the blue-green pipeline.",
                "A deploy at 14:00 on Tuesday raised checkout p95 to 900 ms.",
                "Rollbacks of a deploy take about six minutes end to end."],
    "oncall": ["The on-call rotation for the platform team changes every Monday.",
               "Pages at night go to the secondary after ten minutes unanswered.",
               "On-call handovers are written in the shared incident notebook."],
}


def raw(turn: int, topic: str) -> dict[str, Any]:
    return {
        "axioms": ["Tell the truth about what you checked."],
        "identity": ["You are Atlas, the platform team's SRE assistant."],
        "capabilities": CAPS,
        "system_state": [f"checkout-api: p95 {700 + 13 * turn} ms"],
        "current_time": [f"Now: 17:{10 + 2 * turn:02d} CET, turn {turn + 1}."],
        "memories": [(line, 0.6) for line in TOPICS[topic]],
    }


@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MemoryGraph, dict]]:
    path: Path = tmp_path_factory.mktemp("graph") / "memories.db"
    g = MemoryGraph(f"sqlite:///{path}", embedder=SentenceTransformerEmbedder())
    topic_of: dict[str, str] = {}
    for tenant in ("acme", "globex"):
        for topic, lines in TOPICS.items():
            for nid in g.add_nodes(lines, tenant=tenant):
                topic_of[nid] = topic
    yield g, topic_of
    g.close()


def predictor(graph: tuple[MemoryGraph, dict], tenant: str, *,
              seen: list | None = None) -> Callable[[Sequence[tuple[str, str]]],
                                                   list[MemoryCandidate]]:
    """Topics ranked by hit score mass of a query on the conversation so far."""
    g, topic_of = graph

    def predict(history: Sequence[tuple[str, str]]) -> list[MemoryCandidate]:
        if seen is not None:
            seen.append(list(history))
        text = " ".join(t for _, t in history[-2:])
        mass: dict[str, float] = {}
        hits: dict[str, list] = {}
        for h in g.hybrid_query(text, 6, 0, tenant):
            topic = topic_of[h.node.node_id]
            mass[topic] = mass.get(topic, 0.0) + h.score
            hits.setdefault(topic, []).append(h)
        return [MemoryCandidate(t, tuple((line, 0.6) for line in TOPICS[t]),
                                tuple(hits[t]), mass[t]) for t in mass]

    return predict


def setup(engine: Engine, graph: tuple[MemoryGraph, dict], tenant: str = "acme", *,
          candidates: int = 2, tiers: ContextTierManager | None = None,
          clock: Callable[[], float] | None = None,
          ) -> tuple[CacheAwareContextPipeline, MemoryReservations, GraphBlockReserver]:
    kw = {} if clock is None else {"clock": clock}
    reserver = GraphBlockReserver(engine.cache, engine.count_tokens, **kw)
    ahead = MemoryReservations(engine, reserver, predictor(graph, tenant),
                               max_candidates=candidates)
    pipeline = CacheAwareContextPipeline(engine, tenant=tenant, reservations=ahead,
                                         pin_stable=False, tiers=tiers, metrics=False)
    return pipeline, ahead, reserver


ASK1 = "The deploy at 14:00 broke checkout. Which deploy changed p95?"
ASK2 = "Roll it back then; how long does that take?"


def trailing_start(pipeline: CacheAwareContextPipeline, engine: Engine, ids: list[int],
                   spans: list, built: Any, history: Sequence[tuple[str, str]]) -> int:
    return spans[built.num_spans(built.main) + len(history)].start - \
        len(engine.encode(ChatML.open("system")))


def test_preview_has_no_side_effects_and_matches_build(fresh: Callable[..., Engine]) -> None:
    engine = fresh("tq4", device=128, host=64)
    pipeline = CacheAwareContextPipeline(engine, tenant="acme", pin_stable=False,
                                         metrics=False)
    first = pipeline.build(raw(0, "billing"))
    volatility = pipeline.volatility()
    spilled = len(pipeline.spillover)
    preview = pipeline.preview(raw(1, "deploys"))
    assert pipeline.last_built() is first and pipeline.volatility() == volatility
    assert len(pipeline.spillover) == spilled
    built = pipeline.build(raw(1, "deploys"))
    assert preview.text == built.text and preview.section_ids == built.section_ids
    assert [s.layer for s in preview.main] == [s.layer for s in built.main]
    assert preview.report.changed_layers == built.report.changed_layers
    assert built.report.call == 2  # the preview was not counted


def test_reserved_neighborhood_is_reused_on_the_next_turn(fresh: Callable[..., Engine],
                                                          graph) -> None:
    engine = fresh("tq4", device=256, host=128)
    pipeline, ahead, reserver = setup(engine, graph)
    host_free = engine.cache.num_free(Tier.HOST)
    pipeline.build(raw(0, "billing"))
    r1 = pipeline.generate(ASK1, max_new_tokens=8)
    assert r1.report.reservation_hit is None
    assert ahead.wait_idle(300)
    stats = ahead.stats()
    assert stats.made == 2 and stats.extensions == 1 and stats.extension_tokens > 0
    assert "deploys" in ahead.live("acme") and "billing" not in ahead.live("acme")
    held = reserver.stats().blocks_held
    assert held > 0 and engine.cache.num_free(Tier.HOST) == host_free - held  # in DDR

    history = [("user", ASK1), ("assistant", r1.text)]
    built = pipeline.build(raw(1, "deploys"))
    ids, spans, _ = pipeline.assemble(ASK2, history, built=built)
    cut = trailing_start(pipeline, engine, ids, spans, built, history)
    r2 = pipeline.generate(ASK2, history=history, max_new_tokens=8)
    assert r2.report.reservation_hit == "deploys"
    # the memories layer and the whole conversation came from the reservation
    assert r2.generation.reused_tokens == cut // 16 * 16
    assert r2.report.reused_by_layer["memories"] == len(built.section_ids["memories"])
    assert r2.report.computed_by_layer.get("memories", 0) == 0
    # computed: the partial last block of the conversation, then the trailing message,
    # the new user message and the assistant header
    assert set(r2.report.computed_by_layer) == {"user_turn", "template", "system_state",
                                                "current_time"}
    assert r2.generation.computed_tokens == len(ids) - cut // 16 * 16
    assert r2.generation.warmed_tokens > 0  # the reserved blocks came up from DDR
    stats = ahead.stats()
    assert (stats.hits, stats.misses, stats.expired, stats.last_hit_key) == \
        (1, 0, 1, "deploys")
    ahead.close()
    assert reserver.stats().blocks_held == 0
    reserver.close()


def test_a_miss_falls_back_cleanly_and_frees_every_block(fresh: Callable[..., Engine],
                                                         graph) -> None:
    kept: dict[str, Any] = {}

    def turns(engine: Engine, ahead: bool) -> tuple[Any, Any]:
        if ahead:
            pipeline, res, reserver = setup(engine, graph, candidates=1)
            kept.update(ahead=res, reserver=reserver)
        else:
            pipeline = CacheAwareContextPipeline(engine, tenant="acme", pin_stable=False,
                                                 metrics=False)
        pipeline.build(raw(0, "billing"))
        r1 = pipeline.generate(ASK1, max_new_tokens=8)
        if ahead:
            assert res.wait_idle(300) and res.live("acme") == ["deploys"]
        pipeline.build(raw(1, "oncall"))  # nobody predicted this
        r2 = pipeline.generate(ASK2, history=[("user", ASK1), ("assistant", r1.text)],
                               max_new_tokens=8)
        return r1, r2

    plain = fresh("tq4", device=256, host=128)
    p1, p2 = turns(plain, False)
    engine = fresh("tq4", device=256, host=128)
    host_free = engine.cache.num_free(Tier.HOST)
    r1, r2 = turns(engine, True)
    assert r1.text == p1.text
    assert r2.report.reservation_hit is None
    assert r2.text == p2.text
    assert r2.generation.reused_tokens == p2.generation.reused_tokens
    assert engine.cache.num_free(Tier.HOST) == host_free  # the expired DDR blocks are back
    stats = kept["ahead"].stats()
    assert (stats.made, stats.hits, stats.misses, stats.expired) == (1, 0, 1, 1)
    kept["ahead"].close()
    assert kept["reserver"].stats().blocks_held == 0
    kept["reserver"].close()


def test_reservations_expire_and_free_ddr(fresh: Callable[..., Engine], graph) -> None:
    now = [1000.0]
    engine = fresh("tq4", device=256, host=128)
    pipeline, ahead, reserver = setup(engine, graph, clock=lambda: now[0])
    host_free = engine.cache.num_free(Tier.HOST)
    pipeline.build(raw(0, "billing"))
    r1 = pipeline.generate(ASK1, max_new_tokens=8)
    assert ahead.wait_idle(300) and ahead.stats().made == 2
    assert engine.cache.num_free(Tier.HOST) < host_free
    now[0] += ahead.ttl_s + 1
    assert reserver.sweep() == 2
    assert engine.cache.num_free(Tier.HOST) == host_free
    pipeline.build(raw(1, "deploys"))
    r2 = pipeline.generate(ASK2, history=[("user", ASK1), ("assistant", r1.text)],
                           max_new_tokens=8)
    assert r2.report.reservation_hit is None
    stats = ahead.stats()
    assert stats.expired == 2 and stats.hits == 0 and stats.misses == 1
    assert reserver.stats().blocks_held == 0
    ahead.close()
    reserver.close()


def test_a_request_arriving_mid_prefill_is_served_first(fresh: Callable[..., Engine],
                                                        graph) -> None:
    engine = fresh("tq4", device=512, host=256)
    predicted = threading.Event()
    base = predictor(graph, "acme")
    long = tuple((f"{line} (note {j})", 0.6) for j in range(12) for line in TOPICS["deploys"])

    def predict(history: Sequence[tuple[str, str]]) -> list[MemoryCandidate]:
        out = [MemoryCandidate("deploys", long, (), 9.0), *base(history)]
        predicted.set()
        return out

    reserver = GraphBlockReserver(engine.cache, engine.count_tokens)
    ahead = MemoryReservations(engine, reserver, predict, max_candidates=1,
                               extend_history=False)
    pipeline = CacheAwareContextPipeline(engine, tenant="acme", reservations=ahead,
                                         pin_stable=False, metrics=False)
    pipeline.build(raw(0, "billing"))
    r1 = pipeline.generate(ASK1, max_new_tokens=8)
    assert predicted.wait(120)
    pipeline.build(raw(1, "oncall"))
    r2 = pipeline.generate(ASK2, history=[("user", ASK1), ("assistant", r1.text)],
                           max_new_tokens=8)
    assert r2.text and r2.report.reservation_hit is None
    stats = ahead.stats()
    assert stats.preempted == 1  # the long prefill yielded to the turn
    assert reserver.stats().blocks_held == 0
    ahead.close()
    reserver.close()


def test_a_tenants_reservation_is_never_hit_by_another(fresh: Callable[..., Engine],
                                                       graph) -> None:
    engine = fresh("tq4", device=512, host=256)
    pipeline, ahead, reserver = setup(engine, graph, "acme")
    pipeline.build(raw(0, "billing"))
    r1 = pipeline.generate(ASK1, max_new_tokens=8)
    assert ahead.wait_idle(300) and "deploys" in ahead.live("acme")
    history = [("user", ASK1), ("assistant", r1.text)]
    other = pipeline.build(raw(1, "deploys"), tenant="globex")
    g = pipeline.generate(ASK2, history=history, tenant="globex", built=other,
                          max_new_tokens=8)
    assert g.report.reservation_hit is None
    assert g.generation.reused_tokens == 0  # nothing of acme's is visible
    assert "deploys" in ahead.live("acme")  # acme's reservations are left alone
    pipeline.build(raw(1, "deploys"), tenant="acme")
    a = pipeline.generate(ASK2, history=history, tenant="acme", max_new_tokens=8)
    assert a.report.reservation_hit == "deploys"
    ahead.close()
    reserver.close()


def test_tier_manager_sees_reservations_as_items(fresh: Callable[..., Engine], graph) -> None:
    engine = fresh("tq4", device=256, host=128)
    with ContextTierManager(engine.cache) as tiers:
        pipeline, ahead, reserver = setup(engine, graph, tiers=tiers)
        pipeline.build(raw(0, "billing"))
        r1 = pipeline.generate(ASK1, max_new_tokens=8)
        assert ahead.wait_idle(300)
        items = [i for i in tiers.items() if i.kind is ItemKind.RESERVATION]
        live = {r.reservation_id for r in reserver.active("acme")}
        assert {i.payload for i in items} == live and len(live) == 2
        pipeline.build(raw(1, "deploys"))
        r2 = pipeline.generate(ASK2, history=[("user", ASK1), ("assistant", r1.text)],
                               max_new_tokens=8)
        assert r2.report.reservation_hit == "deploys"
        # consumed and expired ones are gone; the next turn's predictions are new items
        assert not {i.payload for i in tiers.items()
                    if i.kind is ItemKind.RESERVATION} & live
        ahead.close()
        assert not [i for i in tiers.items() if i.kind is ItemKind.RESERVATION]
        reserver.close()


def test_a_steady_turn_reuses_the_extended_conversation(fresh: Callable[..., Engine],
                                                        graph) -> None:
    engine = fresh("tq4", device=256, host=128)
    pipeline, ahead, reserver = setup(engine, graph)
    host_free = engine.cache.num_free(Tier.HOST)
    pipeline.build(raw(0, "billing"))
    r1 = pipeline.generate(ASK1, max_new_tokens=8)
    assert ahead.wait_idle(300)
    history = [("user", ASK1), ("assistant", r1.text)]
    built = pipeline.build(raw(1, "billing"))  # memories unchanged
    ids, spans, _ = pipeline.assemble(ASK2, history, built=built)
    cut = trailing_start(pipeline, engine, ids, spans, built, history)
    r2 = pipeline.generate(ASK2, history=history, max_new_tokens=8)
    assert r2.report.reservation_hit is None
    assert r2.generation.reused_tokens == cut // 16 * 16  # the reply just given included
    assert r2.generation.warmed_tokens == 0  # the extension stayed on the device
    stats = ahead.stats()
    assert (stats.hits, stats.misses, stats.expired) == (0, 0, 2)
    assert stats.extension_tokens > 0 and stats.background_cpu_s > 0
    ahead.wait_idle(300)
    ahead.close()
    assert engine.cache.num_free(Tier.HOST) == host_free
    reserver.close()


def test_a_closed_prefiller_leaves_the_reply_alone(fresh: Callable[..., Engine], graph,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    from contextkit.engine.background import BackgroundPrefiller

    engine = fresh("tq4", device=128, host=64)
    prefiller = BackgroundPrefiller(engine)
    prefiller.close()
    reserver = GraphBlockReserver(engine.cache, engine.count_tokens)
    ahead = MemoryReservations(engine, reserver, predictor(graph, "acme"), prefiller=prefiller)
    pipeline = CacheAwareContextPipeline(engine, tenant="acme", reservations=ahead,
                                         pin_stable=False, metrics=False)
    pipeline.build(raw(0, "billing"))
    with caplog.at_level("WARNING", logger="contextkit.loop.reservations"):
        r1 = pipeline.generate(ASK1, max_new_tokens=4)
    assert r1.text and r1.report.reservation_hit is None
    assert "no background extend after this reply" in caplog.text
    assert ahead.stats().made == 0 and ahead.stats().extensions == 0
    with pytest.raises(ValueError, match="engine's cache"):
        MemoryReservations(fresh("tq4", device=16, host=16), reserver, predictor(graph, "acme"))
    reserver.close()
