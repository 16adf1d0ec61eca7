"""Fused CPU decode attention over one layer of the packed TQ4 cache.

One call per layer does everything for one query token: rotate ``q``, walk the
packed range through the block table (whole blocks after the sink, a partial last
block), fold the float sink / residual-window K/V into the same online softmax,
rotate back. It returns ``out`` ``[Hq, D]`` float32 and the log-sum-exp ``[Hq]``.

Backends (:func:`backend` says which one runs):

- ``"cpp"``: a C++ torch op (``_cpu_decode.cpp``) compiled on first use with
  ``-O3 -march=native`` (AVX-512 codebook lookups with ``permutexvar`` where the
  CPU has them, a scalar path otherwise), threaded over (kv head x context chunk)
  jobs with ``at::parallel_for``. The build lives under
  ``$CONTEXTKIT_CACHE_DIR/kernels`` (default ``~/.cache/contextkit/kernels``),
  keyed on the source, the torch version, the compiler and the CPU flags, so a
  second process only loads the shared library.
- ``"numba"``: a plain numba kernel with the same results, used when the compiler
  is missing or the build fails (one warning is logged). Its scalar codebook lookups
  are slower than the chunked torch path, so :func:`fused_available` tells callers
  with a choice (``tq4_decode_attention(backend="auto")``, the engine) to keep the
  torch path then.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import math
import os
import platform
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

__all__ = ["CpuDecodeBackend", "backend", "build_dir", "decode_attention", "encode_into_cache",
           "fused_available"]

logger = logging.getLogger(__name__)

CpuDecodeBackend = Literal["cpp", "numba"]
_SOURCE = Path(__file__).with_name("_cpu_decode.cpp")
_state: dict[str, Any] = {}
#: -fopenmp: at::parallel_for is inlined from ATen's headers and splits work with
#: OpenMP pragmas, so without it the op runs on one thread. The library's libgomp.so.1
#: resolves to the one torch has already loaded (same soname): one thread pool.
_CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"]


# ------------------------------------------------------------------ build / load
def build_dir() -> Path:
    """Where compiled kernels are kept: ``$CONTEXTKIT_CACHE_DIR/kernels`` or
    ``~/.cache/contextkit/kernels``."""
    base = os.environ.get("CONTEXTKIT_CACHE_DIR") or str(Path.home() / ".cache" / "contextkit")
    return Path(base).expanduser() / "kernels"


def _cpu_flags() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    return platform.processor() or platform.machine()


def _build_key() -> str:
    parts = [_SOURCE.read_bytes().decode(), torch.__version__, _cpu_flags(), *_CFLAGS,
             os.environ.get("CXX", "c++"), str(shutil.which(os.environ.get("CXX", "c++")))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _load_cpp() -> None:
    """Load the compiled op, building it first if no process has (under a lock)."""
    name = f"contextkit_cpu_decode_{_build_key()}"
    where = build_dir() / name
    library = where / f"{name}.so"
    with _file_lock(build_dir() / f"{name}.lock"):
        if not library.exists():
            from torch.utils import cpp_extension

            where.mkdir(parents=True, exist_ok=True)
            logger.info("compiling the fused CPU decode kernel into %s (once)", where)
            cpp_extension.load(
                name=name, sources=[str(_SOURCE)], build_directory=str(where),
                extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
                is_python_module=False, verbose=False,
            )
            return  # load() has loaded the library into torch.ops
    torch.ops.load_library(str(library))


def backend() -> CpuDecodeBackend:
    """``"cpp"`` when the compiled op is loaded (building it on first use), else
    ``"numba"``; decided once per process. ``GPU_CACHE_CPU_DECODE=numba`` skips the
    build (e.g. on a GPU machine, where decoding runs the Triton kernel)."""
    chosen: CpuDecodeBackend | None = _state.get("backend")
    if chosen is None:
        if os.environ.get("GPU_CACHE_CPU_DECODE", "").lower() == "numba":
            chosen = "numba"
        else:
            try:
                _load_cpp()
                chosen = "cpp"
            except Exception as exc:  # compiler missing, headers missing, build error
                logger.warning("fused CPU decode kernel unavailable (%s); using the slower "
                               "numba kernel. Install g++ and ninja to build it",
                               str(exc).strip().splitlines()[-1] if str(exc).strip() else exc)
                chosen = "numba"
        _state["backend"] = chosen
    return chosen


def fused_available() -> bool:
    """True when the compiled op runs (faster than the torch path on CPU)."""
    return backend() == "cpp"


# ------------------------------------------------------------------ numba fallback
def _numba_kernel() -> Any:
    kernel = _state.get("numba")
    if kernel is not None:
        return kernel
    import numba

    @numba.njit(cache=True, parallel=True)
    def _decode(q, kp, kn, vp, vn, table, num_tokens, rot, cent, scale, fk, fv, out, lse):
        # pragma: no cover - jitted
        hq, d = q.shape
        hkv = kp.shape[2]
        half = d // 2
        group = hq // hkv
        bs = kp.shape[1]
        for qh in numba.prange(hq):
            qr = np.zeros(d, np.float32)
            acc = np.zeros(d, np.float32)
            orig = np.zeros(d, np.float32)
            h = qh // group
            for j in range(d):
                a = np.float32(0.0)
                for e in range(d):
                    a += rot[j, e] * q[qh, e]
                qr[j] = a * scale
            m = -np.inf
            lsum = np.float32(0.0)
            for t in range(num_tokens):
                blk = table[t // bs]
                pos = t % bs
                s = np.float32(0.0)
                for j in range(half):
                    b = kp[blk, pos, h, j]
                    s += cent[b & 15] * qr[j] + cent[b >> 4] * qr[j + half]
                s *= kn[blk, pos, h]
                if s > m:  # rescale only when the running max moves
                    alpha = math.exp(m - s)
                    lsum *= alpha
                    for j in range(d):
                        acc[j] *= alpha
                    m = s
                p = math.exp(s - m)
                lsum += p
                w = p * vn[blk, pos, h]
                for j in range(half):
                    b = vp[blk, pos, h, j]
                    acc[j] += w * cent[b & 15]
                    acc[j + half] += w * cent[b >> 4]
            for e in range(d):
                a = np.float32(0.0)
                for j in range(d):
                    a += acc[j] * rot[j, e]
                orig[e] = a
            for t in range(fk.shape[0]):  # float part, original domain
                s = np.float32(0.0)
                for e in range(d):
                    s += q[qh, e] * fk[t, h, e]
                s *= scale
                m_new = max(m, s)
                alpha = math.exp(m - m_new)
                p = math.exp(s - m_new)
                lsum = lsum * alpha + p
                for e in range(d):
                    orig[e] = orig[e] * alpha + p * fv[t, h, e]
                m = m_new
            for e in range(d):
                out[qh, e] = orig[e] / lsum if lsum > 0 else 0.0
            lse[qh] = m + math.log(lsum) if lsum > 0 else -np.inf

    _state["numba"] = _decode
    return _decode


def _run_numba(query: torch.Tensor, k_packed: torch.Tensor, k_norms: torch.Tensor,
               v_packed: torch.Tensor, v_norms: torch.Tensor, table: torch.Tensor,
               num_tokens: int, rotation: torch.Tensor, centroids: torch.Tensor, scale: float,
               float_k: Sequence[torch.Tensor], float_v: Sequence[torch.Tensor],
               ) -> tuple[torch.Tensor, torch.Tensor]:
    hq, dim = query.shape
    hkv = k_packed.shape[2]
    if float_k:
        fk = torch.cat([k.float() for k in float_k]).contiguous()
        fv = torch.cat([v.float() for v in float_v]).contiguous()
    else:
        fk = fv = torch.zeros(0, hkv, dim)
    out = torch.empty(hq, dim)
    lse = torch.empty(hq)
    _numba_kernel()(query.numpy(), k_packed.numpy(), k_norms.numpy(), v_packed.numpy(),
                    v_norms.numpy(), table.numpy(), num_tokens, rotation.numpy(),
                    centroids.numpy(), np.float32(scale), fk.numpy(), fv.numpy(),
                    out.numpy(), lse.numpy())
    return out, lse


# ------------------------------------------------------------------ entry point
def decode_attention(
    query: torch.Tensor,
    k_packed: torch.Tensor,
    k_norms: torch.Tensor,
    v_packed: torch.Tensor,
    v_norms: torch.Tensor,
    block_table: torch.Tensor,
    first_block: int,
    num_tokens: int,
    rotation: torch.Tensor,
    centroids: torch.Tensor,
    scale: float,
    float_k: Sequence[torch.Tensor] = (),
    float_v: Sequence[torch.Tensor] = (),
    use: CpuDecodeBackend | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query token over a packed range plus float K/V pieces.

    No validation beyond what the op itself checks (callers are
    :func:`gpu_cache.kernels.tq4_decode_attention` and the engine's paged view).

    Args:
        query: float32 ``[Hq, D]`` (contiguous; not rotated).
        k_packed, v_packed: uint8 ``[NB, BS, Hkv, D/2]`` (one layer; last dim
            contiguous); k_norms, v_norms: float32 ``[NB, BS, Hkv]``.
        block_table: int32 ``[max_blocks]`` contiguous; the packed range is tokens
            ``0..num_tokens`` of blocks ``block_table[first_block:]``.
        rotation, centroids: the codec's ``R`` ``[D, D]`` and 16 centroids (CPU).
        scale: softmax scale.
        float_k, float_v: float32 pieces ``[F_i, Hkv, D]`` (rows contiguous; keys
            centered like the cache's) attended with the packed range.
        use: force a backend (tests); default :func:`backend`.

    Returns:
        ``out`` float32 ``[Hq, D]`` and ``lse`` ``[Hq]`` (``-inf`` and zeros when
        there is no key at all).
    """
    chosen = use or backend()
    if chosen == "cpp":
        if backend() != "cpp":
            raise RuntimeError("the compiled CPU decode op is not available on this machine")
        out, lse = torch.ops.contextkit_cpu.tq4_decode(
            query, k_packed, k_norms, v_packed, v_norms, block_table, first_block, num_tokens,
            rotation, centroids, scale, list(float_k), list(float_v))
        return out, lse
    return _run_numba(query, k_packed, k_norms, v_packed, v_norms,
                      block_table[first_block:].contiguous(), num_tokens, rotation, centroids,
                      scale, float_k, float_v)


