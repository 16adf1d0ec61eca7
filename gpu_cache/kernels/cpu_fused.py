"""Fused CPU kernels for the TQ4 codec (numba), one pass per vector.

Pure-torch encode runs as separate passes over the whole batch (norm, rotate,
bucketize, gather, pack) and is memory-bound on small CPUs; these loops do the
randomized Hadamard rotation (fast Walsh-Hadamard transform), nearest-centroid
search, length correction and packing for 16 vectors at a time, with the butterflies
running across the 16 vectors so they vectorize.
Output matches :meth:`gpu_cache.codec.TQ4Codec.encode` on the torch path except where
a rotated coordinate lies within float32 rounding of a decision boundary (the FWHT
and a dense matmul round differently); tests bound how often and by how much.
Only power-of-two head dims (the Hadamard rotation) qualify.

``encode5_into`` / ``decode5_into`` do the same for the 5-bit keys of the ``k5v4``
format (:mod:`gpu_cache.format_specs`): a nibble plane in tq4's split-half order, then one
bit per coordinate (coordinate ``j`` in bit ``j % 8`` of byte ``d/2 + j // 8``);
``decode8_into`` for the rotated int8 vectors of the ``int8`` format. Every decoder can
write each row to a row of its choice and add a per-head offset on the way (``dest``,
``offsets``): the vLLM connector decodes stored blocks straight into the rows of
vLLM's pages, key offsets added back, in one pass. ``rope_move_into`` copies decoded
token-head vectors into pages at other positions, the keys rotated by RoPE on the way
(the connector's chunk placement). ``amx_pages_into`` casts float32 pages into the
bfloat16 tile layout of vLLM's AMX attention (the connector's bfloat16 attention).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["amx_pages_into", "available", "decode5_into", "decode8_into", "decode_into",
           "encode5_into", "encode_into", "limit_threads", "rope_move_into"]

_nb: Any
try:  # numba is an optional accelerator; the torch path is always there.
    import numba as _nb
except ImportError:  # pragma: no cover - exercised on installs without the extra
    _nb = None


def available() -> bool:
    """True when numba is importable, so the fused CPU kernels can run."""
    return _nb is not None


def limit_threads(n: int) -> None:
    """Run the kernels the calling thread starts on at most ``n`` threads (numba's
    setting is per thread; other threads keep theirs). Nothing without numba."""
    if _nb is not None:
        _nb.set_num_threads(max(1, min(n, _nb.config.NUMBA_NUM_THREADS)))


#: Vectors transformed side by side: the butterflies then run across this many SIMD
#: lanes (contiguous floats) instead of along one vector's short strides.
_LANES = 16

if _nb is not None:
    _jit: Any = _nb.njit(parallel=True, fastmath=True, cache=True)
    _prange: Any = _nb.prange

    @_nb.njit(inline="always", fastmath=True)
    def _fwht_lanes(v):  # pragma: no cover - jitted
        d = v.shape[0]
        h = 1
        while h < d:
            for start in range(0, d, 2 * h):
                for j in range(start, start + h):
                    for lane in range(_LANES):
                        a = v[j, lane]
                        b = v[j + h, lane]
                        v[j, lane] = a + b
                        v[j + h, lane] = a - b
            h *= 2

    @_nb.njit(inline="always", fastmath=True)
    def _rotate_rows(x, base, m, signs, v, sq):  # pragma: no cover - jitted
        """Rows ``base..base+m`` of ``x``, sign-flipped and transformed, into the lanes
        of ``v``; their squared norms into ``sq``."""
        d = x.shape[1]
        for lane in range(m):
            acc = np.float32(0.0)
            for j in range(d):
                a = np.float32(x[base + lane, j])
                acc += a * a
                v[j, lane] = a * signs[j]
            sq[lane] = acc
        _fwht_lanes(v)

    @_nb.njit(inline="always", fastmath=True)
    def _unrotate_rows(v, norms, base, m, signs, offsets, dest, out):  # pragma: no cover
        """The inverse: transformed lanes of ``v`` scaled by ``norms``, plus the offset of
        their head (row ``r`` is head ``r % H``, ``H = offsets.shape[0]``), into rows
        ``dest[base..base+m]`` of ``out``."""
        d = out.shape[1]
        heads = offsets.shape[0]
        inv_sqrt_d = 1.0 / math.sqrt(d)
        _fwht_lanes(v)
        for lane in range(m):
            row = base + lane
            scale = norms[row] * inv_sqrt_d
            head = row % heads
            at = dest[row]
            for j in range(d):
                out[at, j] = v[j, lane] * scale * signs[j] + offsets[head, j]

    @_jit
    def _encode(x, signs, bounds, cent, packed, norms):  # pragma: no cover - jitted
        n, d = x.shape
        half = d // 2
        inv_sqrt_d = 1.0 / math.sqrt(d)
        num_bounds = bounds.shape[0]
        for chunk in _prange((n + _LANES - 1) // _LANES):
            base = chunk * _LANES
            m = min(_LANES, n - base)
            v = np.zeros((d, _LANES), np.float32)
            sq = np.zeros(_LANES, np.float32)
            _rotate_rows(x, base, m, signs, v, sq)
            for lane in range(m):
                nrm = math.sqrt(sq[lane])
                scale = inv_sqrt_d / nrm if nrm > 0 else 0.0
                recon_sq = 0.0
                for j in range(half):
                    lo_val = v[j, lane] * scale
                    hi_val = v[j + half, lane] * scale
                    lo = 0
                    hi = 0
                    for b in range(num_bounds):
                        lo += lo_val > bounds[b]
                        hi += hi_val > bounds[b]
                    recon_sq += cent[lo] * cent[lo] + cent[hi] * cent[hi]
                    packed[base + lane, j] = lo | (hi << 4)
                norms[base + lane] = nrm / math.sqrt(recon_sq) if nrm > 0 else 0.0

    @_jit
    def _decode(packed, norms, signs, cent, offsets, dest, out):  # pragma: no cover - jitted
        n, half = packed.shape
        d = half * 2
        for chunk in _prange((n + _LANES - 1) // _LANES):
            base = chunk * _LANES
            m = min(_LANES, n - base)
            v = np.zeros((d, _LANES), np.float32)
            for lane in range(m):
                for j in range(half):
                    byte = packed[base + lane, j]
                    v[j, lane] = cent[byte & 15]
                    v[j + half, lane] = cent[byte >> 4]
            _unrotate_rows(v, norms, base, m, signs, offsets, dest, out)

    @_jit
    def _decode8(packed, scales, signs, offsets, dest, out):  # pragma: no cover - jitted
        n, d = packed.shape
        for chunk in _prange((n + _LANES - 1) // _LANES):
            base = chunk * _LANES
            m = min(_LANES, n - base)
            v = np.zeros((d, _LANES), np.float32)
            for lane in range(m):
                for j in range(d):
                    v[j, lane] = np.float32(packed[base + lane, j])
            _unrotate_rows(v, scales, base, m, signs, offsets, dest, out)

    @_jit
    def _encode5(x, signs, bounds, cent, packed, norms):  # pragma: no cover - jitted
        n, d = x.shape
        half = d // 2
        inv_sqrt_d = 1.0 / math.sqrt(d)
        num_bounds = bounds.shape[0]
        for chunk in _prange((n + _LANES - 1) // _LANES):
            base = chunk * _LANES
            m = min(_LANES, n - base)
            v = np.zeros((d, _LANES), np.float32)
            sq = np.zeros(_LANES, np.float32)
            _rotate_rows(x, base, m, signs, v, sq)
            for lane in range(m):
                row = base + lane
                nrm = math.sqrt(sq[lane])
                scale = inv_sqrt_d / nrm if nrm > 0 else 0.0
                recon_sq = 0.0
                for k in range(d // 8):
                    packed[row, half + k] = 0
                for j in range(half):
                    lo = 0
                    hi = 0
                    lo_val = v[j, lane] * scale
                    hi_val = v[j + half, lane] * scale
                    for b in range(num_bounds):
                        lo += lo_val > bounds[b]
                        hi += hi_val > bounds[b]
                    recon_sq += cent[lo] * cent[lo] + cent[hi] * cent[hi]
                    packed[row, j] = (lo & 15) | ((hi & 15) << 4)
                    jh = j + half
                    packed[row, half + j // 8] |= (lo >> 4) << (j % 8)
                    packed[row, half + jh // 8] |= (hi >> 4) << (jh % 8)
                norms[row] = nrm / math.sqrt(recon_sq) if nrm > 0 else 0.0

    @_jit
    def _rope_move(src, dst, k_src, k_dst, k_step, v_src, v_dst, cos, sin,
                   heads):  # pragma: no cover - jitted
        half = cos.shape[1]
        for i in _prange(k_src.shape[0]):
            t = i // heads
            a = k_src[i]
            b = k_dst[i]
            for j in range(half):
                x1 = src[a + j * k_step]
                x2 = src[a + (j + half) * k_step]
                c = cos[t, j]
                s = sin[t, j]
                dst[b + j * k_step] = x1 * c - x2 * s
                dst[b + (j + half) * k_step] = x2 * c + x1 * s
            a = v_src[i]
            b = v_dst[i]
            for j in range(2 * half):
                dst[b + j] = src[a + j]

    @_nb.njit(fastmath=True, cache=True)  # serial: safe on a thread vLLM's OpenMP owns
    def _amx_pages(src, ids, dst, heads, n, dim, by_dim):  # pragma: no cover - jitted
        page = 2 * n * dim
        half = n * dim
        one, up, sh = np.uint32(1), np.uint32(0x7FFF), np.uint32(16)
        for b in range(ids.shape[0]):
            for h in range(heads):
                s0 = (ids[b] * heads + h) * page
                o = (b * heads + h) * page
                # keys: tiles of 16 tokens, each token's dimensions in pairs
                for tb in range(n >> 4):
                    for dp in range(dim >> 1):
                        for ti in range(16):
                            t = tb * 16 + ti
                            for j in range(2):
                                d = dp * 2 + j
                                u = src[s0 + d * n + t] if by_dim else src[s0 + t * dim + d]
                                dst[o] = (u + up + ((u >> sh) & one)) >> sh  # RNE
                                o += 1
                # values: tiles of 16 dimensions, tokens in pairs
                for db in range(dim >> 4):
                    for tp in range(n >> 1):
                        for di in range(16):
                            for j in range(2):
                                u = src[s0 + half + (tp * 2 + j) * dim + db * 16 + di]
                                dst[o] = (u + up + ((u >> sh) & one)) >> sh
                                o += 1

    @_jit
    def _decode5(packed, norms, signs, cent, offsets, dest, out):  # pragma: no cover
        n = packed.shape[0]
        d = out.shape[1]
        half = d // 2
        for chunk in _prange((n + _LANES - 1) // _LANES):
            base = chunk * _LANES
            m = min(_LANES, n - base)
            v = np.zeros((d, _LANES), np.float32)
            for lane in range(m):
                row = base + lane
                for j in range(half):
                    byte = packed[row, j]
                    jh = j + half
                    b_lo = (packed[row, half + j // 8] >> (j % 8)) & 1
                    b_hi = (packed[row, half + jh // 8] >> (jh % 8)) & 1
                    v[j, lane] = cent[(byte & 15) | (b_lo << 4)]
                    v[jh, lane] = cent[(byte >> 4) | (b_hi << 4)]
            _unrotate_rows(v, norms, base, m, signs, offsets, dest, out)


def rope_move_into(src: np.ndarray, dst: np.ndarray, k_src: np.ndarray, k_dst: np.ndarray,
                   k_step: int, v_src: np.ndarray, v_dst: np.ndarray, cos: np.ndarray,
                   sin: np.ndarray, heads: int) -> None:
    """Copy token-head vectors from ``src`` to ``dst`` (flat float32 arrays), the keys
    rotated on the way: vector ``i`` (token ``i // heads``) has its key's coordinate
    ``j`` at ``k_src[i] + j * k_step`` (written at ``k_dst[i] + j * k_step``) and its
    value's at ``v_src[i] + j`` (written at ``v_dst[i] + j``). The key is rotated by
    ``cos``/``sin`` ``[T, d/2]`` in RoPE's neox layout (coordinate ``j`` pairs with
    ``j + d/2``): how the vLLM connector moves a chunk's K/V into the pages at new
    positions, the strides naming the pages' layout."""
    _rope_move(src, dst, k_src, k_dst, k_step, v_src, v_dst, cos, sin, heads)


