"""Issue 19 on a local store: temp-file cleanup, authenticated manifests, validation
before allocation, debris sweeping and liveness leases, unreadable stores."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
from shadow_testkit import KEY, SMALL, add_blocks, make_cache

import shadow
from gpu_cache import CacheIdentityError, Tier
from shadow import (
    KEY_ENV,
    CacheShadow,
    CorruptShadowError,
    InvalidSessionIdError,
    LocalStore,
    MeteredStore,
    ShadowConfig,
    ShadowStoreError,
    TamperedShadowError,
    UnauthenticatedShadowError,
    load_manifest,
    open_store,
    recover_session,
    recover_sessions,
)
from shadow.debris import LEASE_NAME, sweep_debris
from shadow.recovery import read_index

MANUAL = ShadowConfig(autostart=False)
SIGNED = ShadowConfig(autostart=False, auth_key=KEY)


def _shadow(store_url, sid, serials, *, config=MANUAL, tenant="default"):
    cache = make_cache()
    add_blocks(cache, serials, tenant=tenant)
    with CacheShadow(cache, store_url, sid, config=config) as sh:
        sh.shadow_now()
    return cache


def _edit(path, fn):
    doc = json.loads(path.read_bytes())
    fn(doc)
    path.write_text(json.dumps(doc))


def _host_is_whole(cache):
    return (cache.num_free(Tier.HOST) + cache.num_used(Tier.HOST) == cache.capacity(Tier.HOST)
            and cache.num_used(Tier.HOST) == len(cache.metadata) == 0)


# ---------------------------------------------------------------- 1. temp files, ids
def test_session_id_containing_tmp_survives_its_writer_reopening(store_url):
    _shadow(store_url, "agent.tmp-1", range(6))
    CacheShadow(make_cache(), store_url, "agent.tmp-1", config=MANUAL).close()  # a restart
    store = open_store(store_url)
    [segment] = load_manifest(store, "agent.tmp-1").segments
    assert store.exists("agent.tmp-1/manifest.json")
    assert all(store.exists(f) for f in segment.files.values())
    report = recover_session(store, "agent.tmp-1", make_cache())
    assert report.blocks == 6 and not report.skipped


def test_only_real_temp_files_count_as_unfinished(store_url, tmp_path):
    _shadow(store_url, "s", range(3))
    root = tmp_path / "shadow"
    (root / "s" / "k_packed.bin.tmp-4242-deadbeef").write_bytes(b"half")
    (root / "x.tmp-1").mkdir()
    (root / "x.tmp-1" / "manifest.json").write_bytes(b"{}")
    store = LocalStore(store_url)
    assert store.list_unfinished() == ["s/k_packed.bin.tmp-4242-deadbeef"]
    assert "x.tmp-1/manifest.json" in store.list()
    CacheShadow(make_cache(), store_url, "s", config=MANUAL).close()
    assert not (root / "s" / "k_packed.bin.tmp-4242-deadbeef").exists()
    assert (root / "x.tmp-1" / "manifest.json").exists()


def test_index_json_session_id_is_an_invalid_id_not_an_os_error(store_url):
    _shadow(store_url, "real", range(2))
    with pytest.raises(InvalidSessionIdError, match="reserved"):
        CacheShadow(make_cache(), store_url, "index.json", config=MANUAL)
    with pytest.raises(InvalidSessionIdError, match="reserved"):
        recover_session(open_store(store_url), "index.json", make_cache())
    report = recover_sessions(open_store(store_url), make_cache(), ["index.json", "real"])
    assert "reserved" in report.errors["index.json"] and report.blocks == 2


# ---------------------------------------------------------------- 2. authenticated manifests
def test_signed_manifest_and_index_round_trip(store_url, tmp_path):
    _shadow(store_url, "a", range(6), config=SIGNED)
    manifest = json.loads((tmp_path / "shadow" / "a" / "manifest.json").read_bytes())
    index = json.loads((tmp_path / "shadow" / "index.json").read_bytes())
    assert manifest["mac"]["alg"] == index["mac"]["alg"] == "hmac-sha256"
    assert len(manifest["mac"]["value"]) == 64
    store = open_store(store_url)
    assert read_index(store, key=KEY).keys() == {"a"}
    report = recover_session(store, "a", make_cache(), key=KEY)
    assert report.blocks == 6 and not report.skipped and not report.errors


@pytest.mark.parametrize("tamper", ["tenant", "key swap", "offset swap", "checksum",
                                    "record from other session", "session renamed",
                                    "mac removed", "importance"])
def test_tampered_manifest_is_refused_and_the_other_session_recovers(tamper, store_url,
                                                                     tmp_path):
    _shadow(store_url, "bad", range(6), config=SIGNED, tenant="alice")
    _shadow(store_url, "good", range(10, 16), config=SIGNED, tenant="bob")
    root = tmp_path / "shadow"
    path = root / "bad" / "manifest.json"
    other = json.loads((root / "good" / "manifest.json").read_bytes())

    def damage(doc):
        b = doc["blocks"]
        if tamper == "tenant":
            b[0]["tenant"] = "bob"
        elif tamper == "key swap":
            b[0]["key"], b[1]["key"] = b[1]["key"], b[0]["key"]
        elif tamper == "offset swap":
            b[0]["offsets"], b[1]["offsets"] = b[1]["offsets"], b[0]["offsets"]
            b[0]["checksums"], b[1]["checksums"] = b[1]["checksums"], b[0]["checksums"]
        elif tamper == "checksum":
            b[2]["checksums"]["k_norms"] ^= 1
        elif tamper == "record from other session":
            b[0] = other["blocks"][0]
        elif tamper == "session renamed":
            doc.update({k: other[k] for k in ("session_id", "mac")})
        elif tamper == "mac removed":
            del doc["mac"]
        else:
            b[0]["importance"] = 0.5
    _edit(path, damage)
    dst = make_cache()
    with pytest.raises(TamperedShadowError) as err:
        recover_session(open_store(store_url), "bad", dst, key=KEY)
    assert "\n" not in str(err.value) and "refused" in str(err.value)
    assert _host_is_whole(dst)
    report = recover_sessions(open_store(store_url), dst, key=KEY)
    assert report.sessions == ["good"] and report.blocks == 6 and "bad" in report.errors
    assert {m.tenant_slug for m in dst.metadata.all()} == {"bob"}


def test_wrong_key_is_refused_naming_the_key_fingerprints(store_url):
    _shadow(store_url, "a", range(3), config=SIGNED)
    with pytest.raises(TamperedShadowError, match="another key"):
        load_manifest(open_store(store_url), "a", key=b"some other key")


def test_signed_shadow_read_without_a_key_says_to_set_it(store_url):
    _shadow(store_url, "a", range(3), config=SIGNED)
    with pytest.raises(UnauthenticatedShadowError,
                       match=f"this shadow is authenticated; set {KEY_ENV}"):
        recover_session(open_store(store_url), "a", make_cache())


def test_key_from_the_environment_signs_and_verifies(store_url, tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "from-the-env")
    _shadow(store_url, "env", range(4))
    assert "mac" in json.loads((tmp_path / "shadow" / "env" / "manifest.json").read_bytes())
    assert recover_session(open_store(store_url), "env", make_cache()).blocks == 4
    with pytest.raises(TamperedShadowError):
        load_manifest(open_store(store_url), "env", key=KEY)


def test_unsigned_local_shadow_recovers_and_the_writer_warns_once(store_url, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="shadow"):
        cache = make_cache()
        add_blocks(cache, range(4))
        with CacheShadow(cache, store_url, "plain", config=MANUAL) as sh:
            sh.shadow_now()
            sh.shadow_now()
    warned = [r for r in caplog.records if "unauthenticated" in r.getMessage()]
    assert len(warned) == 1 and KEY_ENV in warned[0].getMessage()
    assert "mac" not in json.loads((tmp_path / "shadow" / "plain" / "manifest.json").read_bytes())
    assert recover_session(open_store(store_url), "plain", make_cache()).blocks == 4


def test_the_unsigned_warning_is_said_once_per_store_not_per_session(store_url, caplog):
    """A vLLM server opens one writer per format and session on every start."""
    with caplog.at_level(logging.WARNING, logger="shadow"):
        for session in ("fmt-a", "fmt-b", "fmt-c"):
            cache = make_cache()
            add_blocks(cache, range(2))
            with CacheShadow(cache, store_url, session, config=MANUAL) as sh:
                sh.shadow_now()
    warned = [r for r in caplog.records if "unauthenticated" in r.getMessage()]
    assert len(warned) == 1 and "fmt-a" in warned[0].getMessage()


def test_tampered_index_is_refused_with_a_key(store_url, tmp_path):
    _shadow(store_url, "a", range(2), config=SIGNED)
    _edit(tmp_path / "shadow" / "index.json",
          lambda d: d["sessions"]["a"].update(num_blocks=99))
    with pytest.raises(TamperedShadowError, match=r"index\.json"):
        read_index(open_store(store_url), key=KEY)


def test_writer_with_a_key_refuses_to_overwrite_a_tampered_session(store_url, tmp_path):
    _shadow(store_url, "a", range(3), config=SIGNED)
    _edit(tmp_path / "shadow" / "a" / "manifest.json",
          lambda d: d["blocks"][0].update(tenant="mallory"))
    with pytest.raises(TamperedShadowError):
        CacheShadow(make_cache(), store_url, "a", config=SIGNED)


# ---------------------------------------------------------------- 3. validation first
#: A malformed block record costs that block only (issue 33: never another tenant's).
_BAD_RECORDS = {
    "importance above 1": lambda d: d["blocks"][0].update(importance=1.5),
    "importance not a number": lambda d: d["blocks"][0].update(importance="high"),
    "importance nan": lambda d: d["blocks"][0].update(importance=float("nan")),
    "tenant with newline": lambda d: d["blocks"][0].update(tenant="a\nb"),
    "empty tenant": lambda d: d["blocks"][0].update(tenant=""),
    "pinned not a bool": lambda d: d["blocks"][0].update(pinned="yes"),
    "negative tokens": lambda d: d["blocks"][0].update(num_tokens=-1),
    "too many tokens": lambda d: d["blocks"][0].update(num_tokens=10**9),
    "reversed token range": lambda d: d["blocks"][0].update(token_range=[8, 4]),
    "offset a string": lambda d: d["blocks"][0]["offsets"].update(k_packed="0"),
    "offset a float": lambda d: d["blocks"][0]["offsets"].update(k_packed=0.5),
    "negative checksum": lambda d: d["blocks"][0]["checksums"].update(k_norms=-1),
    "short key": lambda d: d["blocks"][0].update(key="abcd"),
    "source layer a number": lambda d: d["blocks"][0].update(source_layer=5),
    "record not an object": lambda d: d["blocks"].__setitem__(0, [1, 2]),
    "record without a tenant": lambda d: d["blocks"][0].pop("tenant"),
}
#: A malformed manifest is refused whole, before anything is allocated.
_BAD_FIELDS = {
    "model_id an object": lambda d: d["identity"].update(model_id={}),
    "rotation_seed null": lambda d: d["identity"].update(rotation_seed=None),
    "num_layers a string": lambda d: d["identity"].update(num_layers="2"),
    "blob of another session": lambda d: d["segments"][0]["files"].update(
        k_packed="other/k_packed.bin"),
    "generation negative": lambda d: d.update(generation=-3),
    "blocks not a list": lambda d: d.update(blocks={"0": 1}),
}


@pytest.mark.parametrize("name", sorted(_BAD_RECORDS))
def test_malformed_block_record_is_skipped_alone_before_any_allocation(name, store_url,
                                                                       tmp_path):
    _shadow(store_url, "m", range(6))
    _edit(tmp_path / "shadow" / "m" / "manifest.json", _BAD_RECORDS[name])
    dst = make_cache()
    report = recover_session(open_store(store_url), "m", dst)
    [skipped] = report.skipped
    assert skipped.index == 0 and "blocks[0]" in skipped.reason and "\n" not in skipped.reason
    assert report.blocks == 5 and report.block_ids["m"][0] is None
    assert dst.num_used(Tier.HOST) == len(dst.metadata) == 5


@pytest.mark.parametrize("name", sorted(_BAD_FIELDS))
def test_malformed_manifest_field_is_a_typed_error_before_any_allocation(name, store_url,
                                                                         tmp_path):
    _shadow(store_url, "m", range(6))
    _edit(tmp_path / "shadow" / "m" / "manifest.json", _BAD_FIELDS[name])
    dst = make_cache()
    with pytest.raises((CorruptShadowError, CacheIdentityError)) as err:
        recover_session(open_store(store_url), "m", dst)
    assert "\n" not in str(err.value)
    assert _host_is_whole(dst)


class _FailingReads(MeteredStore):
    """The real local store, whose reads fail after ``ok`` successful ones (a dying disk)."""

    def __init__(self, inner, ok: int) -> None:
        super().__init__(inner)
        self.ok = ok

    def read_into(self, key, offset, buffer):
        if self.ok <= 0:
            raise ShadowStoreError(f"{key}: I/O error (simulated)")
        self.ok -= 1
        return super().read_into(key, offset, buffer)


def test_blocks_imported_before_a_failure_are_released(store_url):
    _shadow(store_url, "half", range(12))
    dst = make_cache()
    add_blocks(dst, range(100, 103))  # blocks of another session stay
    store = _FailingReads(open_store(store_url), ok=8)  # two chunks of four tensors
    with pytest.raises(ShadowStoreError, match="simulated"):
        recover_session(store, "half", dst, chunk_bytes=4 * SMALL.bytes_per_block)
    assert len(dst.metadata) == 3 == dst.num_used(Tier.HOST)
    assert dst.num_free(Tier.HOST) + dst.num_used(Tier.HOST) == dst.capacity(Tier.HOST)


# ---------------------------------------------------------------- 4. debris and leases
def test_writer_holds_a_lease_refreshed_on_each_shadow_and_dropped_on_close(store_url,
                                                                            tmp_path):
    cache = make_cache()
    add_blocks(cache, range(2))
    lease_path = tmp_path / "shadow" / "w" / LEASE_NAME
    sh = CacheShadow(cache, store_url, "w", config=MANUAL)
    first = json.loads(lease_path.read_bytes())
    assert first["pid"] == os.getpid() and first["host"] and first["ttl_s"] > 0
    time.sleep(0.01)
    sh.shadow_now()
    assert json.loads(lease_path.read_bytes())["heartbeat"] > first["heartbeat"]
    sh.close()
    assert not lease_path.exists()


def test_recovery_sweep_spares_live_writers_and_cleans_dead_ones(store_url, tmp_path):
    root = tmp_path / "shadow"
    _shadow(store_url, "dead", range(4))
    live_cache = make_cache()
    add_blocks(live_cache, range(20, 24))
    live = CacheShadow(live_cache, store_url, "live", config=MANUAL)
    live.shadow_now()
    for sid in ("dead", "live"):
        (root / sid / "seg-000009.k_packed.bin").write_bytes(b"x" * 64)
        (root / sid / "v_norms.bin.tmp-999-0badf00d").write_bytes(b"half")
    (root / "orphan").mkdir()
    (root / "orphan" / "k_packed.bin").write_bytes(b"no manifest")
    (root / "index.json.tmp-999-0badf00d").write_bytes(b"{")
    store = open_store(store_url)
    swept = sweep_debris(store, older_than_seconds=0)
    assert sorted(swept.deleted) == ["dead/seg-000009.k_packed.bin",
                                     "dead/v_norms.bin.tmp-999-0badf00d",
                                     "index.json.tmp-999-0badf00d", "orphan/k_packed.bin"]
    assert swept.live_sessions == ["live"]
    assert (root / "live" / "seg-000009.k_packed.bin").exists()
    assert (root / "live" / "v_norms.bin.tmp-999-0badf00d").exists()
    assert recover_session(store, "dead", make_cache()).blocks == 4
    assert recover_session(store, "live", make_cache()).blocks == 4
    # a writer that died without closing: its lease goes stale after its TTL
    lease = json.loads((root / "live" / LEASE_NAME).read_bytes())
    lease["heartbeat"] -= 10 * lease["ttl_s"]
    (root / "live" / LEASE_NAME).write_text(json.dumps(lease))
    swept = sweep_debris(store, older_than_seconds=0)
    assert "live/seg-000009.k_packed.bin" in swept.deleted and not swept.live_sessions
    assert recover_session(store, "live", make_cache()).blocks == 4
    live.close()


def test_sweep_leaves_a_session_whose_manifest_it_cannot_trust(store_url, tmp_path):
    _shadow(store_url, "signed", range(3), config=SIGNED)
    extra = tmp_path / "shadow" / "signed" / "seg-000007.k_packed.bin"
    extra.write_bytes(b"?")
    swept = sweep_debris(open_store(store_url), older_than_seconds=0)  # no key: cannot verify
    assert extra.exists() and "signed" in swept.untrusted
    swept = sweep_debris(open_store(store_url), key=KEY, older_than_seconds=0)
    assert not extra.exists() and swept.deleted == ["signed/seg-000007.k_packed.bin"]


# ---------------------------------------------------------------- 5. stores that are not there
def test_reading_a_missing_local_store_is_an_error_writing_creates_it(tmp_path):
    missing = f"file://{tmp_path / 'nope' / 'dir'}"
    with pytest.raises(ShadowStoreError, match=r"no shadow store at .*check the path"):
        open_store(missing, create=False)
    assert not (tmp_path / "nope").exists()
    _shadow(missing, "s", range(2))
    assert [i.session_id for i in shadow.discover_sessions(open_store(missing, create=False))] \
        == ["s"]


def test_recover_sweep_never_deletes_files_that_are_not_shadow_blobs(tmp_path) -> None:
    from contextkit.cli.commands import main

    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "main.py").write_text("x")
    (tmp_path / "agent-1").mkdir()
    (tmp_path / "agent-1" / "notes.bin").write_text("y")
    (tmp_path / "agent-1" / "deep").mkdir()
    (tmp_path / "agent-1" / "deep" / "k_packed.bin").write_text("z")
    main(["recover", "--store", str(tmp_path), "--no-progress"])
    assert (tmp_path / "project" / "main.py").read_text() == "x"
    assert (tmp_path / "agent-1" / "notes.bin").read_text() == "y"
    assert (tmp_path / "agent-1" / "deep" / "k_packed.bin").read_text() == "z"
