"""Public surface of memory_graph and its dependency direction."""

from __future__ import annotations

import ast
from pathlib import Path

import memory_graph

EXPECTED = {
    "DEFAULT_EMBEDDING_MODEL_ID", "DEFAULT_TENANT", "STORE_SCHEMA_VERSION", "Edge", "Embedder",
    "EmbeddingModelNotFoundError", "GraphBlockReserver", "GraphConfig", "GraphStoreError",
    "IncompatibleGraphStoreError", "IndexConfig", "MemoryGraph", "MemoryGraphError", "Node",
    "NodeBlocks", "NodeKind", "PrefillFn", "QueryHit", "RerankWeights", "ReservationResult",
    "ReservationState", "ReserverConfig", "ReserverStats", "SentenceTransformerEmbedder",
    "UnknownNodeError", "UnknownReservationError", "VectorIndex", "default_model_dir",
    "memories_layer_lines", "normalize_rows",
}


def test_exported_names_are_the_public_api() -> None:
    assert set(memory_graph.__all__) == EXPECTED
    for name in memory_graph.__all__:
        assert getattr(memory_graph, name) is not None


def test_memory_graph_never_imports_contextkit() -> None:
    """Dependencies point contextkit -> memory_graph -> gpu_cache, never back."""
    package = Path(memory_graph.__file__).parent
    bad = []
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.name}: {n}" for n in names
                    if n.split(".")[0] in ("contextkit", "shadow", "integrations")]
    assert not bad


def test_embedder_protocol_is_met_by_the_real_model(embedder) -> None:
    assert isinstance(embedder, memory_graph.Embedder)
    assert embedder.model_id == "all-MiniLM-L6-v2"
    assert embedder.dim == 384
    vecs = embedder.encode(["a cat sat on the mat", "x", "a cat sat on the mat"])
    assert vecs.shape == (3, 384) and vecs.dtype.name == "float32"
    assert abs(float((vecs[0] ** 2).sum()) - 1.0) < 1e-5
    # batching and length sorting keep rows in input order
    assert float(vecs[0] @ vecs[2]) > 0.9999
    assert float(vecs[0] @ vecs[1]) < 0.9
    assert embedder.encode([]).shape == (0, 384)


def test_query_fast_path_matches_the_eager_model(embedder) -> None:
    import numpy as np

    from memory_graph import SentenceTransformerEmbedder

    eager = SentenceTransformerEmbedder(trace_queries=False)
    texts = ["Paris", "Where did I leave the keys to the blue car yesterday evening?",
             "the " * 40 + "end"]
    for text in texts:
        fast = embedder.encode([text])
        assert embedder._traced not in (None, False), "the traced path should be in use"
        np.testing.assert_allclose(fast, eager.encode([text]), atol=1e-5)
    # batches keep the eager path and agree with single encodes
    np.testing.assert_allclose(embedder.encode(texts), eager.encode(texts), atol=1e-5)
