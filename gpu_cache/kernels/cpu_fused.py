"""Fused CPU kernels for the TQ4 codec (numba), one pass per vector.

Pure-torch encode runs as separate passes over the whole batch (norm, rotate,
bucketize, gather, pack) and is memory-bound on small CPUs; these loops do the
randomized Hadamard rotation (in-register fast Walsh-Hadamard transform),
nearest-centroid search, length correction and packing for one vector at a time.
Output matches :meth:`gpu_cache.codec.TQ4Codec.encode` on the torch path except where
a rotated coordinate lies within float32 rounding of a decision boundary (the FWHT
and a dense matmul round differently); tests bound how often and by how much.
Only power-of-two head dims (the Hadamard rotation) qualify.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["available", "decode_into", "encode_into"]

_nb: Any
try:  # numba is an optional accelerator; the torch path is always there.
    import numba as _nb
except ImportError:  # pragma: no cover - exercised on installs without the extra
    _nb = None


def available() -> bool:
    """True when numba is importable, so the fused CPU kernels can run."""
    return _nb is not None


if _nb is not None:
    _jit: Any = _nb.njit(parallel=True, fastmath=True, cache=True)
    _prange: Any = _nb.prange

    @_jit
    def _encode(x, signs, bounds, cent, packed, norms):  # pragma: no cover - jitted
        n, d = x.shape
        half = d // 2
        inv_sqrt_d = 1.0 / math.sqrt(d)
        num_bounds = bounds.shape[0]
        for i in _prange(n):
            v = np.empty(d, np.float32)
            sq = np.float32(0.0)
            for j in range(d):
                a = np.float32(x[i, j])
                sq += a * a
                v[j] = a * signs[j]
            h = 1
            while h < d:
                for start in range(0, d, 2 * h):
                    for j in range(start, start + h):
                        a = v[j]
                        b = v[j + h]
                        v[j] = a + b
                        v[j + h] = a - b
                h *= 2
            nrm = math.sqrt(sq)
            scale = inv_sqrt_d / nrm if nrm > 0 else 0.0
            recon_sq = 0.0
            idx = np.empty(d, np.uint8)
            for j in range(d):
                r = v[j] * scale
                k = 0
                for b in range(num_bounds):
                    k += r > bounds[b]
                idx[j] = k
                c = cent[k]
                recon_sq += c * c
            for j in range(half):
                packed[i, j] = idx[j] | (idx[j + half] << 4)
            norms[i] = nrm / math.sqrt(recon_sq) if nrm > 0 else 0.0

    @_jit
    def _decode(packed, norms, signs, cent, out):  # pragma: no cover - jitted
        n, half = packed.shape
        d = half * 2
        inv_sqrt_d = 1.0 / math.sqrt(d)
        for i in _prange(n):
            v = np.empty(d, np.float32)
            for j in range(half):
                byte = packed[i, j]
                v[j] = cent[byte & 15]
                v[j + half] = cent[byte >> 4]
            h = 1
            while h < d:
                for start in range(0, d, 2 * h):
                    for j in range(start, start + h):
                        a = v[j]
                        b = v[j + h]
                        v[j] = a + b
                        v[j + h] = a - b
                h *= 2
            scale = norms[i] * inv_sqrt_d
            for j in range(d):
                out[i, j] = v[j] * scale * signs[j]


def encode_into(
    x: np.ndarray,
    signs: np.ndarray,
    boundaries: np.ndarray,
    centroids: np.ndarray,
    packed: np.ndarray,
    norms: np.ndarray,
) -> None:
    """Encode rows of ``x`` (``[n, d]`` float32) into ``packed`` ``[n, d/2]`` and ``norms``."""
    _encode(x, signs, boundaries, centroids, packed, norms)


def decode_into(
    packed: np.ndarray,
    norms: np.ndarray,
    signs: np.ndarray,
    centroids: np.ndarray,
    out: np.ndarray,
) -> None:
    """Decode ``packed`` ``[n, d/2]`` and ``norms`` ``[n]`` into ``out`` ``[n, d]`` float32."""
    _decode(packed, norms, signs, centroids, out)
