"""The fused CPU decode kernel against a float dequantize + softmax reference.

Awkward shapes: contexts of 1, 15, 17 tokens and a partial last block, GQA groups
1/3/4, head_dim 64 and a non-power-of-two 48 (QR rotation, a masked byte tail),
with and without float sink/window pieces, scattered block tables; both backends.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_cache.codec import TQ4Codec
from gpu_cache.kernels import cpu_decode, quantize_into_cache, tq4_decode_attention
from gpu_cache.kernels.naive import dequantize_cache_ref

BLOCK = 16
TOL = 2e-6  # max abs error / max |ref|: float32 rounding of a few hundred terms


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, tol: float = TOL) -> None:
    ref, out = ref.double(), out.double()
    assert ref.shape == out.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite output"
    err = ((ref - out).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
    assert err <= tol, f"{name}: max err ratio {err:.3e} > {tol:.1e}"


class Layer:
    """One layer of a packed cache holding ``tokens`` real encoded K/V rows, scattered."""

    def __init__(self, codec: TQ4Codec, num_kv: int, tokens: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.codec = codec
        num_used = max(1, -(-tokens // BLOCK))
        num_blocks = num_used + 5
        dim = codec.head_dim
        shape = (num_blocks, BLOCK, num_kv)
        self.k_packed = torch.zeros(*shape, dim // 2, dtype=torch.uint8)
        self.v_packed = torch.zeros(*shape, dim // 2, dtype=torch.uint8)
        self.k_norms = torch.zeros(shape)
        self.v_norms = torch.zeros(shape)
        self.table = torch.randperm(num_blocks, generator=gen)[:num_used].to(torch.int32)
        self.keys = torch.randn(tokens, num_kv, dim, generator=gen) * 2 + 0.5
        self.values = torch.randn(tokens, num_kv, dim, generator=gen)
        pos = torch.arange(tokens)
        slots = self.table[pos // BLOCK].long() * BLOCK + pos % BLOCK
        quantize_into_cache(self.keys, self.values, slots, self.k_packed, self.k_norms,
                            self.v_packed, self.v_norms, codec)

    def dequantized(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed rows ``[tokens, Hkv, D]`` as the cache holds them (float)."""
        pos = torch.arange(tokens)
        blocks, offs = self.table[pos // BLOCK].long(), pos % BLOCK
        k = dequantize_cache_ref(self.k_packed, self.k_norms, self.codec)[blocks, offs]
        v = dequantize_cache_ref(self.v_packed, self.v_norms, self.codec)[blocks, offs]
        return k, v


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` ``[Hq, D]`` over ``[N, Hkv, D]`` in float64; lse ``[Hq]``."""
    group = q.shape[0] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,nhd->hn", q.double(), k) * scale
    return torch.einsum("hn,nhd->hd", torch.softmax(scores, -1), v), torch.logsumexp(scores, -1)


CASES = [  # (context tokens, Hq, Hkv, D)
    pytest.param(1, 9, 3, 64, id="ctx1-g3"),
    pytest.param(15, 9, 3, 64, id="ctx15-g3"),
    pytest.param(17, 9, 3, 64, id="ctx17-g3"),
    pytest.param(16 * 7 + 5, 4, 4, 64, id="partial-g1"),
    pytest.param(16 * 5 + 9, 8, 2, 64, id="partial-g4"),
    pytest.param(17, 6, 2, 48, id="ctx17-g3-d48"),
    pytest.param(16 * 3 + 1, 8, 1, 48, id="partial-g8-d48"),
    pytest.param(600, 9, 3, 64, id="ctx600-g3"),
    pytest.param(3000, 9, 3, 64, id="ctx3000-g3-chunked"),
    pytest.param(300, 5, 1, 128, id="ctx300-g5-d128"),
]
BACKENDS = ["cpp", "numba"]


@pytest.mark.parametrize("use", BACKENDS)
@pytest.mark.parametrize(("tokens", "num_q", "num_kv", "dim"), CASES)
def test_packed_range_matches_dequantized_attention(use: str, tokens: int, num_q: int,
                                                    num_kv: int, dim: int) -> None:
    codec = TQ4Codec(dim, seed=3)
    layer = Layer(codec, num_kv, tokens, seed=tokens)
    q = torch.randn(num_q, dim, generator=torch.Generator().manual_seed(1))
    scale = 1 / math.sqrt(dim)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))  # >= 8192 token-heads: chunks merged by LSE
    try:
        out, lse = cpu_decode.decode_attention(
            q, layer.k_packed, layer.k_norms, layer.v_packed, layer.v_norms, layer.table, 0,
            tokens, codec.rotation, codec.centroids, scale, use=use)  # type: ignore[arg-type]
    finally:
        torch.set_num_threads(threads)
    ref, ref_lse = reference(q, *layer.dequantized(tokens), scale)
    assert_close(f"{use} out", ref, out)
    assert_close(f"{use} lse", ref_lse, lse)


@pytest.mark.parametrize("use", BACKENDS)
@pytest.mark.parametrize(("tokens", "num_q", "num_kv", "dim"), CASES[1:7])
def test_float_sink_and_window_fold_into_the_same_softmax(use: str, tokens: int, num_q: int,
                                                          num_kv: int, dim: int) -> None:
    """Sink (one block), packed middle from block 1, window as a strided buffer slice."""
    codec = TQ4Codec(dim, seed=5)
    total = tokens + BLOCK + 7
    layer = Layer(codec, num_kv, total, seed=total)
    gen = torch.Generator().manual_seed(2)
    sink_k, sink_v = layer.keys[:BLOCK], layer.values[:BLOCK]
    window = 7
    buf_k = torch.randn(window + 20, num_kv, dim, generator=gen)  # capacity > window
    buf_v = torch.randn(window + 20, num_kv, dim, generator=gen)
    win_k, win_v = buf_k[3 : 3 + window], buf_v[3 : 3 + window]
    q = torch.randn(num_q, dim, generator=gen) * 3
    scale = 0.11
    out, lse = cpu_decode.decode_attention(
        q, layer.k_packed, layer.k_norms, layer.v_packed, layer.v_norms, layer.table, 1,
        tokens, codec.rotation, codec.centroids, scale, [sink_k, win_k], [sink_v, win_v],
        use=use)  # type: ignore[arg-type]
    packed_k, packed_v = layer.dequantized(BLOCK + tokens)
    keys = torch.cat([sink_k, packed_k[BLOCK:], win_k])
    values = torch.cat([sink_v, packed_v[BLOCK:], win_v])
    ref, ref_lse = reference(q, keys, values, scale)
    assert_close(f"{use} out", ref, out)
    assert_close(f"{use} lse", ref_lse, lse)


@pytest.mark.parametrize("use", BACKENDS)
def test_float_only_and_empty(use: str) -> None:
    codec = TQ4Codec(64, seed=0)
    layer = Layer(codec, 3, 16, seed=0)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(9, 64, generator=gen)
    fk, fv = torch.randn(5, 3, 64, generator=gen), torch.randn(5, 3, 64, generator=gen)
    args = (layer.k_packed, layer.k_norms, layer.v_packed, layer.v_norms, layer.table, 0)
    out, lse = cpu_decode.decode_attention(q, *args, 0, codec.rotation, codec.centroids, 0.125,
                                           [fk], [fv], use=use)  # type: ignore[arg-type]
    ref, ref_lse = reference(q, fk, fv, 0.125)
    assert_close("float only", ref, out)
    assert_close("float only lse", ref_lse, lse)
    out, lse = cpu_decode.decode_attention(q, *args, 0, codec.rotation, codec.centroids, 0.125,
                                           use=use)  # type: ignore[arg-type]
    assert torch.equal(out, torch.zeros(9, 64)) and torch.isneginf(lse).all()


def test_tq4_decode_attention_dispatches_to_the_fused_kernel_on_cpu() -> None:
    """``backend="auto"``/``"cpu"`` equal the torch path, per sequence of a batch
    (lengths 0, 1, 17 and a partial block; an int64 table)."""
    codec = TQ4Codec(64, seed=7)
    layer = Layer(codec, 2, 16 * 6, seed=9)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(4, 8, 64, generator=gen)
    table = torch.stack([layer.table.long()[torch.randperm(6, generator=gen)] for _ in range(4)])
    lens = torch.tensor([0, 1, 17, 16 * 4 + 3])
    args = (q, layer.k_packed, layer.k_norms, layer.v_packed, layer.v_norms, table, lens, codec)
    ref, ref_lse = tq4_decode_attention(*args, backend="torch", return_lse=True)
    for backend in ("auto", "cpu"):
        out, lse = tq4_decode_attention(*args, backend=backend, return_lse=True)
        assert_close(backend, ref, out, tol=1e-5)
        assert torch.isneginf(lse[0]).all() and torch.equal(out[0], torch.zeros(8, 64))
        assert_close(f"{backend} lse", ref_lse[1:], lse[1:], tol=1e-5)


def test_backend_is_the_compiled_op_where_a_compiler_exists() -> None:
    has_compiler = shutil.which(os.environ.get("CXX", "c++")) is not None
    assert cpu_decode.backend() == ("cpp" if has_compiler else "numba")


def test_numba_override_leaves_the_configuration_loadable() -> None:
    """$GPU_CACHE_CPU_DECODE=numba picks the numba kernel, and being outside the
    CONTEXTKIT_ namespace it does not make load_config() refuse the environment."""
    code = ("from contextkit.config import load_config\n"
            "from gpu_cache.kernels import cpu_decode\n"
            "load_config()\n"
            "print('BACKEND', cpu_decode.backend())\n")
    env = {**os.environ, "GPU_CACHE_CPU_DECODE": "numba"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "BACKEND numba" in run.stdout


def test_second_process_loads_the_cached_build_without_compiling(tmp_path: Path) -> None:
    """The build is keyed and kept under $CONTEXTKIT_CACHE_DIR/kernels: a second
    process only loads the library (no 'compiling' log line) and gets the same op."""
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
            "from gpu_cache.kernels import cpu_decode\n"
            "print('BACKEND', cpu_decode.backend())\n")
    env = {**os.environ, "CONTEXTKIT_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=600, check=True).stdout for _ in range(2)]
    expected = cpu_decode.backend()
    assert all(f"BACKEND {expected}" in r for r in runs)
    if expected == "cpp":
        assert "compiling" in runs[0] and "compiling" not in runs[1]
        assert len(list((tmp_path / "kernels").glob("*/*.so"))) == 1


@pytest.mark.parametrize("dim", [48, 64, 128])
@pytest.mark.parametrize("with_offset", [False, True])
def test_encode_into_cache_matches_the_codec(dim: int, with_offset: bool) -> None:
    """The compiled encode of a decode step's rows writes what the codec's torch path
    writes: same packed bytes, norms within float32 rounding; skipped slots (-1) and a
    zero vector behave as on the torch path."""
    if not cpu_decode.fused_available():
        pytest.fail("the compiled CPU op did not build on this machine (g++ and ninja)")
    codec = TQ4Codec(head_dim=dim)
    gen = torch.Generator().manual_seed(dim)
    num_kv, tokens = 3, 6
    key = torch.randn(tokens, num_kv, dim, generator=gen) * 2 + 0.3
    value = torch.randn(tokens, num_kv, dim, generator=gen)
    key[2, 1] = 0.0
    value[4, 0] = 0.0
    offset = torch.randn(num_kv, dim, generator=gen) if with_offset else None
    if offset is not None:
        key[2, 1] = offset[1]  # zero after centering
    slots = torch.tensor([5, 16, 47, -1, 0, 79])
    caches = []
    for _ in range(2):
        shape = (5, BLOCK, num_kv)
        caches.append([torch.full((*shape, dim // 2), 7, dtype=torch.uint8),
                       torch.full(shape, -1.0),
                       torch.full((*shape, dim // 2), 7, dtype=torch.uint8),
                       torch.full(shape, -1.0)])
    quantize_into_cache(key, value, slots, *caches[0], codec, backend="torch",
                        key_offset=offset)
    cpu_decode.encode_into_cache(key, value, slots, *caches[1], codec.rotation,
                                 codec.boundaries, codec.centroids, offset)
    (kp0, kn0, vp0, vn0), (kp1, kn1, vp1, vn1) = caches
    assert torch.equal(kp0, kp1) and torch.equal(vp0, vp1)
    torch.testing.assert_close(kn1, kn0, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(vn1, vn0, rtol=1e-6, atol=0.0)
    assert kn1.view(-1, num_kv)[47, 1] == 0.0 and vn1.view(-1, num_kv)[0, 0] == 0.0
    untouched = torch.ones(5 * BLOCK, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert (kn1.view(-1, num_kv)[untouched] == -1.0).all()  # slot -1 wrote nothing
