"""Block formats tq4/k5v4/int8/fp16/native: layouts, bytes, error bounds, key offsets, refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gpu_cache import (
    TENSOR_NAMES,
    CacheConfig,
    CacheIdentity,
    CacheIdentityError,
    CodecInputError,
    Tier,
    TQ4Encoded,
    TQGPUCache,
)
from gpu_cache.calibration import key_offset_digest
from gpu_cache.formats import (
    FORMATS,
    PRECISION_RANK,
    bytes_per_token_head,
    check_format,
    decode_blocks,
    encode_into,
    tensor_specs,
)
from gpu_cache.identity import CODECS
from gpu_cache.kernels import quantize_into_cache

L, H, D, BS = 2, 2, 64, 16
BASE = CacheIdentity(model_id="test/formats", num_layers=L, num_kv_heads=H, head_dim=D,
                     block_size=BS, rotation_seed=5)
NUM_BLOCKS = 4


def _cache(fmt: str, offsets: torch.Tensor | None = None) -> TQGPUCache:
    ident = replace(BASE, codec=fmt, key_offset_digest=key_offset_digest(offsets))
    return TQGPUCache(ident, CacheConfig(num_device_blocks=NUM_BLOCKS, num_host_blocks=8,
                                         device="cpu"), key_offsets=offsets)


def _kv(kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[L, NUM_BLOCKS * BS, H, D]`` K/V: plain Gaussian, or keys with a large per-head mean."""
    gen = torch.Generator().manual_seed(seed)
    shape = (L, NUM_BLOCKS * BS, H, D)
    k = torch.randn(shape, generator=gen)
    v = torch.randn(shape, generator=gen)
    if kind == "key-like":  # post-RoPE keys: a big shared component per head, outliers
        mean = torch.randn((L, 1, H, D), generator=gen) * 6
        k = k + mean
        k[..., 3] *= 8
    return k, v


