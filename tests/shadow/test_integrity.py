"""Issue 33, items 1-3: a keyed MAC over every recovered byte, a commit protocol that
survives a lost acknowledgement, and fresh generations (a replayed manifest is refused).

Real stores throughout: a local directory, and moto's S3 server over HTTP; faults come
from :class:`shadow_testkit.FaultyStore`, the real store with queued manifest faults.
"""

from __future__ import annotations

import json
import shutil
import zlib

import pytest
import torch
from shadow_testkit import (
    BUCKET,
    KEY,
    SMALL,
    FaultyStore,
    add_blocks,
    exported_by_key,
    forge_crc,
    make_cache,
)

from gpu_cache import TENSOR_NAMES
from shadow import (
    CacheShadow,
    ShadowConfig,
    ShadowStoreError,
    StoreConfig,
    TamperedShadowError,
    load_manifest,
    open_store,
    recover_session,
    recover_sessions,
)

SIGNED = ShadowConfig(autostart=False, auth_key=KEY)


def _slice(root, manifest: dict, index: int, name: str) -> tuple:
    """The blob path, and the byte range of block ``index``'s ``name`` tensor in it."""
    rec = manifest["blocks"][index]
    seg = next(s for s in manifest["segments"] if s["id"] == rec["segment"])
    size = manifest["tensors"][name]["block_bytes"]
    return root / seg["files"][name], rec["offsets"][name], size


# ---------------------------------------------------------------- 1. a CRC is not a MAC
@pytest.mark.parametrize("name", TENSOR_NAMES)
def test_forged_block_bytes_with_a_valid_crc_are_never_imported(name, store_url, tmp_path):
    alice = make_cache()
    add_blocks(alice, range(6), tenant="alice")
    with CacheShadow(alice, store_url, "a", config=SIGNED) as sh:
        sh.shadow_now()
    bob = make_cache()
    add_blocks(bob, range(50, 54), tenant="bob")
    with CacheShadow(bob, store_url, "b", config=SIGNED) as sh:
        sh.shadow_now()
    root = tmp_path / "shadow"
    manifest = json.loads((root / "a" / "manifest.json").read_bytes())
    path, offset, size = _slice(root, manifest, 2, name)
    blob = bytearray(path.read_bytes())
    block = bytearray(blob[offset:offset + size])
    original = bytes(block)
    block[-1] ^= 0x5A  # new KV bytes ...
    forge_crc(block, 0, manifest["blocks"][2]["checksums"][name])  # ... with the old CRC
    assert bytes(block) != original
    assert zlib.crc32(bytes(block)) == manifest["blocks"][2]["checksums"][name]
    blob[offset:offset + size] = block
    path.write_bytes(bytes(blob))

    dst = make_cache()
    report = recover_sessions(open_store(store_url), dst, key=KEY)
    assert not report.errors and report.blocks == 9
    [skipped] = report.skipped
    assert skipped.session_id == "a" and skipped.index == 2 and "MAC" in skipped.reason
    want = exported_by_key(alice) | exported_by_key(bob)
    for key, tensors in exported_by_key(dst).items():
        assert all(torch.equal(tensors[n], want[key][n]) for n in TENSOR_NAMES)


def test_block_mac_binds_bytes_key_tenant_identity_position_and_nonce() -> None:
    import numpy as np

    from shadow.auth import BLOCK_NONCE_BYTES, BlockBinding, block_mac, new_block_nonces

    data = [bytes([i]) * 64 for i in range(len(TENSOR_NAMES))]
    base = BlockBinding(identity=SMALL.digest(), session_id="s", tenant="alice",
                        key="ab" * 32, segment="seg-000001-0123abcd", slot=3)
    nonce, other_nonce = new_block_nonces(2)
    assert len(nonce) == BLOCK_NONCE_BYTES and nonce != other_nonce
    tag = block_mac(KEY, base, nonce, data)
    # any contiguous buffer of the same bytes gives the same tag
    same = [np.frombuffer(d, np.uint8).reshape(4, 16) for d in data]
    assert len(tag) == 32 and tag == block_mac(KEY, base, nonce, same)
    variants = [
        block_mac(b"another key", base, nonce, data),
        block_mac(KEY, base, other_nonce, data),
        block_mac(KEY, base, nonce, [*data[:3], b"\x00" * 64]),
        # the same bytes cut into slices differently (the lengths are MACed)
        block_mac(KEY, base, nonce, [data[0] + data[1][:1], data[1][1:], *data[2:]]),
        block_mac(KEY, base, nonce, [*data, b""]),
        *(block_mac(KEY, base.replace(**change), nonce, data) for change in (
            {"tenant": "bob"}, {"key": "cd" * 32}, {"key": None}, {"session_id": "t"},
            {"identity": SMALL.digest()[::-1]}, {"segment": "seg-000002-0123abcd"},
            {"slot": 4})),
    ]
    assert tag not in variants and len(set(variants)) == len(variants)
    with pytest.raises(ValueError, match="nonce"):
        block_mac(KEY, base, nonce[:-1], data)


