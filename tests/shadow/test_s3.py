"""Shadow and recovery against a real S3 endpoint over HTTP (moto's threaded server)."""

from __future__ import annotations

# Real S3 over HTTP: boto3 and moto's server are installed by `make setup` (shadow and dev
# extras); a missing one must fail these tests, not skip them.
import boto3
import moto.server as moto_server
import pytest
import torch
from shadow_testkit import MEDIUM, add_blocks, add_prefix, exported_by_key, make_cache

from gpu_cache import TENSOR_NAMES, PrefixPinManager
from shadow import (
    CacheShadow,
    MeteredStore,
    S3Store,
    ShadowConfig,
    StoreConfig,
    discover_sessions,
    open_store,
    recover_session,
)
from shadow.stores import S3_MIN_PART_BYTES

BUCKET = "ck-shadow"
MANUAL = ShadowConfig(autostart=False)


@pytest.fixture(scope="session")
def s3_endpoint():
    mp = pytest.MonkeyPatch()
    for var, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        mp.setenv(var, value)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()
    mp.undo()


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
    assert calls[-1] == "PutObject"  # the index, after the manifest
    keys = store.list()
    assert {"chat-1/manifest.json", "chat-1/k_packed.bin", "index.json"} <= set(keys)

    infos = discover_sessions(store)
    assert [(i.session_id, i.num_blocks) for i in infos] == [("chat-1", 704)]
    dst = make_cache(MEDIUM, host_blocks=1024)
    report = recover_session(open_store(prefix, s3_config), "chat-1", dst)
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
                           make_cache(MEDIUM, host_blocks=1024)).blocks == 200


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
    assert not base.exists("crash/seg-000001.v_packed.bin")
    report = recover_session(base, "crash", make_cache(MEDIUM, host_blocks=2048))
    assert report.blocks == 50 and not report.skipped
    # the next shadow (a restart) completes and supersedes it
    with CacheShadow(cache, base, "crash", config=MANUAL) as again:
        assert again.shadow_now().blocks_written == 1400
    assert recover_session(base, "crash", make_cache(MEDIUM, host_blocks=2048)).blocks == 1450


def test_s3_url_without_bucket_is_refused():
    with pytest.raises(Exception, match="s3://bucket/prefix"):
        S3Store("s3:///nobucket")
