"""hybrid_query with the real embedding model: vector hits, expansion, rerank, tenants."""

from __future__ import annotations

import pytest

from memory_graph import (
    MemoryGraph,
    NodeKind,
    RerankWeights,
    UnknownNodeError,
    memories_layer_lines,
)

DAY = 24 * 3600.0

FACTS = {
    "france": ("France is a country in Western Europe; its capital is Paris.", "entity"),
    "japan": ("Japan is an island nation in East Asia whose capital is Tokyo.", "entity"),
    "photo": ("Photosynthesis turns sunlight, water and carbon dioxide into sugar.", "semantic"),
    "stocks": ("The stock market fell sharply after the interest rate decision.", "episodic"),
    "soccer": ("Our team won the football match 3-1 on Saturday.", "episodic"),
}


@pytest.fixture
def world(embedder, clock) -> tuple[MemoryGraph, dict[str, str]]:
    graph = MemoryGraph(embedder=embedder, clock=clock)
    keys = list(FACTS)
    ids = graph.add_nodes([FACTS[k][0] for k in keys], kinds=[FACTS[k][1] for k in keys],
                          tenant="acme")
    return graph, dict(zip(keys, ids, strict=True))


def test_query_about_paris_finds_the_france_node(world) -> None:
    graph, ids = world
    hits = graph.hybrid_query("Which country is the Eiffel Tower in Paris located in?",
                              k=3, hops=0, tenant="acme")
    assert hits[0].node_id == ids["france"]
    assert hits[0].node.kind is NodeKind.ENTITY
    assert hits[0].path == (ids["france"],) and hits[0].hops == 0
    hits = graph.hybrid_query("How do plants make food from light?", k=1, hops=0,
                              tenant="acme")
    assert [h.node_id for h in hits] == [ids["photo"]]
    assert hits[0].similarity > 0.3


def test_expansion_follows_typed_edges_and_reports_paths(embedder, clock) -> None:
    graph = MemoryGraph(embedder=embedder, clock=clock)
    alice = graph.add_node("Alice Moreau is a violin teacher.", kind="entity")
    lesson = graph.add_node("On Tuesday Alice gave a violin lesson to twelve children.")
    bake = graph.add_node("Alice baked a lemon cake for the neighbours.")
    unrelated = graph.add_node("The harbour crane was repaired by the night shift.")
    graph.add_edge(lesson, alice, "mentions", 0.8)
    graph.add_edge(bake, alice, "mentions", 0.6)
    graph.add_edge(unrelated, bake, "follows", 0.5)

    seeds = graph.hybrid_query("children learning the violin", k=1, hops=0)
    assert [h.node_id for h in seeds] == [lesson]

    one = {h.node_id: h for h in graph.hybrid_query("children learning the violin", k=1,
                                                     hops=1)}
    assert set(one) == {lesson, alice}
    assert one[alice].path == (lesson, alice)
    assert one[alice].edge_types == ("mentions",) and one[alice].hops == 1
    assert one[alice].path_weight == pytest.approx(0.8)

    two = {h.node_id: h for h in graph.hybrid_query("children learning the violin", k=1,
                                                     hops=2)}
    assert set(two) == {lesson, alice, bake}
    assert two[bake].path == (lesson, alice, bake)
    assert two[bake].edge_types == ("mentions", "mentions")
    assert two[bake].path_weight == pytest.approx(0.8 * 0.6)

    three = {h.node_id for h in graph.hybrid_query("children learning the violin", k=1,
                                                   hops=3)}
    assert unrelated in three
    only_follows = graph.hybrid_query("children learning the violin", k=1, hops=3,
                                      edge_types=["follows"])
    assert [h.node_id for h in only_follows] == [lesson]


def test_recency_weight_reorders_hits(embedder, clock) -> None:
    graph = MemoryGraph(embedder=embedder, clock=clock)
    old = graph.add_node("Bob repaired the red bicycle in the garage.",
                         created_at=clock() - 30 * DAY)
    new = graph.add_node("Bob fixed a bike.", created_at=clock())
    query = "Bob repaired the red bicycle"
    plain = graph.hybrid_query(query, k=2, hops=0,
                               weights=RerankWeights(recency=0.0, edge=0.0))
    assert [h.node_id for h in plain] == [old, new]
    assert plain[0].similarity > plain[1].similarity
    fresh = graph.hybrid_query(query, k=2, hops=0,
                               weights=RerankWeights(recency=1.0, recency_half_life_s=DAY))
    assert [h.node_id for h in fresh] == [new, old]
    assert fresh[0].recency == pytest.approx(1.0) and fresh[1].recency < 1e-6


