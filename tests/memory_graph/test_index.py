"""VectorIndex: contiguous rows, amortized growth, exact and projected search."""

from __future__ import annotations

import numpy as np
import pytest

from memory_graph import IndexConfig, MemoryGraph, VectorIndex, normalize_rows


def _unit(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    return normalize_rows(rng.standard_normal((n, dim)))


def test_rows_stay_contiguous_through_growth_and_removal() -> None:
    rng = np.random.default_rng(0)
    index = VectorIndex(8)
    vecs = _unit(rng, 200, 8)
    ids = [f"n{i}" for i in range(200)]
    caps = []
    for start in range(0, 200, 10):
        index.add(ids[start:start + 10], vecs[start:start + 10])
        caps.append(index.capacity)
    assert caps[0] == 64 and caps[-1] == 256  # doubled, not grown per add
    assert sorted(set(caps)) == [64, 128, 256]
    np.testing.assert_array_equal(index.matrix, vecs)
    index.remove("n3")
    index.remove("n199")
    assert len(index) == 198 and "n3" not in index
    assert index.ids[3] == "n198"  # the last row moved into the hole
    np.testing.assert_array_equal(index.vectors(["n198"])[0], vecs[198])
    assert index.matrix.shape == (198, 8) and not index.matrix.flags.writeable
    with pytest.raises(ValueError, match="already indexed"):
        index.add(["n5"], vecs[:1])
    with pytest.raises(ValueError, match=r"\[1, 8\]"):
        index.add(["new"], vecs[:1, :4])


def test_exact_search_matches_brute_force() -> None:
    rng = np.random.default_rng(1)
    vecs = _unit(rng, 1000, 16)
    index = VectorIndex(16)
    index.add([str(i) for i in range(1000)], vecs)
    for q in _unit(rng, 20, 16):
        ids, sims = index.search(q, 7)
        want = np.argsort(-(vecs @ q))[:7]
        assert ids == [str(i) for i in want]
        np.testing.assert_allclose(sims, (vecs @ q)[want], rtol=1e-5)
    ids, _ = index.search(vecs[0], 5000)
    assert len(ids) == 1000
    assert VectorIndex(16).search(vecs[0], 3) == ([], pytest.approx(np.zeros(0)))


def test_projected_search_recalls_exact_top_k_and_sees_new_rows() -> None:
    rng = np.random.default_rng(2)
    dim, n = 64, 6000
    centers = _unit(rng, 40, dim)
    vecs = normalize_rows(centers[rng.integers(0, 40, n)] + 0.08 * rng.standard_normal((n, dim)))
    config = IndexConfig(exact_max_rows=2000, coarse_dim=16, candidates_per_k=16,
                         min_candidates=128)
    index = VectorIndex(dim, config)
    index.add([str(i) for i in range(n)], vecs)
    queries = normalize_rows(vecs[rng.integers(0, n, 40)] + 0.05 * rng.standard_normal((40, dim)))
    found = 0
    for q in queries:
        ids, sims = index.search(q, 10)
        exact = {str(i) for i in np.argsort(-(vecs @ q))[:10]}
        found += len(set(ids) & exact)
        assert list(sims) == sorted(sims, reverse=True)
    assert found / 400 >= 0.9
    fresh = _unit(rng, 1, dim)
    index.add(["fresh"], fresh)
    assert index.search(fresh[0], 1)[0] == ["fresh"]


def test_graph_keeps_one_index_per_tenant(hash_embedder) -> None:
    graph = MemoryGraph(embedder=hash_embedder)
    graph.add_nodes(["red apple", "green pear"], tenant="a")
    graph.add_nodes(["red apple"], tenant="b")
    index_a, index_b = graph.vector_index("a"), graph.vector_index("b")
    assert index_a is not None and index_b is not None and index_a is not index_b
    assert (len(index_a), len(index_b)) == (2, 1)
    assert graph.vector_index("c") is None
