"""TQ4 cache kernels: Triton (interpreted on CPU) and torch path against float32 references."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

import gpu_cache.kernels
from gpu_cache._errors import CodecInputError
from gpu_cache.codec import TQ4Codec
from gpu_cache.kernels import (
    naive,
    quantize_into_cache,
    torch_ops,
    tq4_decode_attention,
    tq4_extend_attention,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = ["triton", "torch"]

#: Kernel vs reference on the *same* dequantized cache: only float32 rounding
#: differs (rotated vs unrotated domain, summation order), ~1e-6 of the output
#: scale; 1e-4 leaves room for peaky softmaxes over norms up to 1e3.
KERNEL_TOL = 1e-4
#: float16 tiles round the queries, centroid values and softmax weights to 2^-11 of
#: their size before float32 accumulation: ~5e-4 of the output scale measured.
FP16_TOL = 2e-3


def decode_tol(backend: str) -> float:
    """The tolerance of ``backend``'s default decode launch on this test's device: the
    Triton launch on CUDA uses float16 tiles (``triton_ops.default_decode``)."""
    if backend in ("triton", "auto") and DEVICE.type == "cuda":
        from gpu_cache.kernels import triton_ops

        return FP16_TOL if triton_ops.default_decode(DEVICE).fp16 else KERNEL_TOL
    return KERNEL_TOL


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, tol: float) -> None:
    """Max abs error relative to the reference's scale (max |ref|) must be <= tol."""
    ref, out = ref.double().cpu(), out.double().cpu()
    assert ref.shape == out.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite output"
    scale = ref.abs().max().clamp_min(1e-12)
    err = ((ref - out).abs().max() / scale).item()
    rmse = ((ref - out).pow(2).mean().sqrt() / scale).item()
    assert err <= tol, f"{name}: max err ratio {err:.3e} (rmse ratio {rmse:.3e}) > {tol:.1e}"


@dataclass
class Cache:
    """One layer of a packed cache plus its dequantized float copy."""

    k_packed: torch.Tensor
    k_norms: torch.Tensor
    v_packed: torch.Tensor
    v_norms: torch.Tensor
    k_float: torch.Tensor
    v_float: torch.Tensor

    @property
    def layer(self) -> tuple[torch.Tensor, ...]:
        return self.k_packed, self.k_norms, self.v_packed, self.v_norms


def empty_layer(codec: TQ4Codec, num_blocks: int, block_size: int, num_heads: int):
    packed = torch.zeros(num_blocks, block_size, num_heads, codec.packed_dim,
                         dtype=torch.uint8, device=DEVICE)
    norms = torch.zeros(num_blocks, block_size, num_heads, device=DEVICE)
    return packed, norms, packed.clone(), norms.clone()


def random_kv(gen: torch.Generator, shape: tuple[int, ...], log10_norms: tuple[float, float]):
    """Gaussian vectors whose norms spread log-uniformly over 10**log10_norms."""
    x = torch.randn(*shape, generator=gen)
    lo, hi = log10_norms
    scale = 10 ** (lo + (hi - lo) * torch.rand(*shape[:-1], 1, generator=gen))
    return (x / x.norm(dim=-1, keepdim=True) * scale).to(DEVICE)


def make_cache(
    codec: TQ4Codec,
    num_blocks: int,
    num_heads: int,
    block_size: int = 16,
    seed: int = 0,
    k_norms: tuple[float, float] = (0.0, 1.0),
    v_norms: tuple[float, float] = (0.0, 1.0),
) -> Cache:
    gen = torch.Generator().manual_seed(seed)
    num_slots = num_blocks * block_size
    key = random_kv(gen, (num_slots, num_heads, codec.head_dim), k_norms)
    value = random_kv(gen, (num_slots, num_heads, codec.head_dim), v_norms)
    layer = empty_layer(codec, num_blocks, block_size, num_heads)
    slots = torch.randperm(num_slots, generator=gen).to(DEVICE)
    naive.quantize_into_cache_ref(key, value, slots, *layer, codec)
    k_float = naive.dequantize_cache_ref(layer[0], layer[1], codec)
    v_float = naive.dequantize_cache_ref(layer[2], layer[3], codec)
    return Cache(*layer, k_float, v_float)