def encode_into_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    k_packed: torch.Tensor,
    k_norms: torch.Tensor,
    v_packed: torch.Tensor,
    v_norms: torch.Tensor,
    rotation: torch.Tensor,
    boundaries: torch.Tensor,
    centroids: torch.Tensor,
    key_offset: torch.Tensor | None = None,
) -> None:
    """Encode a few new K/V rows into their slots in one compiled call (the compiled
    op must be loaded: :func:`fused_available`).

    Computes what :meth:`gpu_cache.codec.TQ4Codec.encode` computes on its torch path
    (dense rotation, bucketize, length correction, split-half packing), so a decode
    step does not pay the torch path's dozen ops per layer for 2 x Hkv vectors.

    Args:
        key, value: contiguous float32 ``[T, Hkv, D]``; key_offset ``[Hkv, D]`` is
            subtracted from the keys first.
        slots: contiguous int64 ``[T]`` (``block * block_size + pos``; negative: skip).
        k_packed, v_packed, k_norms, v_norms: one layer of the cache, written in place.
        rotation, boundaries, centroids: the codec's ``R`` ``[D, D]``, 15 decision
            boundaries and 16 centroids.
    """
    torch.ops.contextkit_cpu.tq4_encode(key, value, slots, k_packed, k_norms, v_packed,
                                        v_norms, rotation, boundaries, centroids, key_offset)
