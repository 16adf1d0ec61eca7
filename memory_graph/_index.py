"""Per-tenant vector index: one contiguous unit-norm matrix with amortized growth.

Search is a matrix-vector product plus ``argpartition`` over the rows; no Python
loop runs over nodes. Large tenants (more rows than ``exact_max_rows``) first
score a low-dimensional projection of the matrix (top principal directions of
the stored vectors), then rescore the best candidates exactly: at 100K x 384 the
full float32 matrix is ~150 MB, and reading it per query is memory bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["IndexConfig", "VectorIndex"]

_MIN_CAPACITY = 64


@dataclass(frozen=True, slots=True)
class IndexConfig:
    """Search settings of a :class:`VectorIndex`.

    Args:
        exact_max_rows: up to this many rows every query scores all rows exactly.
        coarse_dim: dimensions of the projection used above ``exact_max_rows``.
        candidates_per_k: projected candidates rescored exactly per requested hit.
        min_candidates: lower bound of the candidates rescored exactly.
    """

    exact_max_rows: int = 32_768
    coarse_dim: int = 48
    candidates_per_k: int = 64
    min_candidates: int = 1024

    def __post_init__(self) -> None:
        if self.exact_max_rows < 1 or self.coarse_dim < 1:
            raise ValueError("exact_max_rows and coarse_dim must be >= 1, got "
                             f"{self.exact_max_rows} and {self.coarse_dim}")
        if self.candidates_per_k < 1 or self.min_candidates < 1:
            raise ValueError("candidates_per_k and min_candidates must be >= 1")


class VectorIndex:
    """Rows of unit vectors keyed by node id, kept contiguous.

    Capacity doubles when full (amortized O(1) appends); removal moves the last
    row into the hole, so ``matrix[:size]`` is always dense.

    Args:
        dim: vector dimension.
        config: search settings.
    """

    def __init__(self, dim: int, config: IndexConfig | None = None) -> None:
        self.dim = dim
        self.config = config or IndexConfig()
        self._mat = np.zeros((_MIN_CAPACITY, dim), dtype=np.float32)
        self._ids: list[str] = []
        self._row: dict[str, int] = {}
        # projection [dim, coarse_dim] and projected rows [capacity, coarse_dim]
        self._proj: np.ndarray | None = None
        self._pmat: np.ndarray | None = None
        self._fitted_rows = 0

    # ------------------------------------------------------------------ shape
    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._row

    @property
    def capacity(self) -> int:
        return self._mat.shape[0]

    @property
    def matrix(self) -> np.ndarray:
        """Read-only view of the live rows ``[size, dim]``."""
        view = self._mat[: len(self._ids)]
        view.flags.writeable = False
        return view

    @property
    def ids(self) -> Sequence[str]:
        return tuple(self._ids)

    # ------------------------------------------------------------------ mutation
    def add(self, node_ids: Sequence[str], vectors: np.ndarray) -> None:
        """Append rows; ``vectors`` is ``[len(node_ids), dim]`` with unit rows.

        Raises:
            ValueError: a shape mismatch or an id already present.
        """
        vecs = np.asarray(vectors, dtype=np.float32)
        if vecs.ndim != 2 or vecs.shape != (len(node_ids), self.dim):
            raise ValueError(f"vectors must be [{len(node_ids)}, {self.dim}], got {vecs.shape}")
        dup = [n for n in node_ids if n in self._row]
        if dup or len(set(node_ids)) != len(node_ids):
            raise ValueError(f"node ids already indexed: {dup[:5] or 'duplicates in batch'}")
        start = len(self._ids)
        self._reserve(start + len(node_ids))
        self._mat[start: start + len(node_ids)] = vecs
        if self._proj is not None:
            assert self._pmat is not None
            self._pmat[start: start + len(node_ids)] = vecs @ self._proj
        for offset, node_id in enumerate(node_ids):
            self._row[node_id] = start + offset
        self._ids.extend(node_ids)
        if len(self._ids) > self.config.exact_max_rows and (
                self._proj is None or len(self._ids) >= 4 * self._fitted_rows):
            self._fit_projection()

    def remove(self, node_id: str) -> None:
        """Drop a row (the last row moves into its place)."""
        row = self._row.pop(node_id)
        last = len(self._ids) - 1
        if row != last:
            moved = self._ids[last]
            self._mat[row] = self._mat[last]
            if self._pmat is not None:
                self._pmat[row] = self._pmat[last]
            self._ids[row] = moved
            self._row[moved] = row
        self._ids.pop()

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        new_cap = max(needed, 2 * self.capacity)
        grown = np.zeros((new_cap, self.dim), dtype=np.float32)
        grown[: len(self._ids)] = self._mat[: len(self._ids)]
        self._mat = grown
        if self._pmat is not None:
            pgrown = np.zeros((new_cap, self._pmat.shape[1]), dtype=np.float32)
            pgrown[: len(self._ids)] = self._pmat[: len(self._ids)]
            self._pmat = pgrown

    def _fit_projection(self) -> None:
        """Top principal directions (uncentered) of up to 50K sampled rows."""
        size = len(self._ids)
        rng = np.random.default_rng(0)
        sample = self._mat[: size]
        if size > 50_000:
            sample = sample[np.sort(rng.choice(size, 50_000, replace=False))]
        gram = sample.T @ sample  # [dim, dim]; eigenvectors = right singular vectors
        _, vecs = np.linalg.eigh(gram)
        r = min(self.config.coarse_dim, self.dim)
        self._proj = np.ascontiguousarray(vecs[:, ::-1][:, :r], dtype=np.float32)
        self._pmat = np.zeros((self.capacity, r), dtype=np.float32)
        self._pmat[:size] = self._mat[:size] @ self._proj
        self._fitted_rows = size

    # ------------------------------------------------------------------ search
    def vectors(self, node_ids: Sequence[str]) -> np.ndarray:
        """Rows of ``node_ids`` as a new ``[n, dim]`` array."""
        rows = np.fromiter((self._row[n] for n in node_ids), dtype=np.int64, count=len(node_ids))
        return self._mat[rows]

    def similarities(self, query: np.ndarray, node_ids: Sequence[str]) -> np.ndarray:
        """Cosine similarity of ``query`` (unit ``[dim]``) with each node, ``[n]``."""
        if not node_ids:
            return np.zeros(0, dtype=np.float32)
        return self.vectors(node_ids) @ np.asarray(query, dtype=np.float32)

    def search(self, query: np.ndarray, k: int) -> tuple[list[str], np.ndarray]:
        """The ``k`` rows most similar to ``query`` (unit ``[dim]``), best first.

        Returns:
            Node ids and their cosine similarities ``[min(k, size)]``.
        """
        size = len(self._ids)
        k = min(k, size)
        if k <= 0:
            return [], np.zeros(0, dtype=np.float32)
        q = np.asarray(query, dtype=np.float32).reshape(self.dim)
        num_cand = max(self.config.min_candidates, k * self.config.candidates_per_k)
        if self._pmat is not None and self._proj is not None and size > num_cand:
            coarse = self._pmat[:size] @ (q @ self._proj)
            cand = np.argpartition(-coarse, num_cand - 1)[:num_cand]
            sims = self._mat[cand] @ q
        else:
            cand = None
            sims = self._mat[:size] @ q
        num = sims.shape[0]
        top = np.argpartition(-sims, k - 1)[:k] if k < num else np.arange(num)
        top = top[np.argsort(-sims[top], kind="stable")]
        rows = top if cand is None else cand[top]
        return [self._ids[r] for r in rows.tolist()], sims[top]