def amx_pages_into(src: np.ndarray, block_ids: np.ndarray, dst: np.ndarray, heads: int,
                   block_size: int, head_dim: int, keys_by_dim: bool) -> None:
    """vLLM's float32 CPU pages (``src``: one layer, flat, viewed as uint32; blocks of
    ``[H, 2N, D]``, keys first, ``[D, N]`` when ``keys_by_dim`` else ``[N, D]``, values
    ``[N, D]``) of ``block_ids`` into bfloat16 pages for vLLM's AMX attention kernel
    (``dst``: flat, viewed as uint16; block ``i`` holds ``block_ids[i]``): keys in
    tiles ``[N/16, D/2, 16, 2]``, values ``[D/16, N/2, 16, 2]``, rounded to nearest
    even as torch casts. One serial pass (no OpenMP: the caller may be vLLM's forward
    thread); :func:`integrations.vllm.layout.probe_amx_pages` checks the layout
    against vLLM's own cache kernel before the connector relies on it."""
    _amx_pages(src, block_ids, dst, heads, block_size, head_dim, keys_by_dim)


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


def _rows(n: int, d: int, dest: np.ndarray | None, offsets: np.ndarray | None
          ) -> tuple[np.ndarray, np.ndarray]:
    """Where decoded rows go (``dest``, default: in order) and the per-head offsets
    added to them (default: none)."""
    if dest is None:
        dest = np.arange(n, dtype=np.int64)
    if offsets is None:
        offsets = np.zeros((1, d), np.float32)
    return dest, offsets