def test_every_block_record_gets_its_own_nonce(store_url, tmp_path):
    """Rewriting the same bytes into the same position never reuses a one-time key."""
    tags = set()
    for _ in range(2):
        cache = make_cache()
        add_blocks(cache, range(4))
        with CacheShadow(cache, store_url, "s", config=SIGNED) as sh:
            sh.shadow_now()
        doc = json.loads((tmp_path / "shadow" / "s" / "manifest.json").read_bytes())
        tags |= {(b["mac_nonce"], b["mac"]) for b in doc["blocks"]}
        shutil.rmtree(tmp_path / "shadow")
    assert len(tags) == 8 and len({n for n, _ in tags}) == 8


@pytest.mark.parametrize("field", ["mac", "mac_nonce"])
def test_a_signed_manifest_without_block_macs_recovers_nothing_unchecked(field, store_url,
                                                                        tmp_path):
    """A block record that lost its MAC or nonce (or predates them) is skipped, never
    trusted."""
    from shadow.auth import sign

    cache = make_cache()
    add_blocks(cache, range(4))
    with CacheShadow(cache, store_url, "s", config=SIGNED) as sh:
        sh.shadow_now()
    path = tmp_path / "shadow" / "s" / "manifest.json"
    doc = json.loads(path.read_bytes())
    del doc["mac"]
    doc["blocks"][1].pop(field, None)
    doc["mac"] = sign(doc, KEY, "manifest")  # a writer holding the key, but no block MAC
    path.write_text(json.dumps(doc))
    (tmp_path / "shadow" / "s" / "head.json").unlink()  # as written before heads existed
    report = recover_session(open_store(store_url), "s", make_cache(), key=KEY)
    assert report.blocks == 3 and [s.index for s in report.skipped] == [1]
    assert "MAC" in report.skipped[0].reason
    # the next shadow writes that block again, with its MAC
    with CacheShadow(cache, store_url, "s", config=SIGNED) as sh:
        assert sh.shadow_now().blocks_written == 1
    report = recover_session(open_store(store_url), "s", make_cache(), key=KEY)
    assert report.blocks == 4 and not report.skipped


# ---------------------------------------------------------------- 2. a lost acknowledgement
@pytest.fixture(params=["file", "s3"])
def faulty_store(request, tmp_path):
    if request.param == "file":
        inner = open_store(f"file://{tmp_path / 'shadow'}")
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        inner = open_store(f"s3://{BUCKET}/lost-ack-{tmp_path.name}",
                           StoreConfig(endpoint_url=endpoint))
    store = FaultyStore(inner)
    yield store
    store.close()


def test_a_lost_manifest_acknowledgement_never_loses_committed_blocks(faulty_store):
    store = faulty_store
    cache = make_cache()
    add_blocks(cache, range(30))
    sh = CacheShadow(cache, store, "s", config=SIGNED)
    assert sh.shadow_now().generation == 1
    second = add_blocks(cache, range(30, 60))
    store.faults.append("lost-ack")  # generation 2 lands; the writer sees a timeout
    with pytest.raises(ShadowStoreError, match="timed out"):
        sh.shadow_now()
    committed = load_manifest(store, "s", key=KEY)
    assert committed.generation == 2 and len(committed.blocks) == 60
    truth = exported_by_key(cache)

    # the next shadow writes another layout, and fails before its manifest lands
    cache.remove_blocks(second[:10])
    add_blocks(cache, range(60, 90))
    store.faults.append("fail")
    with pytest.raises(ShadowStoreError, match="connection reset"):
        sh.shadow_now()
    dst = make_cache()
    report = recover_session(store, "s", dst, key=KEY)
    assert report.blocks == 60 and not report.skipped and not report.errors
    for key, tensors in exported_by_key(dst).items():
        assert all(torch.equal(tensors[n], truth[key][n]) for n in TENSOR_NAMES)
    # no object was ever written twice under one name: segments are immutable
    rewritten = {k: n for k, n in store.puts.items()
                 if n > 1 and not k.endswith(("manifest.json", "index.json", "writer.lease",
                                              "head.json"))}
    assert not rewritten

    # and the writer goes on: a fresh generation, every live block recoverable
    result = sh.shadow_now()
    assert result.generation > 3  # 3 was tried (and may land late): never reused
    sh.close()
    report = recover_session(store, "s", make_cache(), key=KEY)
    assert report.blocks == 80 and not report.skipped


