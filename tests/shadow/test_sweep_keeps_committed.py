"""Issue 53 item 1: recovery never deletes what a commit record names.

A session whose ``head.json`` or ``index.json`` records a commit, but whose manifest
is missing (or not a file), is reported and left untouched by the debris sweep, on
``file://`` and ``s3://`` stores; only what the sweep can prove is debris goes.
"""

from __future__ import annotations

import json

import pytest
from shadow_testkit import BUCKET, KEY, MEDIUM, add_blocks, make_cache

from shadow import (
    KEY_ENV,
    CacheShadow,
    ShadowConfig,
    StoreConfig,
    discover_sessions,
    open_store,
    recover_session,
)
from shadow.debris import sweep_debris

MANUAL = ShadowConfig(autostart=False)
SIGNED = ShadowConfig(autostart=False, auth_key=KEY)


def _shadow(store, sid, serials, config=MANUAL, identity=None):
    cache = make_cache(identity) if identity is not None else make_cache()
    add_blocks(cache, serials)
    with CacheShadow(cache, store, sid, config=config) as sh:
        sh.shadow_now()


def _segments(store, sid):
    return sorted(k for k in store.list(f"{sid}/") if "_packed" in k or "_norms" in k)


# ---------------------------------------------------------------- file://
def test_sweep_keeps_a_committed_session_whose_manifest_is_missing(store_url, tmp_path):
    _shadow(store_url, "s", range(4))
    store = open_store(store_url)
    before = _segments(store, "s")
    assert before
    manifest = tmp_path / "shadow" / "s" / "manifest.json"
    saved = manifest.read_bytes()
    manifest.unlink()
    swept = sweep_debris(store, older_than_seconds=0)
    assert _segments(store, "s") == before and not swept.deleted
    assert "s" in swept.missing_manifest
    assert swept.to_dict()["missing_manifest"] == ["s"]
    # the manifest restored from a backup recovers every block
    manifest.write_bytes(saved)
    assert recover_session(store, "s", make_cache()).blocks == 4


def test_sweep_keeps_a_session_whose_manifest_is_a_directory(store_url, tmp_path):
    _shadow(store_url, "s", range(3))
    store = open_store(store_url)
    before = _segments(store, "s")
    manifest = tmp_path / "shadow" / "s" / "manifest.json"
    manifest.unlink()
    manifest.mkdir()
    swept = sweep_debris(store, older_than_seconds=0)
    assert _segments(store, "s") == before and not swept.deleted
    assert "s" in swept.untrusted + swept.missing_manifest


def test_sweep_keeps_a_session_only_the_index_records(store_url, tmp_path):
    _shadow(store_url, "s", range(3))
    store = open_store(store_url)
    before = _segments(store, "s")
    (tmp_path / "shadow" / "s" / "manifest.json").unlink()
    (tmp_path / "shadow" / "s" / "head.json").unlink()
    swept = sweep_debris(store, older_than_seconds=0)
    assert _segments(store, "s") == before and swept.missing_manifest == ["s"]


def test_sweep_keeps_manifestless_sessions_when_the_index_is_unreadable(store_url, tmp_path):
    root = tmp_path / "shadow"
    (root / "first").mkdir(parents=True)
    (root / "first" / "k_packed.bin").write_bytes(b"never committed?")
    (root / "index.json").write_text("{not json")
    swept = sweep_debris(open_store(store_url), older_than_seconds=0)
    assert (root / "first" / "k_packed.bin").exists() and swept.missing_manifest == ["first"]


def test_sweep_still_removes_a_first_shadow_that_never_committed(store_url, tmp_path):
    _shadow(store_url, "kept", range(2))
    root = tmp_path / "shadow"
    (root / "first").mkdir()
    (root / "first" / "seg-000000-0123456789abcdef.k_packed.bin").write_bytes(b"x")
    swept = sweep_debris(open_store(store_url), older_than_seconds=0)
    assert swept.deleted == ["first/seg-000000-0123456789abcdef.k_packed.bin"]
    assert not swept.missing_manifest


def test_status_lists_a_committed_session_whose_manifest_is_missing(store_url, tmp_path):
    _shadow(store_url, "s", range(2))
    (tmp_path / "shadow" / "s" / "manifest.json").unlink()
    infos = discover_sessions(open_store(store_url))
    assert [i.session_id for i in infos] == ["s"]
    assert "missing" in infos[0].error and "head.json" in infos[0].error


def test_recover_cli_deletes_nothing_and_says_so(store_url, tmp_path, capsys):
    from contextkit.cli.commands import main

    _shadow(store_url, "s", range(4))
    _shadow(store_url, "ok", range(10, 12))
    root = tmp_path / "shadow"
    saved = (root / "s" / "manifest.json").read_bytes()
    (root / "s" / "manifest.json").unlink()
    files = sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())
    code = main(["recover", "--store", store_url, "--no-progress", "--json"])
    out = capsys.readouterr().out
    assert code == 1  # a session not recovered, as for any refused one
    assert sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file()) == files
    line = next(x for x in out.splitlines() if x.strip().startswith("s:"))
    assert "missing" in line and "nothing" in line and "deleted" in line
    summary = json.loads(out.splitlines()[-1])
    assert summary["debris"]["missing_manifest"] == ["s"] and summary["debris"]["deleted"] == 0
    assert summary["sessions"] == 1 and "s" in summary["errors"]
    (root / "s" / "manifest.json").write_bytes(saved)
    assert recover_session(open_store(store_url), "s", make_cache()).blocks == 4


# ---------------------------------------------------------------- s3://
@pytest.fixture
def s3_store(s3_endpoint, request):
    store = open_store(f"s3://{BUCKET}/{request.node.name}", StoreConfig(endpoint_url=s3_endpoint))
    yield store
    store.close()


def test_sweep_over_s3_keeps_a_committed_session_whose_manifest_is_missing(s3_store):
    _shadow(s3_store, "s", range(4), config=SIGNED, identity=MEDIUM)
    before = _segments(s3_store, "s")
    saved = s3_store.get("s/manifest.json")
    s3_store.delete("s/manifest.json")
    swept = sweep_debris(s3_store, key=KEY, older_than_seconds=0)
    assert _segments(s3_store, "s") == before and not swept.deleted
    assert swept.missing_manifest == ["s"]
    s3_store.put("s/manifest.json", saved)
    assert recover_session(s3_store, "s", make_cache(MEDIUM), key=KEY).blocks == 4


def test_recover_cli_over_s3_deletes_nothing_and_says_so(s3_store, s3_endpoint, monkeypatch,
                                                         capsys):
    from contextkit.cli.commands import main

    _shadow(s3_store, "s", range(3), config=SIGNED, identity=MEDIUM)
    s3_store.delete("s/manifest.json")
    before = s3_store.list()
    monkeypatch.setenv(KEY_ENV, KEY.decode())
    code = main(["recover", "--store", s3_store.url, "--endpoint-url", s3_endpoint,
                 "--no-progress"])
    out = capsys.readouterr().out
    assert code == 1 and s3_store.list() == before
    assert any(x.strip().startswith("s:") and "missing" in x for x in out.splitlines())

