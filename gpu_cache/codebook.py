"""Lloyd-Max scalar codebooks for the coordinates of a randomly rotated unit vector.

After a uniformly random rotation, each coordinate of a unit vector in R^d has the
density ``f(x) ∝ (1 - x^2)^((d-3)/2)`` on ``[-1, 1]`` (close to ``N(0, 1/d)`` for large
d). The optimal scalar quantizer for that density (Lloyd-Max) is computed once per
``(d, bits)`` by alternating the nearest-neighbour and centroid conditions on a fine
grid with exact cumulative integrals, then cached for the life of the process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

__all__ = ["Codebook", "lloyd_max_codebook"]

_GRID_POINTS = 1 << 18
_MAX_ITERS = 2000
_TOL = 1e-12


@dataclass(frozen=True, slots=True)
class Codebook:
    """Centroids and decision boundaries of one scalar quantizer.

    Attributes:
        head_dim: vector dimension d the density belongs to.
        bits: bits per coordinate; there are ``2**bits`` centroids.
        centroids: sorted centroid values, shape ``[2**bits]`` (coordinate units,
            i.e. for unit vectors; multiply by ``sqrt(d)`` for "units of 1/sqrt(d)").
        boundaries: midpoints between neighbouring centroids, shape ``[2**bits - 1]``.
        mse_per_coord: expected squared error of one coordinate.
    """

    head_dim: int
    bits: int
    centroids: tuple[float, ...]
    boundaries: tuple[float, ...]
    mse_per_coord: float

    @property
    def mse_unit_vector(self) -> float:
        """Expected ``||u - u_hat||^2`` for a unit vector (d coordinates)."""
        return self.mse_per_coord * self.head_dim


def _density_grid(head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    # Work in t = x * sqrt(d) so the grid resolution does not depend on d.
    scale = math.sqrt(head_dim)
    t = np.linspace(-scale, scale, _GRID_POINTS, dtype=np.float64)
    x = t / scale
    expo = (head_dim - 3) / 2.0
    with np.errstate(divide="ignore"):
        logf = expo * np.log1p(-np.clip(x * x, 0.0, 1.0))
    w = np.exp(logf - logf.max())
    w[~np.isfinite(w)] = 0.0
    return t, w


@lru_cache(maxsize=32)
def lloyd_max_codebook(head_dim: int, bits: int = 4) -> Codebook:
    """Return the Lloyd-Max codebook for the rotated-coordinate density at ``head_dim``.

    Args:
        head_dim: vector dimension d (>= 4).
        bits: bits per coordinate (1..8).

    Raises:
        ValueError: for a dimension or bit width outside those ranges.
    """
    if head_dim < 4:
        raise ValueError(f"head_dim must be >= 4, got {head_dim}")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    levels = 1 << bits
    t, w = _density_grid(head_dim)
    dt = t[1] - t[0]
    # Cumulative integrals of w and t*w (trapezoid) give exact interval moments.
    cw = np.concatenate([[0.0], np.cumsum((w[1:] + w[:-1]) * 0.5 * dt)])
    tw = t * w
    ctw = np.concatenate([[0.0], np.cumsum((tw[1:] + tw[:-1]) * 0.5 * dt)])
    total = cw[-1]

    def cum(c: np.ndarray, at: np.ndarray) -> np.ndarray:
        return np.interp(at, t, c)

    # Start from equal-probability quantiles.
    qs = (np.arange(levels) + 0.5) / levels
    centroids = np.interp(qs * total, cw, t)
    lo, hi = t[0], t[-1]
    for _ in range(_MAX_ITERS):
        bounds = (centroids[1:] + centroids[:-1]) * 0.5
        edges = np.concatenate([[lo], bounds, [hi]])
        mass = np.diff(cum(cw, edges))
        moment = np.diff(cum(ctw, edges))
        new = np.where(mass > 0, moment / np.maximum(mass, 1e-300), centroids)
        new = 0.5 * (new - new[::-1])  # the density is symmetric; keep the codebook so
        shift = float(np.max(np.abs(new - centroids)))
        centroids = new
        if shift < _TOL:
            break
    bounds = (centroids[1:] + centroids[:-1]) * 0.5
    # Distortion: integral of (t - c)^2 w over each cell, from the grid directly.
    cell = np.searchsorted(bounds, t)
    err = (t - centroids[cell]) ** 2 * w
    mse_t = float(np.sum((err[1:] + err[:-1]) * 0.5 * dt) / total)
    scale = math.sqrt(head_dim)
    return Codebook(
        head_dim=head_dim,
        bits=bits,
        centroids=tuple(float(c / scale) for c in centroids),
        boundaries=tuple(float(b / scale) for b in bounds),
        mse_per_coord=mse_t / head_dim,
    )
