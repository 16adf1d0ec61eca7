"""Shadow and recovery against a local directory (file://)."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from shadow_testkit import (
    MEDIUM,
    SMALL,
    add_blocks,
    add_prefix,
    exported_by_key,
    make_cache,
    segment_blob,
)

import shadow
from gpu_cache import TENSOR_NAMES, CacheIdentity, CacheIdentityError, PrefixPinManager, Tier
from gpu_cache.codec import TQ4Encoded
from shadow import (
    CacheShadow,
    InvalidSessionIdError,
    LocalStore,
    MeteredStore,
    ShadowConfig,
    open_store,
    recover_session,
    recover_sessions,
    validate_session_id,
)

MANUAL = ShadowConfig(autostart=False)


def test_exports_are_what_they_should_be():
    assert sorted(shadow.__all__) == sorted(
        ["STORES", "BlobNotFoundError", "BlobTooLargeError", "BlobWriter", "BlockRecord",
         "CacheShadow",
         "CorruptShadowError", "InvalidSessionIdError", "LocalStore", "Manifest",
         "MeteredStore", "RecoveryReport", "S3Store", "SegmentRecord", "SessionInfo",
         "ShadowConfig", "ShadowError", "ShadowResult", "ShadowStore", "ShadowStoreError",
         "SkippedBlock", "StoreConfig", "discover_sessions", "load_manifest", "open_store",
         "recover_session", "recover_sessions", "validate_session_id", "KEY_ENV",
         "TamperedShadowError", "UnauthenticatedShadowError", "describe_auth", "resolve_key",
         "InvalidKeyError", "RollbackShadowError"])
    for name in shadow.__all__:
        assert getattr(shadow, name) is not None


def test_layout_and_manifest_fields(store_url, tmp_path):
    cache = make_cache()
    pins = add_prefix(cache, 3)
    PrefixPinManager(cache).pin(pins)
    add_blocks(cache, range(5))
    with CacheShadow(cache, store_url, "sess-1", config=MANUAL) as sh:
        sh.shadow_now()
    root = tmp_path / "shadow"
    doc = json.loads((root / "sess-1" / "manifest.json").read_bytes())
    [segment] = doc["segments"]
    token = segment["files"]["k_packed"].split("-")[-1].split(".")[0]  # the names carry it
    assert len(token) == 16
    assert sorted(os.listdir(root / "sess-1")) == sorted(
        ["manifest.json", "head.json",
         *(f"seg-000000-{token}.{n}.bin" for n in TENSOR_NAMES)])
    assert (root / "index.json").exists()
    doc = json.loads((root / "sess-1" / "manifest.json").read_bytes())
    assert CacheIdentity.from_dict(doc["identity"]) == SMALL
    assert doc["identity"]["schema_version"] == SMALL.schema_version
    assert len(doc["blocks"]) == 8
    per = {n: doc["tensors"][n]["block_bytes"] for n in TENSOR_NAMES}
    assert sum(per.values()) == cache.bytes_per_block
    first = doc["blocks"][0]
    assert first["source_layer"] == "axioms" and first["pinned"] is True
    assert set(first["checksums"]) == set(TENSOR_NAMES)
    assert [b["offsets"]["k_packed"] for b in doc["blocks"]] == [i * per["k_packed"]
                                                                  for i in range(8)]
    assert segment_blob(root, "sess-1", "k_packed").stat().st_size == 8 * per["k_packed"]
    index = json.loads((root / "index.json").read_bytes())
    assert index["sessions"]["sess-1"]["num_blocks"] == 8


def test_round_trip_is_bit_exact_and_attention_matches(store_url):
    src = make_cache()
    prefix = add_prefix(src, 4, tenant="acme")
    PrefixPinManager(src).pin(prefix)
    add_blocks(src, range(40), tenant="acme")
    with CacheShadow(src, store_url, "rt", config=MANUAL) as sh:
        sh.shadow_now()

    dst = make_cache()
    report = recover_session(open_store(store_url), "rt", dst)
    assert report.blocks == 44 and not report.skipped and report.pinned == 4
    assert report.bytes == 44 * src.bytes_per_block

    a, b = exported_by_key(src), exported_by_key(dst)
    assert a.keys() == b.keys()
    for key in a:
        for name in TENSOR_NAMES:
            assert torch.equal(a[key][name], b[key][name]), name
    # metadata and pins came back; the stable prefix is found by key and sits on the device
    for bid in src.metadata.all():
        other = dst.metadata.get(dst.lookup([bid.key], "acme")[0])
        assert (other.source_layer, other.importance, other.token_range, other.tenant_slug,
                other.pinned, other.num_tokens) == (
            bid.source_layer, bid.importance, bid.token_range, bid.tenant_slug, bid.pinned,
            bid.num_tokens)
    keys = [src.metadata.get(b).key for b in prefix]
    found = dst.lookup(keys, "acme")
    assert len(found) == 4
    assert all(dst.metadata.get(b).tier is Tier.DEVICE for b in found)

    # attention over recovered blocks == attention over originals, bit for bit
    rest = [m.block_id for m in src.metadata.all() if not m.pinned][:8]
    rest_keys = [src.metadata.get(b).key for b in rest]
    rest_dst = [dst.lookup([k], "acme")[0] for k in rest_keys]
    assert dst.warm_blocks(rest_dst) is not None
    src.warm_blocks(rest)
    q = torch.randn(2 * SMALL.num_kv_heads, SMALL.head_dim, generator=torch.Generator()
                    .manual_seed(3))
    out_src = _attention(src, prefix + rest, q)
    out_dst = _attention(dst, found + rest_dst, q)
    assert torch.equal(out_src, out_dst)


def _attention(cache, block_ids, q):
    """Decode attention of one query per head over blocks, layer 0.

    Uses the paged kernel op ``tq4_decode_attention`` (torch backend) when gpu_cache has
    it, and always the codec decode path, so the check holds with or without kernels.
    """
    outs = []
    try:
        from gpu_cache.kernels.ops import tq4_decode_attention
    except ImportError:
        tq4_decode_attention = None
    if tq4_decode_attention is not None:
        layer = cache.layer_view(0, Tier.DEVICE)
        table = cache.block_table(block_ids).to(torch.int64)[None]
        seq_lens = torch.tensor([len(block_ids) * cache.block_size])
        outs.append(tq4_decode_attention(q[None], layer.k_packed, layer.k_norms,
                                         layer.v_packed, layer.v_norms, table, seq_lens,
                                         cache.codec, backend="torch")[0])
    ex = cache.export_blocks(block_ids)
    k = cache.codec.decode(TQ4Encoded(ex["k_packed"], ex["k_norms"]))  # [L, n, BS, H, D]
    v = cache.codec.decode(TQ4Encoded(ex["v_packed"], ex["v_norms"]))
    k = k[0].reshape(-1, k.shape[-2], k.shape[-1])  # layer 0: [T, H, D]
    v = v[0].reshape(-1, v.shape[-2], v.shape[-1])
    group = q.shape[0] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,thd->ht", q, k) / k.shape[-1] ** 0.5
    outs.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))
    return torch.cat(outs)


def test_incremental_shadow_writes_only_changed_blocks(store_url):
    cache = make_cache(MEDIUM, host_blocks=1024)
    ids = add_blocks(cache, range(400))
    store = MeteredStore(open_store(store_url))
    with CacheShadow(cache, store, "inc", config=MANUAL) as sh:
        full = sh.shadow_now()
        full_blob = sum(v for k, v in store.written.items() if k.endswith(".bin"))
        assert full_blob == 400 * cache.bytes_per_block == full.bytes_written
        store.reset()
        cache.remove_blocks(ids[:4])  # 1% of the blocks replaced by new ones
        add_blocks(cache, range(400, 404))
        inc = sh.shadow_now()
    blob = {k: v for k, v in store.written.items() if k.endswith(".bin")}
    assert sum(blob.values()) == 4 * cache.bytes_per_block
    assert all(k.startswith("inc/seg-000001-") for k in blob)
    assert inc.blocks_written == 4 and inc.num_blocks == 400 and not inc.compacted
    # the manifest is rewritten each time but stays small next to the data
    assert store.bytes_written <= 0.04 * full_blob
    # a shadow with nothing new writes no blob at all
    store.reset()
    with CacheShadow(cache, store, "inc", config=MANUAL) as sh:
        sh.recover_session()  # everything already present: nothing imported
        assert sh.shadow_now().blocks_written == 0
    assert not [k for k in store.written if k.endswith(".bin")]
    dst = make_cache(MEDIUM, host_blocks=1024)
    report = recover_session(store, "inc", dst)
    assert report.blocks == 400 and not report.skipped
    assert exported_by_key(dst).keys() == exported_by_key(cache).keys()


def test_compaction_rewrites_live_blocks_and_drops_old_segments(store_url, tmp_path):
    cache = make_cache()
    ids = add_blocks(cache, range(20))
    with CacheShadow(cache, store_url, "cmp",
                     config=ShadowConfig(autostart=False, compact_garbage_fraction=0.5)) as sh:
        sh.shadow_now()
        cache.remove_blocks(ids[:15])
        add_blocks(cache, range(100, 103))
        res = sh.shadow_now()
        assert res.compacted and res.blocks_written == 8
        files = sorted(os.listdir(tmp_path / "shadow" / "cmp"))
        assert not [f for f in files if f.startswith("seg-000000-")]
        assert len([f for f in files if f.startswith("seg-000001-")]) == 4
    dst = make_cache()
    assert recover_session(open_store(store_url), "cmp", dst).blocks == 8
    assert exported_by_key(dst).keys() == exported_by_key(cache).keys()


def test_unkeyed_blocks_are_rewritten_every_time(store_url):
    cache = make_cache()
    add_blocks(cache, range(3), keyed=False)
    add_blocks(cache, range(3, 6))
    with CacheShadow(cache, store_url, "partial", config=MANUAL) as sh:
        assert sh.shadow_now().blocks_written == 6
        assert sh.shadow_now().blocks_written == 3


def test_periodic_scheduler_shadows_by_itself_and_close_stops_it(store_url):
    cache = make_cache()
    add_blocks(cache, range(4))
    sh = CacheShadow(cache, store_url, "tick", config=ShadowConfig(interval_seconds=0.1))
    assert sh.running
    deadline = time.monotonic() + 10
    while (sh.last_result is None or sh.last_result.generation < 2) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sh.last_result is not None and sh.last_result.generation >= 2
    sh.close()
    assert not sh.running
    generation = sh.manifest.generation
    time.sleep(0.4)
    assert sh.manifest.generation == generation
    sh.close()  # idempotent


def test_restarted_shadow_waits_for_recovery_before_periodic_writes(store_url):
    cache = make_cache()
    add_blocks(cache, range(4))
    with CacheShadow(cache, store_url, "restart", config=MANUAL) as sh:
        sh.shadow_now()
    empty = make_cache()
    sh = CacheShadow(empty, store_url, "restart", config=ShadowConfig(interval_seconds=0.05))
    time.sleep(0.4)
    sh.close()
    assert recover_session(open_store(store_url), "restart", make_cache()).blocks == 4


def test_discover_lists_sessions_with_their_sizes(store_url):
    for sid, n in (("a", 2), ("b", 5)):
        cache = make_cache()
        add_blocks(cache, range(n))
        with CacheShadow(cache, store_url, sid, config=MANUAL) as sh:
            sh.shadow_now()
            infos = sh.discover_sessions()
    assert [(i.session_id, i.num_blocks) for i in infos] == [("a", 2), ("b", 5)]
    assert infos[1].num_bytes == 5 * make_cache().bytes_per_block


@pytest.mark.parametrize("bad", ["../x", "/abs", "a/b", "a\x00b", "", ".", "..", "a\\b",
                                 "x" * 129, ".hidden", 7], ids=repr)
def test_bad_session_ids_are_rejected(bad, store_url):
    with pytest.raises(InvalidSessionIdError, match="letters, digits"):
        validate_session_id(bad)
    with pytest.raises(InvalidSessionIdError):
        CacheShadow(make_cache(), store_url, bad, config=MANUAL)
    with pytest.raises(ValueError):
        recover_session(open_store(store_url), bad, make_cache())


def test_good_session_ids_are_accepted():
    for sid in ("a", "user-42_chat.v2", "X" * 128):
        assert validate_session_id(sid) == sid


def test_identity_mismatch_is_refused_listing_the_fields(store_url):
    cache = make_cache()
    add_blocks(cache, range(3))
    with CacheShadow(cache, store_url, "other", config=MANUAL) as sh:
        sh.shadow_now()
    other = CacheIdentity(model_id="test/other", num_layers=2, num_kv_heads=2, head_dim=16,
                          block_size=8, rotation_seed=7)
    target = make_cache(other)
    with pytest.raises(CacheIdentityError) as err:
        recover_session(open_store(store_url), "other", target)
    assert "model_id" in str(err.value) and "block_size" in str(err.value)
    assert len(target.metadata) == 0
    with pytest.raises(CacheIdentityError):
        CacheShadow(target, store_url, "other", config=MANUAL)


def _shadow_sessions(store_url, sids, n=6):
    """Sessions with distinct blocks (serials 100*i ...)."""
    for i, sid in enumerate(sids):
        cache = make_cache()
        add_blocks(cache, range(100 * i, 100 * i + n))
        with CacheShadow(cache, store_url, sid, config=MANUAL) as sh:
            sh.shadow_now()


def test_truncated_blob_skips_only_the_cut_blocks(store_url, tmp_path):
    _shadow_sessions(store_url, ["cut", "fine"])
    path = segment_blob(tmp_path / "shadow", "cut", "v_norms")
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - size // 6 - 1)  # the last two blocks lose bytes
    report = recover_sessions(open_store(store_url), make_cache())
    assert sorted(report.sessions) == ["cut", "fine"]
    assert report.blocks == 6 + 4
    assert [(s.session_id, s.index) for s in report.skipped] == [("cut", 4), ("cut", 5)]
    assert all("truncated" in s.reason for s in report.skipped)


def test_flipped_byte_fails_its_checksum(store_url, tmp_path):
    _shadow_sessions(store_url, ["flip"])
    path = segment_blob(tmp_path / "shadow", "flip", "k_packed")
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 6 * 2 + 5] ^= 0xFF  # inside block 2
    path.write_bytes(bytes(raw))
    dst = make_cache()
    report = recover_session(open_store(store_url), "flip", dst)
    assert report.blocks == 5
    assert [(s.index, s.reason) for s in report.skipped] == [(2, "k_packed checksum mismatch")]
    assert report.block_ids["flip"][2] is None


@pytest.mark.parametrize("damage", ["not json", "missing field", "wrong format", "bad offset",
                                    "missing blob"])
def test_corrupt_session_is_reported_and_others_recover(damage, store_url, tmp_path):
    _shadow_sessions(store_url, ["bad", "good"])
    path = tmp_path / "shadow" / "bad" / "manifest.json"
    doc = json.loads(path.read_bytes())
    if damage == "not json":
        path.write_bytes(path.read_bytes()[:-20])
    elif damage == "missing field":
        del doc["blocks"][1]["checksums"]
        path.write_text(json.dumps(doc))
    elif damage == "wrong format":
        doc["format"] = "something-else"
        path.write_text(json.dumps(doc))
    elif damage == "bad offset":
        doc["blocks"][0]["offsets"]["k_norms"] = 10**9
        path.write_text(json.dumps(doc))
    else:
        segment_blob(tmp_path / "shadow", "bad", "v_packed").unlink()
    dst = make_cache()
    report = recover_sessions(open_store(store_url), dst)
    assert "good" in report.sessions
    if damage == "missing blob":
        assert report.num_skipped == 6 and "missing" in report.skipped[0].reason
    elif damage == "missing field":  # one record: that block only (issue 33)
        assert [s.index for s in report.skipped] == [1] and "checksums" in report.skipped[0].reason
        assert "bad" in report.sessions and report.blocks == 11
        return
    else:
        assert "bad" in report.errors and "bad" not in report.sessions
    assert report.blocks == 6
    assert len(dst.metadata) == 6
    infos = {i.session_id: i for i in shadow.discover_sessions(open_store(store_url))}
    assert infos["good"].error is None
    assert (infos["bad"].error is not None) == (damage != "missing blob")


def test_failed_write_leaves_previous_snapshot_authoritative(store_url, tmp_path):
    cache = make_cache()
    add_blocks(cache, range(6))

    class FailingStore(MeteredStore):
        """Fails the next blob commit, like a crash after partial blob writes."""

        fail = False

        def open_writer(self, key):
            writer = super().open_writer(key)
            if self.fail and key.endswith("v_norms.bin"):
                def boom():
                    writer.abort()
                    raise OSError("disk full")
                writer.commit = boom
            return writer

    store = FailingStore(LocalStore(store_url))
    sh = CacheShadow(cache, store, "fail", config=MANUAL)
    sh.shadow_now()
    add_blocks(cache, range(6, 9))
    store.fail = True
    with pytest.raises(OSError, match="disk full"):
        sh.shadow_now()
    assert sh.manifest.generation == 1
    report = recover_session(LocalStore(store_url), "fail", make_cache())
    assert report.blocks == 6 and not report.skipped
    store.fail = False
    assert sh.shadow_now().blocks_written == 3  # retried into the same segment number
    sh.close()
    assert recover_session(LocalStore(store_url), "fail", make_cache()).blocks == 9
    leftovers = [n for n in os.listdir(tmp_path / "shadow" / "fail") if ".tmp-" in n]
    assert leftovers == []


def test_recovery_into_a_full_host_tier_reports_the_rest(store_url):
    _shadow_sessions(store_url, ["big"], n=20)
    small = make_cache(host_blocks=8)
    report = recover_session(open_store(store_url), "big", small, chunk_bytes=1)
    assert report.blocks == 8 and report.num_skipped == 12
    assert "no room" in report.skipped[-1].reason


def test_unknown_store_scheme_says_what_is_known():
    with pytest.raises(shadow.ShadowStoreError, match="file://, s3://"):
        open_store("ftp://example.org/x")


def test_direct_reads_match_buffered_reads_and_stop_at_end_of_file(tmp_path):
    import mmap
    import os

    import numpy as np

    from shadow import LocalStore, StoreConfig

    data = os.urandom(3 * 4096 + 100)  # the tail is not a page multiple
    direct = LocalStore(f"file://{tmp_path}", StoreConfig(direct_io=True))
    plain = LocalStore(f"file://{tmp_path}", StoreConfig(direct_io=False))
    direct.put("blob.bin", data)
    for offset, length in ((0, 4 * 4096), (4096, 4096), (8192, 8192)):
        aligned = np.frombuffer(mmap.mmap(-1, length), dtype=np.uint8)  # page-aligned, writable
        got = direct.read_into("blob.bin", offset, memoryview(aligned))
        expect = bytearray(length)
        assert plain.read_into("blob.bin", offset, memoryview(expect)) == got
        assert got == min(length, len(data) - offset)
        assert aligned[:got].tobytes() == data[offset:offset + got] == bytes(expect[:got])
    if hasattr(os, "O_DIRECT") and direct._direct_ok:  # ext4/xfs: the direct path was taken
        assert any(k.endswith("\0direct") for k in direct._read_fds)
    direct.close()
    plain.close()