def decode_into(packed: np.ndarray, norms: np.ndarray, signs: np.ndarray,
                centroids: np.ndarray, out: np.ndarray, *, dest: np.ndarray | None = None,
                offsets: np.ndarray | None = None) -> None:
    """Decode ``packed`` ``[n, d/2]`` and ``norms`` ``[n]`` into ``out`` ``[m, d]`` float32:
    row ``r`` to row ``dest[r]`` (default ``r``), plus ``offsets[r % H]`` when given
    (``[H, d]``, rows ordered with the head fastest)."""
    dest, offsets = _rows(packed.shape[0], out.shape[1], dest, offsets)
    _decode(packed, norms, signs, centroids, offsets, dest, out)


def decode8_into(packed: np.ndarray, scales: np.ndarray, signs: np.ndarray,
                 out: np.ndarray, *, dest: np.ndarray | None = None,
                 offsets: np.ndarray | None = None) -> None:
    """Decode rotated int8 vectors ``packed`` ``[n, d]`` (``scales`` ``[n]``) into
    ``out`` like :func:`decode_into`."""
    dest, offsets = _rows(packed.shape[0], out.shape[1], dest, offsets)
    _decode8(packed, scales, signs, offsets, dest, out)


def encode5_into(x: np.ndarray, signs: np.ndarray, boundaries: np.ndarray,
                 centroids: np.ndarray, packed: np.ndarray, norms: np.ndarray) -> None:
    """Encode rows of ``x`` (``[n, d]`` float32) at 5 bits into ``packed`` ``[n, 5d/8]``
    (nibble plane, then fifth-bit plane) and ``norms``."""
    _encode5(x, signs, boundaries, centroids, packed, norms)


def decode5_into(packed: np.ndarray, norms: np.ndarray, signs: np.ndarray,
                 centroids: np.ndarray, out: np.ndarray, *, dest: np.ndarray | None = None,
                 offsets: np.ndarray | None = None) -> None:
    """Decode 5-bit ``packed`` ``[n, 5d/8]`` and ``norms`` ``[n]`` into ``out`` like
    :func:`decode_into`."""
    dest, offsets = _rows(packed.shape[0], out.shape[1], dest, offsets)
    _decode5(packed, norms, signs, centroids, offsets, dest, out)
