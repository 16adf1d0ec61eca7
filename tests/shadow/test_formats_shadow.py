"""Shadows of caches in every block format: shapes, round trips, unknown formats refused."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from shadow_testkit import BUCKET, KEY

from gpu_cache import (
    TENSOR_NAMES,
    CacheConfig,
    CacheIdentity,
    CacheIdentityError,
    Tier,
    TQGPUCache,
)
from gpu_cache.calibration import key_offset_digest
from gpu_cache.formats import FORMATS, decode_blocks, encode_into, tensor_specs
from shadow import (
    CacheShadow,
    CorruptShadowError,
    ShadowConfig,
    StoreConfig,
    discover_sessions,
    open_store,
    recover_session,
    recover_sessions,
)
from shadow.manifest import Manifest, block_dtypes, block_nbytes, block_shapes, manifest_key
from shadow.stores import S3_MIN_PART_BYTES

BASE = CacheIdentity(model_id="test/formats", num_layers=2, num_kv_heads=2, head_dim=16,
                     block_size=4, rotation_seed=3)
MANUAL = ShadowConfig(autostart=False)
NUM_BLOCKS = 6


def _cache(identity: CacheIdentity, offsets: torch.Tensor | None = None) -> TQGPUCache:
    return TQGPUCache(identity, CacheConfig(num_device_blocks=8, num_host_blocks=32,
                                            device="cpu"), key_offsets=offsets)


def _fill(cache: TQGPUCache, *, seed: int = 0) -> list[int]:
    """NUM_BLOCKS keyed, labelled blocks encoded from key-like K/V in the cache's format."""
    ident = cache.identity
    gen = torch.Generator().manual_seed(seed)
    shape = (ident.num_layers, NUM_BLOCKS * ident.block_size, ident.num_kv_heads,
             ident.head_dim)
    k = torch.randn(shape, generator=gen) * 2 + 5  # keys share a large mean
    v = torch.randn(shape, generator=gen)
    tokens = [(seed * 131 + i * 17) % 50000 for i in range(shape[1])]
    keys = cache.block_keys(tokens, "acme")
    ids = cache.allocate(NUM_BLOCKS, Tier.HOST, tenant="acme")
    assert ids is not None
    bs = ident.block_size
    slots = torch.tensor([cache.metadata.get(b).slot for b in ids])
    token_slots = (slots[:, None] * bs + torch.arange(bs)).reshape(-1)
    for layer in range(ident.num_layers):
        encode_into(ident.codec, k[layer], v[layer], token_slots,
                    cache.layer_view(layer, Tier.HOST), cache.codec, cache.key_offset(layer))
    for i, bid in enumerate(ids):
        cache.metadata.annotate(bid, source_layer="memories", importance=0.5,
                                token_range=(i * bs, i * bs + bs), tenant_slug="acme",
                                num_tokens=bs)
        cache.set_key(bid, keys[i])
    return ids


def _by_key(cache: TQGPUCache) -> dict[bytes, dict[str, torch.Tensor]]:
    metas = [m for m in cache.metadata.all() if m.key is not None]
    exported = cache.export_blocks([m.block_id for m in metas])
    return {m.key: {n: exported[n][:, i].contiguous() for n in TENSOR_NAMES}
            for i, m in enumerate(metas)}


def _assert_same_bytes(a: TQGPUCache, b: TQGPUCache) -> None:
    ea, eb = _by_key(a), _by_key(b)
    assert len(ea) == NUM_BLOCKS and ea.keys() == eb.keys()
    for key in ea:
        for name in TENSOR_NAMES:
            assert ea[key][name].dtype == eb[key][name].dtype
            assert torch.equal(ea[key][name], eb[key][name]), name


def _decoded(cache: TQGPUCache) -> tuple[torch.Tensor, torch.Tensor]:
    metas = sorted((m for m in cache.metadata.all() if m.key is not None),
                   key=lambda m: m.token_range)
    return decode_blocks(cache.identity.codec, cache.export_blocks([m.block_id for m in metas]),
                         cache.codec, cache.key_offsets)


@pytest.mark.parametrize("fmt", FORMATS)
def test_block_shapes_and_dtypes_follow_the_format(fmt):
    ident = replace(BASE, codec=fmt)
    specs = tensor_specs(ident)
    shapes, dtypes = block_shapes(ident), block_dtypes(ident)
    cache = _cache(ident)
    exported = cache.export_blocks(_fill(cache)[:1], block_major=True)
    nbytes = block_nbytes(ident)
    for name in TENSOR_NAMES:
        lead = (ident.num_layers, ident.block_size)
        assert shapes[name] == (*lead, *specs[name][0])
        assert tuple(exported[name].shape[1:]) == shapes[name]
        assert exported[name].numpy().dtype == np.dtype(dtypes[name])
        assert nbytes[name] == exported[name][0].numel() * exported[name].element_size()
    assert sum(nbytes.values()) == ident.bytes_per_block


@pytest.mark.parametrize("fmt", FORMATS)
def test_shadow_round_trip_per_format_is_bit_exact(fmt, store_url):
    ident = replace(BASE, codec=fmt)
    src = _cache(ident)
    _fill(src)
    with CacheShadow(src, store_url, f"sess-{fmt}", config=MANUAL) as sh:
        result = sh.shadow_now()
    assert result.blocks_written == NUM_BLOCKS
    store = open_store(store_url)
    doc = json.loads(store.get(manifest_key(f"sess-{fmt}")))
    assert doc["identity"]["codec"] == fmt
    assert {n: t["dtype"] for n, t in doc["tensors"].items()} == {
        n: np.dtype(d).name for n, d in block_dtypes(ident).items()}
    dst = _cache(ident)
    report = recover_session(store, f"sess-{fmt}", dst)
    assert report.blocks == NUM_BLOCKS and not report.skipped
    _assert_same_bytes(src, dst)
    k_src, v_src = _decoded(src)
    k_dst, v_dst = _decoded(dst)
    assert torch.equal(k_src, k_dst) and torch.equal(v_src, v_dst)


