"""`contextkit bench graph` end to end on a tiny corpus (not a timing test)."""

from __future__ import annotations

import argparse

from contextkit.bench import graph as bench


def test_synthetic_corpus_is_deterministic_and_linked() -> None:
    a, b = bench.synthetic_corpus(500), bench.synthetic_corpus(500)
    assert a.texts == b.texts and a.edges == b.edges and a.digest() == b.digest()
    assert bench.synthetic_corpus(500, seed=1).digest() != a.digest()
    assert set(a.kinds) == {"entity", "episodic", "semantic"}
    assert {t for _, _, t, _ in a.edges} == {"mentions", "follows", "related_to"}
    assert all(0 <= s < 500 and 0 <= d < 500 for s, d, _, _ in a.edges)


def test_bench_runs_and_caches_embeddings(tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--nodes", "150", "--queries", "5", "--ingest-nodes", "40",
                              "--cache-dir", str(tmp_path)])
    result = bench.run(args)
    for key in ("nodes", "query_p50_ms", "query_p95_ms", "reserve_p50_ms", "warm_p50_ms",
                "ingest_nodes_per_s", "machine"):
        assert key in result
    assert result["nodes"] == 150 and result["vector_recall_at_10"] == 1.0
    assert result["query_p95_ms"] >= result["query_p50_ms"] > 0
    assert result["ingest_nodes_per_s"] > 0
    assert len(list(tmp_path.glob("all-MiniLM-L6-v2-384-*-150.npy"))) == 1
    assert "memory graph bench" in capsys.readouterr().out