def scattered_table(gen: torch.Generator, batch: int, num_blocks: int, width: int):
    """Block tables whose rows are random (non-monotonic) picks of distinct blocks."""
    rows = [torch.randperm(num_blocks, generator=gen)[:width] for _ in range(batch)]
    return torch.stack(rows).to(torch.int32).to(DEVICE)


@pytest.fixture(scope="module")
def codec64() -> TQ4Codec:
    return TQ4Codec(64, seed=3, device=DEVICE)


@pytest.fixture(scope="module")
def codec128() -> TQ4Codec:
    return TQ4Codec(128, seed=0, device=DEVICE)


# ----------------------------------------------------------------- layout
def test_exports():
    assert sorted(gpu_cache.kernels.__all__) == [
        "Backend", "quantize_into_cache", "tq4_decode_attention", "tq4_extend_attention",
    ]


def test_import_gpu_cache_does_not_import_triton():
    code = (
        "import sys, gpu_cache, gpu_cache.codec, gpu_cache.kernels; "
        "print('triton' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ})
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("backend", BACKENDS)
def test_nibble_order_pinned(codec128: TQ4Codec, backend: str):
    """Byte j = idx[j] | idx[j + 64] << 4, on a vector whose codes are known."""
    j = torch.arange(64)
    # Codes of the rotated coordinates; levels 2..13 in this mix give ||c[idx]|| ~ 0.98,
    # so the unit vector of c[idx] still quantizes to idx.
    idx = torch.cat([2 + j % 12, 13 - j % 12]).to(DEVICE)
    x = codec128.centroids[idx] @ codec128.rotation  # unrotate: rotated(x) = c[idx]
    layer = empty_layer(codec128, 1, 16, 1)
    slot = torch.tensor([5], device=DEVICE)
    quantize_into_cache(x[None, None], x[None, None], slot, *layer, codec128, backend=backend)
    packed = layer[0][0, 5, 0].cpu()
    assert packed[0].item() == 0xD2  # idx[0] = 2 low, idx[64] = 13 high
    assert packed[1].item() == 0xC3  # idx[1] = 3 low, idx[65] = 12 high
    assert packed[11].item() == 0x2D  # idx[11] = 13 low, idx[75] = 2 high
    expected = (2 + j % 12) | ((13 - j % 12) << 4)
    assert torch.equal(packed, expected.to(torch.uint8))
    assert torch.equal(layer[2][0, 5, 0].cpu(), packed)
    # Decoding one token with seq_len 1 returns that token's V: pins the kernel's unpack.
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([6], dtype=torch.int32, device=DEVICE)
    cache = [t.clone() for t in layer]
    cache[1][0, :5] = 0.0  # earlier slots are empty vectors: norm 0, score 0 ...
    cache[3][0, :5] = 0.0  # ... and zero values; give slot 5 all the weight:
    cache[1][0, 5] = 1e4
    q = (x / x.norm() * 50.0)[None, None]
    out = tq4_decode_attention(q, *cache, table, lens, codec128, backend=backend)
    expected_v = naive.dequantize_cache_ref(*cache[2:], codec128)[0, 5, 0]
    assert_close("pinned decode", expected_v[None, None], out, decode_tol(backend))


# ----------------------------------------------------------------- quantize
QUANT_CASES = {
    "t33-h2-d64": (33, 2, 64, 16, torch.float32),
    "t16-h3-d128-bs8": (16, 3, 128, 8, torch.float32),
    "t5-h1-d64-bs32": (5, 1, 64, 32, torch.float32),
    "t20-h2-d64-fp16": (20, 2, 64, 16, torch.float16),
}


@pytest.mark.parametrize("case", list(QUANT_CASES), ids=list(QUANT_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_quantize_into_cache_matches_reference(case: str, backend: str):
    num_tokens, num_heads, head_dim, block_size, dtype = QUANT_CASES[case]
    codec = TQ4Codec(head_dim, seed=7, device=DEVICE)
    gen = torch.Generator().manual_seed(1)
    key = random_kv(gen, (num_tokens, num_heads, head_dim), (-3.0, 3.0)).to(dtype)
    value = random_kv(gen, (num_tokens, num_heads, head_dim), (-3.0, 3.0)).to(dtype)
    key[0, 0] = 0.0  # a zero vector encodes as norm 0
    num_blocks = 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)
    slots[::4] = -1  # padding tokens are skipped
    ref = empty_layer(codec, num_blocks, block_size, num_heads)
    out = empty_layer(codec, num_blocks, block_size, num_heads)
    for t in out:  # untouched slots must keep their old contents
        t.fill_(7)
    naive.quantize_into_cache_ref(key, value, slots, *ref, codec)
    quantize_into_cache(key, value, slots, *out, codec, backend=backend)

    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0].long()] = True
    written = written.view(num_blocks, block_size)
    for name, r, o in (("k", ref[0], out[0]), ("v", ref[2], out[2])):
        assert (o[~written] == 7).all(), f"{name}: a skipped slot was written"
        r_idx = torch.cat([r & 0xF, r >> 4], -1)[written].int()
        o_idx = torch.cat([o & 0xF, o >> 4], -1)[written].int()
        diff = (r_idx - o_idx).abs()
        # Codes may differ only for a coordinate within rounding of a boundary:
        # then by one level, and rarely.
        assert diff.max() <= 1, f"{name}: codes differ by more than one level"
        assert (diff > 0).float().mean() <= 2e-3, f"{name}: too many boundary ties"
    for name, r, o in (("k norms", ref[1], out[1]), ("v norms", ref[3], out[3])):
        assert (o[~written] == 7).all(), f"{name}: a skipped slot was written"
        rel = (r[written] - o[written]).abs() / r[written].abs().clamp_min(1e-30)
        assert rel.max() <= 1e-5, f"{name}: relative error {rel.max():.2e}"
        assert torch.equal(r[written] == 0, o[written] == 0)