def _round_trip(cache: TQGPUCache, k: torch.Tensor, v: torch.Tensor, tier: Tier = Tier.DEVICE
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode into NUM_BLOCKS fresh blocks of ``tier`` and decode them: ``[L, n, BS, H, D]``."""
    ids = cache.allocate(NUM_BLOCKS, tier)
    assert ids is not None
    slots = torch.tensor([cache.metadata.get(b).slot for b in ids])
    token_slots = (slots[:, None] * BS + torch.arange(BS)).reshape(-1)
    fmt = cache.identity.codec
    for layer in range(L):
        encode_into(fmt, k[layer], v[layer], token_slots, cache.layer_view(layer, tier),
                    cache.codec, cache.key_offset(layer))
    return decode_blocks(fmt, cache.export_blocks(ids), cache.codec, cache.key_offsets)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(L, NUM_BLOCKS, BS, H, D)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def test_formats_precision_order_and_identity_codecs():
    assert FORMATS == ("tq4", "k5v4", "int8", "fp16", "native") == CODECS
    assert sorted(FORMATS, key=PRECISION_RANK.__getitem__) == list(FORMATS)
    assert [PRECISION_RANK[f] for f in FORMATS] == [0, 1, 2, 3, 4]
    for fmt in FORMATS:
        assert check_format(fmt) == fmt


@pytest.mark.parametrize("bad", ["tq3", "TQ4", "", None, 4, ["int8"]])
def test_unknown_formats_are_refused_in_one_line(bad):
    with pytest.raises(CodecInputError) as info:
        check_format(bad)
    message = str(info.value)
    assert "\n" not in message and "use one of tq4, k5v4, int8, fp16, native" in message
    assert isinstance(info.value, ValueError)


def test_an_identity_with_codec_tq3_is_refused_in_one_line():
    with pytest.raises(CacheIdentityError) as direct:
        replace(BASE, codec="tq3")
    with pytest.raises(CacheIdentityError) as parsed:
        CacheIdentity.from_dict({**BASE.to_dict(), "codec": "tq3"})
    for err in (direct.value, parsed.value):
        message = str(err)
        assert "\n" not in message and "'tq3'" in message
        assert "('tq4', 'k5v4', 'int8', 'fp16', 'native')" in message
    assert "discard" in str(parsed.value)


@pytest.mark.parametrize(("fmt", "per_head", "vec_dtype", "norms"), [
    ("tq4", 36, torch.uint8, (H,)),
    ("k5v4", 40, torch.uint8, (H,)),
    ("int8", 68, torch.int8, (H,)),
    ("fp16", 128, torch.float16, (0,)),
    ("native", 256, torch.float32, (0,)),
])
def test_layout_and_bytes_per_format(fmt, per_head, vec_dtype, norms):
    assert bytes_per_token_head(fmt, D) == per_head
    ident = replace(BASE, codec=fmt)
    specs = tensor_specs(ident)
    widths = {"tq4": (D // 2, D // 2), "k5v4": (D * 5 // 8, D // 2)}.get(fmt, (D, D))
    assert specs == {"k_packed": ((H, widths[0]), vec_dtype), "k_norms": (norms, torch.float32),
                     "v_packed": ((H, widths[1]), vec_dtype), "v_norms": (norms, torch.float32)}
    # K and V together: what a block's bytes are made of
    assert sum(w + 4 for w in widths) == 2 * per_head or fmt not in ("tq4", "k5v4")
    assert ident.bytes_per_block == 2 * L * BS * H * per_head
    cache = _cache(fmt)
    assert cache.bytes_per_token == 2 * L * H * per_head
    for tier in Tier:
        storage = cache.storage(tier)
        for name, t in zip(TENSOR_NAMES, storage.tensors(), strict=True):
            assert tuple(t.shape) == (L, storage.num_blocks, BS, *specs[name][0])
            assert t.dtype == specs[name][1]
        assert storage.nbytes == storage.num_blocks * ident.bytes_per_block


def test_fp16_relative_to_native_and_tq4_bytes():
    fp16 = bytes_per_token_head("fp16", D)
    assert bytes_per_token_head("native", D) == 2 * fp16
    assert bytes_per_token_head("tq4", D) / fp16 == pytest.approx(0.28125)
    assert bytes_per_token_head("int8", D) / fp16 == pytest.approx(0.53125)
    assert bytes_per_token_head("k5v4", D) / fp16 == pytest.approx(0.3125)


def test_k5v4_needs_a_head_dim_divisible_by_16():
    with pytest.raises(CacheIdentityError, match="divisible by 16"):
        replace(BASE, head_dim=72, codec="k5v4")
    with pytest.raises(CodecInputError, match="use tq4"):
        bytes_per_token_head("k5v4", 72)
    assert bytes_per_token_head("tq4", 72) == 40


def test_k5v4_keys_are_five_bit_codes_and_its_values_are_tq4_bytes():
    """Keys: the 5-bit codebook's nearest centroid per rotated coordinate, in a nibble
    plane and a fifth-bit plane, with tq4's length correction; values: tq4's bytes."""
    from gpu_cache.codebook import lloyd_max_codebook

    k, v = _kv("key-like", seed=4)
    mixed, tq4 = _cache("k5v4"), _cache("tq4")
    got_k, got_v = _round_trip(mixed, k, v)
    _, tq4_v = _round_trip(tq4, k, v)
    assert torch.equal(got_v, tq4_v)
    ids = [m.block_id for m in sorted(mixed.metadata.all(), key=lambda m: m.slot)]
    exported = mixed.export_blocks(ids)
    book = lloyd_max_codebook(D, 5)
    centroids = torch.tensor(book.centroids, dtype=torch.float32)
    kb = _blocks(k)
    unit = mixed.codec.rotate(kb / kb.norm(dim=-1, keepdim=True))
    want_idx = (unit[..., None] - centroids).abs().argmin(dim=-1)
    packed = exported["k_packed"]
    low = torch.cat([packed[..., : D // 2] & 0xF, packed[..., : D // 2] >> 4], dim=-1).long()
    high = torch.stack([(packed[..., D // 2:] >> j) & 1 for j in range(8)], dim=-1)
    idx = low | (high.reshape(*packed.shape[:-1], D).long() << 4)
    assert float((idx == want_idx).float().mean()) > 0.999  # ties at a boundary aside
    recon = centroids[idx]
    scale = kb.norm(dim=-1) / recon.norm(dim=-1)
    assert torch.allclose(exported["k_norms"], scale, rtol=1e-5)
    assert torch.allclose(got_k, mixed.codec.unrotate(recon * scale[..., None]), atol=1e-5)


@pytest.mark.parametrize("kind", ["random", "key-like"])
def test_error_bounds_per_format(kind):
    k, v = _kv(kind)
    kb, vb = _blocks(k), _blocks(v)
    native_k, native_v = _round_trip(_cache("native"), k, v)
    assert torch.equal(native_k, kb) and torch.equal(native_v, vb)
    fp16_k, fp16_v = _round_trip(_cache("fp16"), k, v)
    assert torch.equal(fp16_k, kb.half().float()) and torch.equal(fp16_v, vb.half().float())
    int8_k, int8_v = _round_trip(_cache("int8"), k, v)
    assert _rel(int8_k, kb) < 1e-2 and _rel(int8_v, vb) < 1e-2
    # worst single vector stays within twice the bound
    per_vec = (int8_k - kb).norm(dim=-1) / kb.norm(dim=-1)
    assert float(per_vec.max()) < 2e-2
    # tq4 is what the connector always stored: quantize_into_cache's bytes, unchanged
    cache = _cache("tq4")
    tq4_k, tq4_v = _round_trip(cache, k, v)
    before = _cache("tq4")
    ids = before.allocate(NUM_BLOCKS, Tier.DEVICE)
    assert ids is not None
    token_slots = torch.arange(NUM_BLOCKS * BS)
    for layer in range(L):
        view = before.layer_view(layer)
        quantize_into_cache(k[layer], v[layer], token_slots, view.k_packed, view.k_norms,
                            view.v_packed, view.v_norms, before.codec, check_bounds=False)
    old = before.export_blocks(ids)
    now = cache.export_blocks([m.block_id for m in sorted(cache.metadata.all(),
                                                            key=lambda m: m.slot)])
    assert all(torch.equal(old[n], now[n]) for n in TENSOR_NAMES)
    assert torch.equal(tq4_k, before.codec.decode(TQ4Encoded(old["k_packed"], old["k_norms"])))
    assert _rel(tq4_v, vb) < 0.12
    # k5v4: one more bit on the keys roughly halves their error; values stay tq4's
    k5_k, k5_v = _round_trip(_cache("k5v4"), k, v)
    assert _rel(k5_k, kb) < 0.6 * _rel(tq4_k, kb) and torch.equal(k5_v, tq4_v)
    # precision order holds on these vectors
    errors = [_rel(x, kb) for x in (tq4_k, k5_k, int8_k, fp16_k, native_k)]
    assert errors == sorted(errors, reverse=True) and errors[-1] == 0.0


def test_int8_bytes_are_rotated_absmax_codes():
    k, v = _kv("random", seed=3)
    cache = _cache("int8")
    ids = cache.allocate(NUM_BLOCKS, Tier.DEVICE)
    assert ids is not None
    slots = torch.tensor([cache.metadata.get(b).slot for b in ids])
    token_slots = (slots[:, None] * BS + torch.arange(BS)).reshape(-1)
    encode_into("int8", k[0], v[0], token_slots, cache.layer_view(0), cache.codec)
    exported = cache.export_blocks(ids)
    r = cache.codec.rotate(_blocks(k)[0])
    scale = r.abs().amax(dim=-1) / 127
    assert torch.allclose(exported["k_norms"][0], scale)
    q = exported["k_packed"][0].float()
    assert float(q.abs().amax()) == 127.0
    assert torch.equal(q, torch.round(r / scale.unsqueeze(-1)))


def test_zero_vectors_encode_to_zero():
    cache = _cache("int8")
    k = torch.zeros(L, NUM_BLOCKS * BS, H, D)
    got_k, got_v = _round_trip(cache, k, k.clone())
    assert torch.equal(got_k, torch.zeros_like(got_k)) and torch.equal(got_v, got_k)


@pytest.mark.parametrize("fmt", FORMATS)
def test_key_offsets_are_applied_on_encode_and_removed_on_decode(fmt):
    k, v = _kv("key-like", seed=1)
    offsets = k.mean(dim=1)  # [L, H, D]
    cache = _cache(fmt, offsets)
    got_k, got_v = _round_trip(cache, k, v)
    kb = _blocks(k)
    # the stored keys are the centred ones
    ids = [m.block_id for m in sorted(cache.metadata.all(), key=lambda m: m.slot)]
    stored_k, _ = decode_blocks(fmt, cache.export_blocks(ids), cache.codec)
    centred = kb - offsets[:, None, None]
    if fmt == "native":
        assert torch.equal(stored_k, centred) and torch.allclose(got_k, kb, atol=1e-5)
    elif fmt == "fp16":
        assert torch.equal(stored_k, centred.half().float())
    else:
        assert _rel(stored_k, centred) < {"int8": 1e-2, "k5v4": 0.06}.get(fmt, 0.12)
    # added back on decode: the keys come back as keys
    assert torch.allclose(got_k, stored_k + offsets[:, None, None])
    assert _rel(got_k, kb) < _rel(stored_k, kb)
    # centring spends the bits on what differs between tokens: smaller absolute error
    if fmt in ("tq4", "k5v4", "int8"):
        plain_k, _ = _round_trip(_cache(fmt), k, v)
        assert (got_k - kb).norm() < 0.5 * (plain_k - kb).norm()
    _, plain_v = _round_trip(_cache(fmt), k, v)
    assert torch.equal(got_v, plain_v)  # values are never offset


@pytest.mark.parametrize("fmt", ["k5v4", "int8", "fp16", "native"])
def test_negative_slots_are_skipped(fmt):
    cache = _cache(fmt)
    view = cache.layer_view(0)
    k = torch.ones(3, H, D) * 2
    slots = torch.tensor([0, -1, 5])
    encode_into(fmt, k, k.clone(), slots, view, cache.codec)
    exported = cache.export_blocks([])
    assert exported["k_packed"].shape[1] == 0
    flat = view.k_packed.reshape(-1, H, view.k_packed.shape[-1]).float()
    assert flat[[0, 5]].abs().sum() > 0
    assert flat[1:5].abs().sum() == 0 and flat[6:].abs().sum() == 0


@pytest.mark.parametrize("fmt", ["k5v4", "int8", "fp16", "native"])
def test_slots_beyond_the_cache_are_refused_when_checked(fmt):
    cache = _cache(fmt)
    k = torch.ones(1, H, D)
    with pytest.raises(CodecInputError, match="use -1 to skip a token"):
        encode_into(fmt, k, k, torch.tensor([NUM_BLOCKS * BS]), cache.layer_view(0),
                    cache.codec, check_bounds=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_wrong_shapes_are_refused_in_one_line(fmt):
    cache = _cache(fmt)
    view = cache.layer_view(0)
    slots = torch.arange(4)
    with pytest.raises(CodecInputError) as info:
        encode_into(fmt, torch.ones(4, H, D + 2), torch.ones(4, H, D + 2), slots, view,
                    cache.codec)
    assert "\n" not in str(info.value)
    with pytest.raises(CodecInputError, match="key_offset"):
        encode_into(fmt, torch.ones(4, H, D), torch.ones(4, H, D), slots, view, cache.codec,
                    key_offset=torch.zeros(H + 1, D))


def test_a_view_or_export_of_another_format_is_refused():
    int8 = _cache("int8")
    with pytest.raises(CodecInputError, match="format fp16"):
        encode_into("fp16", torch.ones(1, H, D), torch.ones(1, H, D), torch.tensor([0]),
                    int8.layer_view(0), int8.codec)
    exported = int8.export_blocks([])
    with pytest.raises(CodecInputError, match="another format"):
        decode_blocks("native", exported, int8.codec)
    with pytest.raises(CodecInputError, match="another format"):
        decode_blocks("k5v4", _cache("tq4").export_blocks([]), int8.codec)
    k5v4 = _cache("k5v4")
    with pytest.raises(CodecInputError, match=r"format tq4|format k5v4"):
        encode_into("k5v4", torch.ones(1, H, D), torch.ones(1, H, D), torch.tensor([0]),
                    _cache("tq4").layer_view(0), k5v4.codec)
    with pytest.raises(CodecInputError, match="unknown KV format 'tq3'"):
        decode_blocks("tq3", exported, int8.codec)


def test_tq4_decode_is_the_codec_decode_of_exported_bytes():
    cache = _cache("tq4")
    k, v = _kv("random", seed=7)
    got_k, _ = _round_trip(cache, k, v, tier=Tier.HOST)
    ids = [m.block_id for m in sorted(cache.metadata.all(), key=lambda m: m.slot)]
    exported = cache.export_blocks(ids)
    want = cache.codec.decode(TQ4Encoded(exported["k_packed"], exported["k_norms"]))
    assert torch.equal(got_k, want)


def test_k5v4_fused_cpu_keys_match_the_torch_path():
    """The numba kernels (many vectors) and the torch path (few, or cpu_kernels=False)
    write the same 5-bit codes and decode them alike."""
    from gpu_cache import formats
    from gpu_cache.codec import TQ4Codec
    from gpu_cache.kernels import cpu_fused

    if not cpu_fused.available():
        pytest.fail("numba is part of the default install; the fused CPU path must be available")
    fused, plain = TQ4Codec(D, seed=2), TQ4Codec(D, seed=2, cpu_kernels=False)
    x = torch.randn(4096, H, D, generator=torch.Generator().manual_seed(6))
    x = x * torch.logspace(-2, 2, 4096)[:, None, None]
    x[7] = 0.0  # a zero vector stays zero on both paths
    assert fused.fused_cpu(x.device, x.numel() // D) and not plain.fused_cpu(x.device, 10 ** 6)
    pa, na = formats._tq5_encode(x, fused)
    pb, nb = formats._tq5_encode(x, plain)
    assert pa.shape == pb.shape == (4096, H, D * 5 // 8)
    # only a coordinate within float rounding of a boundary may land on the other side
    assert float((pa != pb).float().mean()) < 1e-4
    assert torch.allclose(na, nb, rtol=1e-3) and float(na[7].abs().sum()) == 0.0
    assert torch.allclose(formats._tq5_decode(pa, na, fused), formats._tq5_decode(pa, na, plain),
                          rtol=1e-4, atol=1e-4)
    assert float(formats._tq5_decode(pa, na, fused)[7].abs().sum()) == 0.0


def _paged(fmt: str, num_blocks: int, offsets: torch.Tensor | None
           ) -> tuple[TQGPUCache, list[int], torch.Tensor]:
    """A host-tier cache of ``fmt`` holding ``num_blocks`` key-like blocks; their ids."""
    ident = replace(BASE, codec=fmt, key_offset_digest=key_offset_digest(offsets))
    cache = TQGPUCache(ident, CacheConfig(num_device_blocks=1, num_host_blocks=num_blocks,
                                          device="cpu"), key_offsets=offsets)
    ids = cache.allocate(num_blocks, Tier.HOST)
    assert ids is not None
    gen = torch.Generator().manual_seed(11)
    k = torch.randn(L, num_blocks * BS, H, D, generator=gen) * 2 + 5
    v = torch.randn(L, num_blocks * BS, H, D, generator=gen)
    slots = torch.tensor([cache.metadata.get(b).slot for b in ids])
    token_slots = (slots[:, None] * BS + torch.arange(BS)).reshape(-1)
    for layer in range(L):
        encode_into(fmt, k[layer], v[layer], token_slots, cache.layer_view(layer, Tier.HOST),
                    cache.codec, cache.key_offset(layer))
    return cache, ids, k


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", ["fused", "torch", "bf16"])
@pytest.mark.parametrize("with_offsets", [False, True])
def test_decode_layer_into_pages_equals_decode_blocks_then_copy(fmt, path, with_offsets):
    """Decoding straight into paged rows (vLLM's CPU page: keys in rows 0..BS-1 of each
    (block, head), values in BS..2BS-1) writes exactly what decode_blocks gives, at the
    pages named, and nothing else."""
    from gpu_cache import formats
    from gpu_cache.codec import TQ4Codec
    from gpu_cache.kernels import cpu_fused

    n = 12  # 12 * BS * H = 384 token-heads per side and layer: the fused kernels' size
    offsets = torch.randn(L, H, D, generator=torch.Generator().manual_seed(3)) * 4
    cache, ids, _ = _paged(fmt, n, offsets if with_offsets else None)
    exported = cache.export_blocks(ids)
    codec = cache.codec
    if path == "torch":
        codec = TQ4Codec(D, seed=BASE.rotation_seed, cpu_kernels=False)
    elif fmt in ("tq4", "k5v4", "int8"):
        assert cpu_fused.available() and codec.fused_cpu(torch.device("cpu"), n * BS * H)
    want_k, want_v = decode_blocks(fmt, exported, cache.codec, cache.key_offsets)
    pages_of = [3 * i % 17 + 1 for i in range(n)]  # out of order, gaps, never page 0
    page = torch.tensor(pages_of)[:, None, None]
    head = torch.arange(H)[None, None, :]
    token = torch.arange(BS)[None, :, None]
    k_rows = ((page * H + head) * 2 * BS + token).reshape(-1)
    v_rows = k_rows + BS
    dtype = torch.bfloat16 if path == "bf16" else torch.float32
    for layer in range(L):
        pages = torch.zeros(19, H, 2 * BS, D, dtype=dtype)
        formats.decode_layer_into(fmt, exported, layer, codec, pages.view(-1, D), k_rows,
                                  v_rows, cache.key_offsets)
        got = pages[torch.tensor(pages_of)]  # [n, H, 2BS, D]
        got_k, got_v = got[:, :, :BS].transpose(1, 2), got[:, :, BS:].transpose(1, 2)
        tol = {"rtol": 1e-2, "atol": 3e-2} if path == "bf16" else {"rtol": 1e-4, "atol": 1e-4}
        assert torch.allclose(got_k.float(), want_k[layer], **tol)
        assert torch.allclose(got_v.float(), want_v[layer], **tol)
        untouched = torch.ones(19, dtype=torch.bool)
        untouched[torch.tensor(pages_of)] = False
        assert float(pages[untouched].abs().sum()) == 0.0


def test_decode_layer_into_refuses_rows_of_the_wrong_length_in_one_line():
    from gpu_cache import formats

    cache, ids, _ = _paged("tq4", 2, None)
    out = torch.zeros(100 * H * 2 * BS, D)
    rows = torch.arange(2 * BS * H)
    with pytest.raises(CodecInputError, match=r"k_rows must be int64 \[64\]") as info:
        formats.decode_layer_into("tq4", cache.export_blocks(ids), 0, cache.codec, out,
                                  rows[:-1], rows)
    assert "\n" not in str(info.value)
    with pytest.raises(CodecInputError, match=r"out must be \[num_rows, D=64\]"):
        formats.decode_layer_into("tq4", cache.export_blocks(ids), 0, cache.codec,
                                  out.view(-1, D // 2), rows, rows)
