"""Persistence through SQLAlchemy: round trips, shared engines, corrupt and foreign stores."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.pool import StaticPool

from memory_graph import (
    GraphStoreError,
    IncompatibleGraphStoreError,
    MemoryGraph,
    NodeKind,
)


def _populate(graph: MemoryGraph) -> dict[str, str]:
    ids = {}
    ids["france"] = graph.add_node("France is a country in Western Europe.", kind="entity",
                                   tenant="acme")
    ids["trip"] = graph.add_node("Last spring I visited Paris and saw the Louvre.",
                                 tenant="acme")
    ids["fact"] = graph.add_node("The user prefers window seats on flights.",
                                 kind=NodeKind.SEMANTIC, tenant="acme")
    ids["other"] = graph.add_node("Globex ships turbines to Norway.", tenant="globex")
    graph.add_edge(ids["trip"], ids["france"], "mentions", 0.8)
    graph.add_edge(ids["fact"], ids["trip"], "related_to", 0.4)
    return ids


def _snapshot(graph: MemoryGraph) -> tuple:
    nodes = sorted((n.node_id, n.tenant, n.kind, n.text, n.created_at, n.access_count,
                    n.last_accessed) for t in graph.tenants() for n in graph.nodes(t))
    edges = sorted((e.src, e.dst, e.edge_type, e.weight) for e in graph.edges())
    return nodes, edges


def test_sqlite_file_round_trip_gives_the_same_graph(tmp_path, embedder, clock) -> None:
    path = tmp_path / "mem.sqlite"
    graph = MemoryGraph(path, embedder=embedder, clock=clock)
    ids = _populate(graph)
    clock.advance(60)
    hits = graph.hybrid_query("a city trip in Paris", k=2, hops=1, tenant="acme")
    before = _snapshot(graph)
    vectors = {nid: graph.embedding(nid) for nid in ids.values()}
    graph.close()
    graph.close()  # idempotent

    reloaded = MemoryGraph(path, embedder=embedder, clock=clock)
    assert _snapshot(reloaded) == before
    for nid, vec in vectors.items():
        np.testing.assert_array_equal(reloaded.embedding(nid), vec)
    # access statistics were written on close
    trip = reloaded.get_node(ids["trip"])
    assert trip.access_count == 1 and trip.last_accessed == clock()
    again = reloaded.hybrid_query("a city trip in Paris", k=2, hops=1, tenant="acme")
    assert [h.node_id for h in again] == [h.node_id for h in hits]
    assert reloaded.tenants() == ["acme", "globex"]
    reloaded.close()


def test_shared_in_memory_engine_and_url(tmp_path, embedder) -> None:
    engine = create_engine("sqlite://", poolclass=StaticPool)
    first = MemoryGraph(engine, embedder=embedder)
    _populate(first)
    before = _snapshot(first)
    first.close()
    second = MemoryGraph(engine, embedder=embedder)
    assert _snapshot(second) == before
    second.close()

    url = f"sqlite:///{tmp_path / 'by-url.db'}"
    with MemoryGraph(url, embedder=embedder) as g:
        _populate(g)
        before = _snapshot(g)
    with MemoryGraph(url, embedder=embedder) as g:
        assert _snapshot(g) == before


def test_removed_nodes_and_reweighted_edges_persist(tmp_path, hash_embedder) -> None:
    path = tmp_path / "m.db"
    with MemoryGraph(path, embedder=hash_embedder) as g:
        a = g.add_node("alpha beta")
        b = g.add_node("beta gamma")
        c = g.add_node("gamma delta")
        g.add_edges([(a, b, "follows", 0.5), (b, c, "follows", 0.5)])
        g.add_edge(a, b, "follows", 0.9)  # reweight, not a second edge
        g.remove_node(c)
    with MemoryGraph(path, embedder=hash_embedder) as g:
        assert sorted(n.node_id for n in g.nodes()) == sorted([a, b])
        assert [(e.src, e.dst, e.weight) for e in g.edges()] == [(a, b, 0.9)]
        assert g.num_edges() == 1


def test_not_a_database_says_so(tmp_path, hash_embedder) -> None:
    junk = tmp_path / "notes.sqlite"
    junk.write_bytes(b"these are my notes, not a database\n" * 100)
    with pytest.raises(GraphStoreError, match=r"not a SQLite database.*move it away"):
        MemoryGraph(junk, embedder=hash_embedder)
    assert junk.read_bytes().startswith(b"these are my notes")  # left untouched


def test_damaged_sqlite_file_says_so(tmp_path, hash_embedder) -> None:
    damaged = tmp_path / "damaged.sqlite"
    damaged.write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 40)
    with pytest.raises(GraphStoreError, match="corrupt or not a database"):
        MemoryGraph(damaged, embedder=hash_embedder)


def test_foreign_database_is_refused(tmp_path, hash_embedder) -> None:
    path = tmp_path / "crm.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    with pytest.raises(IncompatibleGraphStoreError, match=r"something else.*customers"):
        MemoryGraph(path, embedder=hash_embedder)


def test_missing_tables_and_other_schema_are_refused(tmp_path, hash_embedder) -> None:
    path = tmp_path / "g.db"
    MemoryGraph(path, embedder=hash_embedder).close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE mg_meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(IncompatibleGraphStoreError, match="schema version 99"):
        MemoryGraph(path, embedder=hash_embedder)
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE mg_edges")
    with pytest.raises(IncompatibleGraphStoreError, match="lacks the memory graph tables"):
        MemoryGraph(path, embedder=hash_embedder)


def test_other_embedding_model_is_refused(tmp_path, embedder, hash_embedder_cls) -> None:
    path = tmp_path / "g.db"
    with MemoryGraph(path, embedder=embedder) as g:
        g.add_node("hello world")
    with pytest.raises(IncompatibleGraphStoreError,
                       match=r"all-MiniLM-L6-v2.*dim 384.*hash-bow-32.*re-embed"):
        MemoryGraph(path, embedder=hash_embedder_cls(32))
    other = tmp_path / "h.db"
    MemoryGraph(other, embedder=hash_embedder_cls(32)).close()
    with pytest.raises(IncompatibleGraphStoreError, match="dim 32"):
        MemoryGraph(other, embedder=hash_embedder_cls(16))


def test_a_failed_write_leaves_the_graph_unchanged(tmp_path, hash_embedder) -> None:
    path = tmp_path / "g.db"
    with MemoryGraph(path, embedder=hash_embedder) as g:
        g.add_node("one", node_id="n1")
        engine = g._store.engine  # the store's own engine, to break it from outside
        with engine.begin() as conn:
            conn.execute(text("DROP TABLE mg_edges"))
            conn.execute(text("CREATE TABLE mg_edges (x INTEGER)"))
        g.add_node("two", node_id="n2")
        with pytest.raises(Exception, match="mg_edges"):
            g.add_edge("n1", "n2", "follows", 0.5)
        assert g.num_edges() == 0