# ----------------------------------------------------------------- decode
@dataclass(frozen=True)
class DecodeCase:
    seq_lens: tuple[int, ...]
    num_q_heads: int = 8
    num_kv_heads: int = 2
    num_blocks: int = 16
    block_size: int = 16
    k_norms: tuple[float, float] = (-0.5, 0.5)
    v_norms: tuple[float, float] = (-0.5, 0.5)
    num_splits: int | None = None


DECODE_CASES = {
    "partial-block-37": DecodeCase((37,)),
    "context-1": DecodeCase((1,)),
    "context-0-and-20": DecodeCase((0, 20)),
    "gqa-1": DecodeCase((45,), num_q_heads=2, num_kv_heads=2),
    "gqa-3": DecodeCase((45,), num_q_heads=6, num_kv_heads=2),
    "gqa-4-batch-3": DecodeCase((1, 50, 97), num_q_heads=4, num_kv_heads=1),
    "norms-1e-3..1e3": DecodeCase((70,), k_norms=(-3.0, 1.0), v_norms=(-3.0, 3.0)),
    "splits-5-len-201": DecodeCase((201, 33), num_splits=5),
    "block-size-8": DecodeCase((29,), block_size=8),
}


def decode_inputs(codec: TQ4Codec, c: DecodeCase, seed: int):
    """A packed cache, scattered block tables, lengths and queries for one case."""
    cache = make_cache(codec, c.num_blocks, c.num_kv_heads, c.block_size,
                       k_norms=c.k_norms, v_norms=c.v_norms)
    gen = torch.Generator().manual_seed(seed)
    batch = len(c.seq_lens)
    width = max(1, -(-max(c.seq_lens) // c.block_size))
    table = scattered_table(gen, batch, c.num_blocks, width)
    lens = torch.tensor(c.seq_lens, dtype=torch.int32, device=DEVICE)
    query = (torch.randn(batch, c.num_q_heads, codec.head_dim, generator=gen) * 2).to(DEVICE)
    return cache, table, lens, query


@pytest.mark.parametrize("case", list(DECODE_CASES), ids=list(DECODE_CASES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_attention_matches_reference(codec64: TQ4Codec, case: str, backend: str):
    c = DECODE_CASES[case]
    cache, table, lens, query = decode_inputs(codec64, c, seed=5)
    scale = 1 / math.sqrt(64)
    ref = naive.paged_decode_attention_ref(query, cache.k_float, cache.v_float, table, lens,
                                           scale)
    out = tq4_decode_attention(query, *cache.layer, table, lens, codec64, scale,
                               backend=backend, num_splits=c.num_splits)
    assert_close(f"decode {case} [{backend}]", ref, out, decode_tol(backend))
    for b, n in enumerate(c.seq_lens):
        if n == 0:
            assert (out[b] == 0).all()


DECODE_CONFIGS = {
    "table": dict(lookup="table"),
    "fp16": dict(fp16=True),
    "fp16-table-n32-w8": dict(fp16=True, lookup="table", block_n=32, num_warps=8),
    "fp16-table-w2-x4": dict(fp16=True, lookup="table", num_warps=2, splits_per_sm=4),
    "n128-s1-x4": dict(block_n=128, num_stages=1, splits_per_sm=4),
}


@pytest.mark.parametrize("case", ["context-0-and-20", "gqa-4-batch-3", "norms-1e-3..1e3",
                                  "splits-5-len-201", "block-size-8"])
@pytest.mark.parametrize("setting", list(DECODE_CONFIGS), ids=list(DECODE_CONFIGS))
def test_decode_launch_settings_match_reference(codec64: TQ4Codec, case: str, setting: str):
    """Every launch setting ``bench kernel --sweep`` times computes the same attention."""
    from gpu_cache.kernels import triton_ops

    config = triton_ops.DecodeConfig(**DECODE_CONFIGS[setting])  # type: ignore[arg-type]
    c = DECODE_CASES[case]
    cache, table, lens, query = decode_inputs(codec64, c, seed=5)
    ref = naive.paged_decode_attention_ref(query, cache.k_float, cache.v_float, table, lens,
                                           0.125)
    out, lse = triton_ops.tq4_decode_attention_triton(
        query, *cache.layer, table, lens, codec64, 0.125, num_splits=c.num_splits,
        return_lse=True, config=config)
    assert_close(f"decode {case} [{setting}]", ref, out, FP16_TOL if config.fp16 else KERNEL_TOL)
    _, base_lse = triton_ops.tq4_decode_attention_triton(
        query, *cache.layer, table, lens, codec64, 0.125, num_splits=c.num_splits,
        return_lse=True, config=triton_ops.EXACT_DECODE)
    live = torch.isfinite(base_lse)
    assert torch.equal(live, torch.isfinite(lse))
    lse_err = (lse[live] - base_lse[live]).abs().max().item()
    assert lse_err <= (FP16_TOL if config.fp16 else 1e-4), f"log-sum-exp off by {lse_err:.2e}"
    for b, n in enumerate(c.seq_lens):
        if n == 0:
            assert (out[b] == 0).all()


@pytest.mark.parametrize("case", ["gqa-4-batch-3", "norms-1e-3..1e3", "splits-5-len-201",
                                  "empty-and-full"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_lse_matches_reference(codec64: TQ4Codec, case: str, backend: str):
    """``return_lse`` gives the log-sum-exp of the scaled scores over the dequantized
    keys, so partial attentions can be merged exactly (empty sequences: -inf)."""
    c = DECODE_CASES.get(case) or DecodeCase((0, 64), num_q_heads=3, num_kv_heads=1)
    cache, table, lens, query = decode_inputs(codec64, c, seed=11)
    batch = len(c.seq_lens)
    out, lse = tq4_decode_attention(query, *cache.layer, table, lens, codec64, 0.125,
                                    backend=backend, num_splits=c.num_splits, return_lse=True)
    plain = tq4_decode_attention(query, *cache.layer, table, lens, codec64, 0.125,
                                 backend=backend, num_splits=c.num_splits)
    assert torch.equal(out, plain)
    assert lse.shape == (batch, c.num_q_heads) and lse.dtype == torch.float32
    group = c.num_q_heads // c.num_kv_heads
    for b, n in enumerate(c.seq_lens):
        if n == 0:
            assert torch.isneginf(lse[b]).all()
            continue
        keys = naive._gather_sequence(cache.k_float, table[b], n)  # [n, Hkv, D]
        keys = keys.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[b].double(), keys.double()) * 0.125
        ref = torch.logsumexp(scores, dim=-1)
        err = (lse[b].double() - ref).abs().max().item()
        tol = 1e-4 if decode_tol(backend) == KERNEL_TOL else FP16_TOL
        assert err <= tol * max(1.0, ref.abs().max().item()), f"{case} [{backend}]: {err}"


@pytest.mark.parametrize("num_splits", [1, 2, 3, 8], ids=lambda s: f"splits-{s}")
def test_decode_triton_split_count_does_not_change_result(codec64: TQ4Codec, num_splits: int):
    cache = make_cache(codec64, 12, 1, seed=2)
    gen = torch.Generator().manual_seed(9)
    table = scattered_table(gen, 1, 12, 12)
    lens = torch.tensor([150], device=DEVICE)  # int64 accepted too
    query = torch.randn(1, 4, 64, generator=gen).to(DEVICE)
    ref = naive.paged_decode_attention_ref(query, cache.k_float, cache.v_float, table, lens,
                                           0.125)
    out = tq4_decode_attention(query, *cache.layer, table, lens, codec64, 0.125,
                               backend="triton", num_splits=num_splits)
    assert_close(f"splits {num_splits}", ref, out, decode_tol("triton"))


@pytest.mark.parametrize("chunk_blocks", [1, 3], ids=lambda c: f"chunk-{c}")
def test_torch_path_chunking_does_not_change_result(codec64: TQ4Codec, chunk_blocks: int):
    """Small chunks force many online-softmax steps (the default is one chunk here)."""
    cache = make_cache(codec64, 12, 2, seed=12, k_norms=(-1.0, 1.5))
    gen = torch.Generator().manual_seed(13)
    table = scattered_table(gen, 2, 12, 12)
    lens = torch.tensor([150, 17], dtype=torch.int32, device=DEVICE)
    query = torch.randn(2, 6, 64, generator=gen).to(DEVICE)
    ref = naive.paged_decode_attention_ref(query, cache.k_float, cache.v_float, table, lens,
                                           0.125)
    out = torch_ops.tq4_decode_attention_torch(query, *cache.layer, table, lens, codec64,
                                               0.125, chunk_blocks=chunk_blocks)
    assert_close(f"decode chunk {chunk_blocks}", ref, out, KERNEL_TOL)
    q_new = torch.randn(9, 6, 64, generator=gen).to(DEVICE)
    kv_new = torch.randn(9, 2, 64, generator=gen).to(DEVICE)
    ref = naive.extend_attention_ref(q_new, kv_new, -kv_new, cache.k_float, cache.v_float,
                                     table[0], 70, 0.125)
    out = torch_ops.tq4_extend_attention_torch(q_new, kv_new, -kv_new, *cache.layer, table[0],
                                               70, codec64, 0.125, chunk_blocks=chunk_blocks,
                                               query_chunk=4)
    assert_close(f"extend chunk {chunk_blocks}", ref, out, KERNEL_TOL)


def test_decode_auto_backend_on_this_device(codec64: TQ4Codec):
    cache = make_cache(codec64, 4, 2, seed=4)
    gen = torch.Generator().manual_seed(0)
    table = scattered_table(gen, 2, 4, 4)
    lens = torch.tensor([64, 7], dtype=torch.int32, device=DEVICE)
    query = torch.randn(2, 4, 64, generator=gen).to(DEVICE)
    ref = naive.paged_decode_attention_ref(query, cache.k_float, cache.v_float, table, lens,
                                           0.125)
    out = tq4_decode_attention(query, *cache.layer, table, lens, codec64)
    assert out.dtype == query.dtype
    assert_close("decode auto", ref, out, decode_tol("auto"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_quality_gate_vs_unquantized(codec128: TQ4Codec, backend: str):
    """TQ4 attention tracks float32 attention on the raw K/V (SPEC 1.2 gate).

    q, k, v ~ N(0, 1), d = 128 (logits of std ~1). The output is a softmax average
    of random vectors, so quantization noise does not average out relative to it:
    cosine ~0.991 overall, individual heads down to ~0.98. The gate is the overall
    cosine >= 0.99; per head >= 0.97 catches a single broken head.
    """
    gen = torch.Generator().manual_seed(11)
    num_blocks, block_size, num_kv, num_q = 32, 16, 2, 8
    num_slots = num_blocks * block_size
    key = torch.randn(num_slots, num_kv, 128, generator=gen).to(DEVICE)
    value = torch.randn(num_slots, num_kv, 128, generator=gen).to(DEVICE)
    layer = empty_layer(codec128, num_blocks, block_size, num_kv)
    slots = torch.arange(num_slots, device=DEVICE)
    quantize_into_cache(key, value, slots, *layer, codec128, backend=backend)
    table = scattered_table(gen, 4, num_blocks, 16)
    lens = torch.tensor([256, 250, 97, 180], dtype=torch.int32, device=DEVICE)
    query = torch.randn(4, num_q, 128, generator=gen).to(DEVICE)
    k_float = key.view(num_blocks, block_size, num_kv, 128)
    v_float = value.view(num_blocks, block_size, num_kv, 128)
    scale = 1 / math.sqrt(128)
    ref = naive.paged_decode_attention_ref(query, k_float, v_float, table, lens, scale)
    out = tq4_decode_attention(query, *layer, table, lens, codec128, scale, backend=backend)
    overall = torch.nn.functional.cosine_similarity(ref.flatten(), out.flatten(), dim=0)
    per_head = torch.nn.functional.cosine_similarity(ref, out, dim=-1)
    assert overall >= 0.99, f"overall cosine {overall:.4f}"
    assert per_head.min() >= 0.97, f"min per-head cosine {per_head.min():.4f}"


# ----------------------------------------------------------------- extend
EXTEND_CASES = {
    "prefix-37-new-5": (37, 5, 8, 2),
    "prefix-0-new-12": (0, 12, 4, 4),
    "prefix-16-new-1": (16, 1, 6, 2),
    "prefix-100-new-30": (100, 30, 4, 1),
}


@pytest.mark.parametrize("case", list(EXTEND_CASES), ids=list(EXTEND_CASES))
def test_extend_attention_matches_reference(codec64: TQ4Codec, case: str):
    prefix_len, num_new, num_q, num_kv = EXTEND_CASES[case]
    cache = make_cache(codec64, 10, num_kv, seed=6)
    gen = torch.Generator().manual_seed(2)
    table = scattered_table(gen, 1, 10, 8)[0]
    query = torch.randn(num_new, num_q, 64, generator=gen).to(DEVICE)
    key = torch.randn(num_new, num_kv, 64, generator=gen).to(DEVICE)
    value = torch.randn(num_new, num_kv, 64, generator=gen).to(DEVICE)
    ref = naive.extend_attention_ref(query, key, value, cache.k_float, cache.v_float, table,
                                     prefix_len, 0.125)
    out = tq4_extend_attention(query, key, value, *cache.layer, table, prefix_len, codec64,
                               0.125)
    assert_close(f"extend {case}", ref, out, KERNEL_TOL)


def test_extend_last_token_equals_decode(codec64: TQ4Codec):
    """Extending by one token whose K/V are already cached == decode over prefix + 1."""
    cache = make_cache(codec64, 6, 2, seed=8)
    gen = torch.Generator().manual_seed(3)
    table = scattered_table(gen, 1, 6, 6)
    query = torch.randn(1, 4, 64, generator=gen).to(DEVICE)
    prefix_len = 40
    slot = table[0, prefix_len // 16].long() * 16 + prefix_len % 16
    k_new = cache.k_float.view(-1, 2, 64)[slot][None]
    v_new = cache.v_float.view(-1, 2, 64)[slot][None]
    ext = tq4_extend_attention(query, k_new, v_new, *cache.layer, table[0], prefix_len, codec64)
    lens = torch.tensor([prefix_len + 1], dtype=torch.int32, device=DEVICE)
    dec = tq4_decode_attention(query, *cache.layer, table, lens, codec64, backend="torch")
    assert_close("extend vs decode", dec, ext, KERNEL_TOL)


# ----------------------------------------------------------------- bad inputs
def _decode_args(codec: TQ4Codec) -> dict:
    layer = empty_layer(codec, 4, 16, 2)
    return {
        "query": torch.zeros(1, 4, 64, device=DEVICE),
        "k_packed": layer[0], "k_norms": layer[1], "v_packed": layer[2], "v_norms": layer[3],
        "block_table": torch.zeros(1, 2, dtype=torch.int32, device=DEVICE),
        "seq_lens": torch.tensor([20], dtype=torch.int32, device=DEVICE),
        "codec": codec,
    }


BAD_DECODE = {
    "query-int": ("query", lambda a: a["query"].long(), "floating"),
    "query-2d": ("query", lambda a: a["query"][0], "shape"),
    "query-heads-not-multiple": ("query", lambda a: torch.zeros(1, 3, 64), "multiple"),
    "packed-float": ("k_packed", lambda a: a["k_packed"].float(), "uint8"),
    "packed-5d": ("k_packed", lambda a: a["k_packed"][None], "layer"),
    "packed-last-dim": ("v_packed", lambda a: a["v_packed"][..., :16], "shape"),
    "norms-half": ("k_norms", lambda a: a["k_norms"].half(), "float32"),
    "norms-shape": ("v_norms", lambda a: a["v_norms"][:, :8], "shape"),
    "table-float": ("block_table", lambda a: a["block_table"].float(), "int32"),
    "lens-shape": ("seq_lens", lambda a: a["seq_lens"].repeat(2), "shape"),
    "query-meta": ("query", lambda a: a["query"].to("meta"), "meta"),
    "packed-meta": ("k_packed", lambda a: a["k_packed"].to("meta"), "meta"),
    "seq-len-over-table": ("seq_lens", lambda a: a["seq_lens"] + 13, "does not fit"),
    "negative-seq-len": ("seq_lens", lambda a: a["seq_lens"] - 21, "does not fit"),
    "block-id-out-of-range": ("block_table", lambda a: a["block_table"] + 4, "outside"),
}


@pytest.mark.parametrize("case", list(BAD_DECODE), ids=list(BAD_DECODE))
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_rejects_bad_input(codec64: TQ4Codec, case: str, backend: str):
    field, mutate, words = BAD_DECODE[case]
    args = _decode_args(codec64)
    args[field] = mutate(args)
    with pytest.raises(CodecInputError, match=words):
        tq4_decode_attention(**args, backend=backend)


def test_decode_rejects_unknown_backend(codec64: TQ4Codec):
    with pytest.raises(ValueError, match="backend must be one of"):
        tq4_decode_attention(**_decode_args(codec64), backend="cuda")


@pytest.mark.parametrize(
    "case", ["key-int", "value-shape", "slots-float", "slot-too-large", "key-meta"]
)
def test_quantize_rejects_bad_input(codec64: TQ4Codec, case: str):
    layer = empty_layer(codec64, 2, 16, 2)
    args = {
        "key": torch.zeros(3, 2, 64, device=DEVICE),
        "value": torch.zeros(3, 2, 64, device=DEVICE),
        "slot_mapping": torch.tensor([0, 5, -1], device=DEVICE),
    }
    if case == "key-int":
        args["key"] = args["key"].int()
    elif case == "value-shape":
        args["value"] = args["value"][:, :1]
    elif case == "slots-float":
        args["slot_mapping"] = args["slot_mapping"].float()
    elif case == "slot-too-large":
        args["slot_mapping"] = torch.tensor([0, 32, 1], device=DEVICE)
    else:
        args["key"] = args["key"].to("meta")
    with pytest.raises(CodecInputError):
        quantize_into_cache(**args, k_packed=layer[0], k_norms=layer[1], v_packed=layer[2],
                            v_norms=layer[3], codec=codec64)


def test_extend_rejects_prefix_beyond_table(codec64: TQ4Codec):
    layer = empty_layer(codec64, 4, 16, 2)
    query = torch.zeros(2, 4, 64, device=DEVICE)
    kv = torch.zeros(2, 2, 64, device=DEVICE)
    table = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(CodecInputError, match="does not fit"):
        tq4_extend_attention(query, kv, kv, *layer, table, 33, codec64)


# ------------------------------------------------------------------ key offsets
def test_key_offset_changes_the_codes_but_not_the_attention() -> None:
    """Centered keys quantize better; cached + fresh scores shift alike, so softmax agrees."""
    gen = torch.Generator().manual_seed(11)
    num_heads, dim, block_size, prefix, fresh = 2, 32, 4, 10, 3
    codec = TQ4Codec(dim)
    offset = torch.randn(num_heads, dim, generator=gen) * 4  # a large shared component
    keys = torch.randn(prefix + fresh, num_heads, dim, generator=gen) * 0.5 + offset
    values = torch.randn(prefix + fresh, num_heads, dim, generator=gen)
    query = torch.randn(fresh, 2 * num_heads, dim, generator=gen)
    table = torch.tensor([2, 0, 1], dtype=torch.int32)

    def run(key_offset: torch.Tensor | None) -> torch.Tensor:
        kp = torch.zeros(3, block_size, num_heads, dim // 2, dtype=torch.uint8)
        kn = torch.zeros(3, block_size, num_heads)
        vp, vn = kp.clone(), kn.clone()
        slots = (table.long()[torch.arange(prefix) // block_size] * block_size
                 + torch.arange(prefix) % block_size)
        quantize_into_cache(keys[:prefix], values[:prefix], slots, kp, kn, vp, vn, codec,
                            backend="torch", key_offset=key_offset)
        return tq4_extend_attention(query, keys[prefix:], values[prefix:], kp, kn, vp, vn,
                                    table, prefix, codec, key_offset=key_offset)

    # Exact reference: unquantized keys, causal over prefix + fresh.
    scores = torch.einsum("thd,shd->hts", query,
                          keys.repeat_interleave(2, 1)) / dim ** 0.5
    allowed = torch.arange(prefix + fresh)[None, :] <= (prefix + torch.arange(fresh))[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    ref = torch.einsum("hts,shd->thd", probs, values.repeat_interleave(2, 1))
    cos = lambda out: torch.nn.functional.cosine_similarity(
        out.flatten(1), ref.flatten(1), dim=-1).mean().item()
    centered, plain = run(offset), run(None)
    assert cos(centered) > cos(plain)  # centering spends the bits on what differs
    assert cos(centered) > 0.995
    with pytest.raises(CodecInputError, match="key_offset"):
        run(offset[:1])