def test_a_failed_manifest_write_is_never_reused_as_a_generation(store_url):
    store = FaultyStore(open_store(store_url))
    cache = make_cache()
    add_blocks(cache, range(4))
    with CacheShadow(cache, store, "s", config=SIGNED) as sh:
        sh.shadow_now()
        add_blocks(cache, range(4, 8))
        store.faults.append("fail")
        with pytest.raises(ShadowStoreError):
            sh.shadow_now()
        assert sh.shadow_now().generation == 3
    assert recover_session(store, "s", make_cache(), key=KEY).blocks == 8


# ---------------------------------------------------------------- 3. rollback
def _two_generations(store_url, tmp_path) -> bytes:
    """Session ``s``: generation 1 holds 12 blocks, generation 2 deleted six of them.
    Returns generation 1's manifest file."""
    cache = make_cache()
    ids = add_blocks(cache, range(12))
    with CacheShadow(cache, store_url, "s", config=SIGNED) as sh:
        sh.shadow_now()
        old = (tmp_path / "shadow" / "s" / "manifest.json").read_bytes()
        cache.remove_blocks(ids[:6])
        assert sh.shadow_now().generation == 2
    return old


@pytest.mark.parametrize("evidence", ["head and index", "head only", "index only"])
def test_a_replayed_older_manifest_is_refused_as_a_rollback(evidence, store_url, tmp_path):
    root = tmp_path / "shadow"
    old = _two_generations(store_url, tmp_path)
    (root / "s" / "manifest.json").write_bytes(old)  # valid MAC, stale generation
    if evidence == "head only":
        (root / "index.json").unlink()
    elif evidence == "index only":
        (root / "s" / "head.json").unlink()
    store = open_store(store_url)
    dst = make_cache()
    with pytest.raises(TamperedShadowError, match=r"rollback.*generation 1.*generation 2"):
        recover_session(store, "s", dst, key=KEY)
    assert len(dst.metadata) == 0
    report = recover_sessions(store, dst, key=KEY)
    assert report.blocks == 0 and "rollback" in report.errors["s"]
    assert "accept" in report.errors["s"]  # the operator's choice is named
    # the operator may take the older state, and the report says it was a rollback
    report = recover_session(store, "s", dst, key=KEY, accept_rollback=True)
    assert report.blocks == 12 and "s" in report.rollbacks


def test_a_restarted_writer_never_reuses_a_generation_after_a_replay(store_url, tmp_path):
    old = _two_generations(store_url, tmp_path)
    (tmp_path / "shadow" / "s" / "manifest.json").write_bytes(old)
    with pytest.raises(TamperedShadowError, match="rollback"):
        CacheShadow(make_cache(), store_url, "s", config=SIGNED)
    cache = make_cache()
    add_blocks(cache, range(3))
    accept = ShadowConfig(autostart=False, auth_key=KEY, accept_rollback=True)
    with CacheShadow(cache, store_url, "s", config=accept) as sh:
        assert sh.shadow_now().generation == 3
    assert load_manifest(open_store(store_url), "s", key=KEY).generation == 3


def test_discovery_reports_a_rolled_back_session(store_url, tmp_path):
    from shadow import discover_sessions

    old = _two_generations(store_url, tmp_path)
    (tmp_path / "shadow" / "s" / "manifest.json").write_bytes(old)
    [info] = discover_sessions(open_store(store_url), key=KEY)
    assert info.error is not None and "rollback" in info.error
