"""Shadow and recovery against a real S3 endpoint over HTTP (moto's threaded server)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from shadow_testkit import BUCKET, KEY, MEDIUM, add_blocks, add_prefix, exported_by_key, make_cache

from gpu_cache import TENSOR_NAMES, PrefixPinManager
from shadow import (
    CacheShadow,
    MeteredStore,
    S3Store,
    ShadowConfig,
    ShadowStoreError,
    StoreConfig,
    UnauthenticatedShadowError,
    discover_sessions,
    open_store,
    recover_session,
    recover_sessions,
)
from shadow.debris import sweep_debris
from shadow.stores import S3_MIN_PART_BYTES

MANUAL = ShadowConfig(autostart=False, auth_key=KEY)


@pytest.fixture
def s3_config(s3_endpoint):
    # small multipart threshold so the blobs below go up in several 5 MiB parts
    return StoreConfig(endpoint_url=s3_endpoint, multipart_threshold=S3_MIN_PART_BYTES,
                       multipart_chunksize=S3_MIN_PART_BYTES)


def _calls(store: S3Store) -> list[str]:
    seen: list[str] = []
    store.client.meta.events.register("before-call.s3.*",
                                      lambda model, **_: seen.append(model.name))
    return seen


def test_shadow_discover_recover_over_s3_with_multipart(s3_config, request):
    prefix = f"s3://{BUCKET}/{request.node.name}"
    cache = make_cache(MEDIUM, host_blocks=1024)
    pins = add_prefix(cache, 4)
    PrefixPinManager(cache).pin(pins)
    add_blocks(cache, range(700))  # k_packed blob: 704 * 8 KiB = 5.5 MiB -> 2 parts
    store = open_store(prefix, s3_config)
    assert isinstance(store, S3Store)
    calls = _calls(store)
    with CacheShadow(cache, store, "chat-1", config=MANUAL) as sh:
        sh.shadow_now()
    assert calls.count("CompleteMultipartUpload") == 2  # k_packed and v_packed
    assert calls.count("UploadPart") == 4
    # the manifest, its head, then the index; the writer's lease is released on close
    assert calls[-5:] == ["PutObject", "PutObject", "GetObject", "PutObject", "DeleteObject"]
    keys = store.list()
    assert {"chat-1/manifest.json", "chat-1/head.json", "index.json"} <= set(keys)
    assert [k for k in keys if k.startswith("chat-1/seg-000000-") and k.endswith(".k_packed.bin")]

    infos = discover_sessions(store, key=KEY)
    assert [(i.session_id, i.num_blocks, i.authenticated) for i in infos] == [
        ("chat-1", 704, True)]
    assert "set CONTEXTKIT_SHADOW_KEY" in discover_sessions(store)[0].error
    dst = make_cache(MEDIUM, host_blocks=1024)
    report = recover_session(open_store(prefix, s3_config), "chat-1", dst, key=KEY)
    assert report.blocks == 704 and not report.skipped and report.pinned == 4
    a, b = exported_by_key(cache), exported_by_key(dst)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k][n], b[k][n]) for k in a for n in TENSOR_NAMES)


def test_incremental_over_s3_uploads_only_new_blocks(s3_config, request):
    prefix = f"s3://{BUCKET}/{request.node.name}"
    cache = make_cache(MEDIUM, host_blocks=1024)
    ids = add_blocks(cache, range(200))
    store = MeteredStore(open_store(prefix, s3_config))
    with CacheShadow(cache, store, "inc", config=MANUAL) as sh:
        sh.shadow_now()
        store.reset()
        cache.remove_blocks(ids[:2])
        add_blocks(cache, range(200, 202))
        sh.shadow_now()
    blob = sum(v for k, v in store.written.items() if k.endswith(".bin"))
    assert blob == 2 * cache.bytes_per_block
    assert recover_session(open_store(prefix, s3_config), "inc",
                           make_cache(MEDIUM, host_blocks=1024), key=KEY).blocks == 200


class _CrashingStore(MeteredStore):
    """Feeds the real S3 writer, then dies after ``die_after`` bytes of one blob."""

    def __init__(self, inner, die_after: int) -> None:
        super().__init__(inner)
        self.die_after = die_after

    def open_writer(self, key):
        writer = super().open_writer(key)
        if not key.endswith("v_packed.bin"):
            return writer
        original = writer.write

        def write(data):
            original(data)
            if writer.bytes_written >= self.die_after:
                raise KeyboardInterrupt("simulated crash mid-upload")
        writer.write = write
        return writer


def test_interrupted_multipart_upload_leaves_no_authoritative_manifest(s3_config, request):
    prefix = f"s3://{BUCKET}/{request.node.name}"
    cache = make_cache(MEDIUM, host_blocks=2048)
    add_blocks(cache, range(50))
    base = open_store(prefix, s3_config)
    with CacheShadow(cache, base, "crash", config=MANUAL) as sh:
        sh.shadow_now()
    before = base.get("crash/manifest.json")

    add_blocks(cache, range(50, 1450))  # v_packed grows by ~11 MiB: a multipart upload
    inner = open_store(prefix, s3_config)
    calls = _calls(inner)
    crashing = _CrashingStore(inner, die_after=2 * S3_MIN_PART_BYTES + 1)
    sh = CacheShadow(cache, crashing, "crash", config=MANUAL)
    with pytest.raises(KeyboardInterrupt):
        sh.shadow_now()
    assert "CreateMultipartUpload" in calls and "UploadPart" in calls
    assert base.get("crash/manifest.json") == before  # still the old snapshot
    assert not [k for k in base.list("crash/") if k.startswith("crash/seg-000001-")]
    report = recover_session(base, "crash", make_cache(MEDIUM, host_blocks=2048), key=KEY)
    assert report.blocks == 50 and not report.skipped
    # the next shadow (a restart) completes and supersedes it
    with CacheShadow(cache, base, "crash", config=MANUAL) as again:
        assert again.shadow_now().blocks_written == 1400
    assert recover_session(base, "crash", make_cache(MEDIUM, host_blocks=2048),
                           key=KEY).blocks == 1450


def test_s3_url_without_bucket_is_refused():
    with pytest.raises(Exception, match="s3://bucket/prefix"):
        S3Store("s3:///nobucket")


# ---------------------------------------------------------------- issue 19 on S3
def test_unsigned_s3_session_is_refused_unless_explicitly_allowed(s3_config, request):
    prefix = f"s3://{BUCKET}/{request.node.name}"
    cache = make_cache(MEDIUM)
    add_blocks(cache, range(5))
    with CacheShadow(cache, prefix, "plain", config=ShadowConfig(autostart=False),
                     store_config=s3_config) as sh:
        sh.shadow_now()
    store = open_store(prefix, s3_config)
    with pytest.raises(UnauthenticatedShadowError, match="--allow-unauthenticated"):
        recover_session(store, "plain", make_cache(MEDIUM))
    report = recover_session(store, "plain", make_cache(MEDIUM), allow_unauthenticated=True)
    assert report.blocks == 5
    signed = recover_sessions(store, make_cache(MEDIUM))
    assert "plain" in signed.errors and signed.blocks == 0


def test_s3_without_credentials_is_one_line_saying_what_to_set(s3_endpoint,
                                                               no_aws_credentials):
    store = open_store(f"s3://{BUCKET}/nocreds", StoreConfig(endpoint_url=s3_endpoint))
    with pytest.raises(ShadowStoreError, match="AWS_ACCESS_KEY_ID") as err:
        discover_sessions(store)
    assert "\n" not in str(err.value)
    with pytest.raises(ShadowStoreError, match="AWS_ACCESS_KEY_ID"):
        CacheShadow(make_cache(MEDIUM), store, "s", config=MANUAL)


def test_missing_bucket_is_a_store_error(s3_endpoint):
    store = open_store("s3://no-such-bucket-here/x", StoreConfig(endpoint_url=s3_endpoint))
    with pytest.raises(ShadowStoreError, match="does not exist"):
        store.list()


def _dangling_upload(store: Any, key: str) -> str:
    """A multipart upload a killed writer left: started, one part, never completed."""
    client, obj = store.client, store._object_key(key)
    upload = client.create_multipart_upload(Bucket=store.bucket, Key=obj)["UploadId"]
    client.upload_part(Bucket=store.bucket, Key=obj, UploadId=upload, PartNumber=1,
                       Body=b"x" * S3_MIN_PART_BYTES)
    return upload


def test_writer_start_aborts_stale_uploads_but_not_a_live_writers(s3_config, request):
    prefix = f"s3://{BUCKET}/{request.node.name}"
    store = open_store(prefix, s3_config)
    live = CacheShadow(make_cache(MEDIUM), store, "live", config=MANUAL)
    _dangling_upload(store, "mine/seg-000001.k_packed.bin")
    _dangling_upload(store, "dead/k_packed.bin")
    _dangling_upload(store, "live/seg-000004.v_packed.bin")
    assert len(store.list_uploads()) == 3
    # moto reports every upload as initiated in 2010: "young" needs a threshold above that
    young = time.time() - min(t for _, _, t in store.list_uploads()) + 3600
    fresh = ShadowConfig(autostart=False, auth_key=KEY, upload_abort_after_seconds=young)
    CacheShadow(make_cache(MEDIUM), store, "mine", config=fresh).close()
    assert len(store.list_uploads()) == 3
    now = ShadowConfig(autostart=False, auth_key=KEY, upload_abort_after_seconds=0)
    CacheShadow(make_cache(MEDIUM), store, "mine", config=now).close()
    assert [k for k, _, _ in store.list_uploads()] == ["live/seg-000004.v_packed.bin"]
    live.close()


def test_sweep_over_s3_cleans_dead_sessions_and_spares_live_ones(s3_config, request):
    prefix = f"s3://{BUCKET}/{request.node.name}"
    store = open_store(prefix, s3_config)
    cache = make_cache(MEDIUM)
    add_blocks(cache, range(4))
    with CacheShadow(cache, store, "dead", config=MANUAL) as sh:
        sh.shadow_now()
    live_cache = make_cache(MEDIUM)
    add_blocks(live_cache, range(10, 13))
    live = CacheShadow(live_cache, store, "live", config=MANUAL)
    live.shadow_now()
    for sid in ("dead", "live"):
        store.put(f"{sid}/seg-000042.k_packed.bin", b"debris")
        _dangling_upload(store, f"{sid}/seg-000043.k_packed.bin")
    store.put("orphan/k_packed.bin", b"no manifest")
    swept = sweep_debris(store, key=KEY, older_than_seconds=0)
    assert sorted(swept.deleted) == ["dead/seg-000042.k_packed.bin", "orphan/k_packed.bin"]
    assert swept.aborted_uploads == ["dead/seg-000043.k_packed.bin"]
    assert swept.live_sessions == ["live"]
    assert store.exists("live/seg-000042.k_packed.bin")
    assert recover_session(store, "dead", make_cache(MEDIUM), key=KEY).blocks == 4
    live.close()
    swept = sweep_debris(store, key=KEY, older_than_seconds=0)
    assert swept.deleted == ["live/seg-000042.k_packed.bin"] and not store.list_uploads()
    assert recover_session(store, "live", make_cache(MEDIUM), key=KEY).blocks == 3
