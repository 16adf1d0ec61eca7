"""``contextkit recover`` logic: shadow/cli.py."""

from __future__ import annotations

import argparse

from shadow_testkit import add_blocks, make_cache

from shadow import CacheShadow, ShadowConfig
from shadow.cli import add_recover_arguments, default_store_url, run_recover


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_recover_arguments(parser)
    return parser.parse_args(argv)


def test_recover_builds_a_cache_from_the_manifest_and_summarizes(store_url, tmp_path, capsys):
    cache = make_cache()
    add_blocks(cache, range(12))
    with CacheShadow(cache, store_url, "s1", config=ShadowConfig(autostart=False)) as sh:
        sh.shadow_now()
    (tmp_path / "shadow" / "broken").mkdir()
    (tmp_path / "shadow" / "broken" / "manifest.json").write_text("{")
    summary = run_recover(_parse(["--store", store_url, "--no-progress"]))
    assert summary["sessions"] == 1 and summary["blocks"] == 12
    assert summary["bytes"] == 12 * cache.bytes_per_block and summary["skipped"] == 0
    assert "broken" in summary["errors"]
    out = capsys.readouterr().out
    assert "recovered 1 session(s)" in out and "12 blocks" in out and "broken" in out


def test_recover_into_a_given_cache_and_one_session(store_url):
    for sid in ("a", "b"):
        cache = make_cache()
        add_blocks(cache, range(5) if sid == "a" else range(5, 8))
        with CacheShadow(cache, store_url, sid, config=ShadowConfig(autostart=False)) as sh:
            sh.shadow_now()
    target = make_cache()
    summary = run_recover(_parse(["--store", store_url, "--session", "b", "--no-progress"]),
                          cache=target)
    assert summary["session_ids"] == ["b"] and len(target.metadata) == 3


def test_default_store_url_follows_the_environment(monkeypatch):
    monkeypatch.setenv("CONTEXTKIT_SHADOW_URL", "s3://bucket/x")
    assert default_store_url() == "s3://bucket/x"
    monkeypatch.delenv("CONTEXTKIT_SHADOW_URL")
    assert default_store_url().endswith("/.cache/contextkit/shadow")
    assert default_store_url().startswith("file://")


def test_key_offsets_travel_with_the_session_and_are_checked(store_url, tmp_path):
    import dataclasses
    import json

    import pytest
    import torch
    from shadow_testkit import SMALL

    from gpu_cache import CacheConfig, TQGPUCache
    from gpu_cache.calibration import key_offset_digest
    from shadow import CorruptShadowError, load_manifest, open_store

    offsets = torch.randn(SMALL.num_layers, SMALL.num_kv_heads, SMALL.head_dim)
    identity = dataclasses.replace(SMALL, key_offset_digest=key_offset_digest(offsets))
    cache = TQGPUCache(identity, CacheConfig(num_device_blocks=8, num_host_blocks=64),
                       key_offsets=offsets)
    add_blocks(cache, range(4))
    with CacheShadow(cache, store_url, "centered", config=ShadowConfig(autostart=False)) as sh:
        sh.shadow_now()
    summary = run_recover(_parse(["--store", store_url, "--no-progress"]))
    assert summary["blocks"] == 4 and not summary["errors"]
    manifest = load_manifest(open_store(store_url), "centered")
    assert torch.equal(manifest.key_offsets_tensor(), offsets)

    # Offsets that do not match the identity's digest make the manifest untrustworthy.
    path = tmp_path / "shadow" / "centered" / "manifest.json"
    doc = json.loads(path.read_text())
    import base64

    doc["key_offsets"] = base64.b64encode((offsets + 1).numpy().tobytes()).decode()
    path.write_text(json.dumps(doc))
    with pytest.raises(CorruptShadowError, match="key offsets"):
        load_manifest(open_store(store_url), "centered")
