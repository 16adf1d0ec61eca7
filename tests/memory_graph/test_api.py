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


def test_encode_matches_the_models_own_forward_pass(embedder) -> None:
    """Single and batched encodes equal the model's module pipeline, L2-normalised."""
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    from memory_graph import default_model_dir

    model = SentenceTransformer(str(default_model_dir()), device="cpu")
    texts = ["Paris", "Where did I leave the keys to the blue car yesterday evening?",
             "the " * 40 + "end"]
    with torch.inference_mode():
        ref = np.concatenate([model(model.tokenize([t]))["sentence_embedding"].numpy()
                              for t in texts])
    ref /= np.linalg.norm(ref, axis=1, keepdims=True)
    for text, want in zip(texts, ref, strict=True):
        got = embedder.encode([text])[0]
        assert abs(float(np.linalg.norm(got)) - 1.0) < 1e-5
        assert float(got @ want) >= 0.999
        np.testing.assert_allclose(got, want, atol=1e-5)
    np.testing.assert_allclose(embedder.encode(texts), ref, atol=1e-5)