@pytest.mark.parametrize("fmt", ["int8", "tq4"])
def test_shadow_with_key_offsets_recovers_keys(fmt, store_url):
    torch.manual_seed(1)
    offsets = torch.randn(BASE.num_layers, BASE.num_kv_heads, BASE.head_dim) + 5
    ident = replace(BASE, codec=fmt, key_offset_digest=key_offset_digest(offsets))
    src = _cache(ident, offsets)
    _fill(src, seed=4)
    with CacheShadow(src, store_url, "offsets", config=MANUAL) as sh:
        sh.shadow_now()
    store = open_store(store_url)
    manifest = Manifest.from_json(store.get(manifest_key("offsets")))
    restored = manifest.key_offsets_tensor()
    assert restored is not None and torch.equal(restored, offsets)
    dst = _cache(manifest.identity, restored)
    assert recover_session(store, "offsets", dst).blocks == NUM_BLOCKS
    _assert_same_bytes(src, dst)
    assert all(torch.equal(a, b) for a, b in zip(_decoded(src), _decoded(dst), strict=True))


def test_mixed_format_sessions_in_one_store_each_recover_into_their_format(store_url):
    torch.manual_seed(2)
    offsets = torch.randn(BASE.num_layers, BASE.num_kv_heads, BASE.head_dim) * 3
    sources = {
        "pool-tq4": _cache(BASE),
        "pool-int8": _cache(replace(BASE, codec="int8",
                                    key_offset_digest=key_offset_digest(offsets)), offsets),
        "pool-fp16": _cache(replace(BASE, codec="fp16")),
        "pool-native": _cache(replace(BASE, codec="native")),
    }
    for seed, (sid, cache) in enumerate(sources.items()):
        _fill(cache, seed=seed)
        with CacheShadow(cache, store_url, sid, config=MANUAL) as sh:
            sh.shadow_now()
    store = open_store(store_url)
    infos = {i.session_id: i for i in discover_sessions(store)}
    assert set(infos) == set(sources) and not any(i.error for i in infos.values())
    for sid, src in sources.items():
        manifest = Manifest.from_json(store.get(manifest_key(sid)))
        assert manifest.identity == src.identity
        assert manifest.bytes_per_block == src.identity.bytes_per_block
        dst = _cache(manifest.identity, manifest.key_offsets_tensor())
        report = recover_sessions(store, dst)  # every session; the others are refused
        assert report.sessions == [sid] and report.blocks == NUM_BLOCKS
        assert set(report.errors) == set(sources) - {sid}
        assert all("different cache identity" in e and "\n" not in e
                   for e in report.errors.values())
        _assert_same_bytes(src, dst)
        assert all(torch.equal(a, b) for a, b in zip(_decoded(src), _decoded(dst), strict=True))


def test_caches_of_other_formats_are_refused_by_identity(store_url):
    src = _cache(replace(BASE, codec="int8"))
    _fill(src)
    with CacheShadow(src, store_url, "int8-sess", config=MANUAL) as sh:
        sh.shadow_now()
    dst = _cache(replace(BASE, codec="fp16"))
    with pytest.raises(CacheIdentityError, match="codec: expected 'fp16', got 'int8'"):
        recover_session(open_store(store_url), "int8-sess", dst)


def test_shadow_of_an_unknown_format_is_refused_in_one_line(store_url):
    src = _cache(replace(BASE, codec="int8"))
    _fill(src)
    with CacheShadow(src, store_url, "future", config=MANUAL) as sh:
        sh.shadow_now()
    store = open_store(store_url)
    doc = json.loads(store.get(manifest_key("future")))
    doc["identity"]["codec"] = "tq3"  # written by a newer contextkit
    store.put(manifest_key("future"), json.dumps(doc).encode())
    with pytest.raises(CorruptShadowError) as info:
        recover_session(store, "future", _cache(replace(BASE, codec="int8")))
    message = str(info.value)
    assert "\n" not in message
    assert "format 'tq3'" in message and "tq4, k5v4, int8, fp16, native" in message
    assert "upgrade contextkit" in message
    [listed] = discover_sessions(store)
    assert listed.session_id == "future" and "'tq3'" in (listed.error or "")


def test_fp16_shadow_round_trip_over_s3(s3_endpoint, request):
    config = StoreConfig(endpoint_url=s3_endpoint, multipart_threshold=S3_MIN_PART_BYTES,
                         multipart_chunksize=S3_MIN_PART_BYTES)
    prefix = f"s3://{BUCKET}/{request.node.name}"
    ident = replace(BASE, codec="fp16")
    src = _cache(ident)
    _fill(src, seed=9)
    with CacheShadow(src, open_store(prefix, config), "chat-fp16",
                     config=ShadowConfig(autostart=False, auth_key=KEY)) as sh:
        sh.shadow_now()
    dst = _cache(ident)
    report = recover_session(open_store(prefix, config), "chat-fp16", dst, key=KEY)
    assert report.blocks == NUM_BLOCKS and not report.skipped
    _assert_same_bytes(src, dst)