def test_edge_weight_reorders_expanded_hits(embedder, clock) -> None:
    graph = MemoryGraph(embedder=embedder, clock=clock)
    seed = graph.add_node("Carol planted tomatoes in the garden.")
    close_text = graph.add_node("Carol waters the tomato plants in her garden every morning.")
    far_text = graph.add_node("The accountant sent the invoice on Friday.")
    graph.add_edge(seed, close_text, "related_to", 0.1)
    graph.add_edge(seed, far_text, "related_to", 0.9)
    query = "Carol tomatoes garden"
    by_sim = graph.hybrid_query(query, k=1, hops=1, weights=RerankWeights(edge=0.0))
    assert [h.node_id for h in by_sim] == [seed, close_text, far_text]
    by_edge = graph.hybrid_query(query, k=1, hops=1, weights=RerankWeights(edge=2.0))
    assert [h.node_id for h in by_edge][1:] == [far_text, close_text]
    assert by_edge[1].score == pytest.approx(by_edge[1].similarity + 2.0 * 0.9
                                             + 0.1 * by_edge[1].recency)


def test_access_stats_and_limit(world, clock) -> None:
    graph, ids = world
    clock.advance(10)
    hits = graph.hybrid_query("capital city of France", k=2, hops=0, tenant="acme", limit=1)
    assert len(hits) == 1
    node = graph.get_node(hits[0].node_id)
    assert node.access_count == 1 and node.last_accessed == clock()
    untouched = graph.get_node(ids["soccer"])
    assert untouched.access_count == 0 and untouched.last_accessed is None


def test_tenants_never_see_each_other(embedder, clock) -> None:
    graph = MemoryGraph(embedder=embedder, clock=clock)
    mine = graph.add_node("The launch code for project Kestrel is in the blue binder.",
                          tenant="acme")
    theirs = graph.add_nodes(["The launch code for project Kestrel is in the blue binder.",
                              "Kestrel launch codes binder"], tenant="globex")
    graph.add_edge(theirs[0], theirs[1], "related_to", 1.0)
    hits = graph.hybrid_query("where is the Kestrel launch code?", k=10, hops=3,
                              tenant="acme")
    assert [h.node_id for h in hits] == [mine]
    assert {h.node_id for h in graph.hybrid_query("Kestrel", k=10, hops=3,
                                                  tenant="globex")} == set(theirs)
    assert graph.hybrid_query("Kestrel", k=10, hops=2, tenant="nobody") == []
    with pytest.raises(ValueError, match="joins tenants"):
        graph.add_edge(mine, theirs[0], "related_to", 0.5)
    with pytest.raises(UnknownNodeError, match="globex"):
        graph.get_node(mine, tenant="globex")
    assert graph.num_nodes("acme") == 1 and graph.num_nodes("globex") == 2


def test_memories_layer_lines(world) -> None:
    graph, _ids = world
    lines = memories_layer_lines(graph, "Tokyo and Japan", tenant="acme", k=3, hops=1)
    assert lines[0] == (FACTS["japan"][0], 1.0)
    assert len(lines) == 3
    assert all(0.0 <= imp <= 1.0 for _, imp in lines)
    assert [imp for _, imp in lines] == sorted((imp for _, imp in lines), reverse=True)
    assert memories_layer_lines(graph, "Tokyo", tenant="globex") == []


def test_bad_arguments_raise(world) -> None:
    graph, _ = world
    with pytest.raises(ValueError, match="k and hops"):
        graph.hybrid_query("x", k=-1)
    with pytest.raises(ValueError, match="kind must be one of"):
        graph.add_node("text", kind="dream")
    with pytest.raises(ValueError, match="non-empty"):
        graph.add_node("   ")
    with pytest.raises(UnknownNodeError, match="add it first"):
        graph.add_edge("nope", "nada", "follows", 0.5)
