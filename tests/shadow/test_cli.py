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


# ---------------------------------------------------------------- issue 19
def _main(argv, capsys):
    from contextkit.cli.commands import main

    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_recover_of_a_missing_local_store_is_one_line_and_non_zero(tmp_path, capsys):
    missing = tmp_path / "nonexistent" / "dir"
    code, out, err = _main(["recover", "--store", f"file://{missing}", "--no-progress"], capsys)
    assert code != 0
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "no shadow store at" in lines[0]
    assert not missing.exists()


def test_recover_reports_malformed_identity_as_one_line_per_session(store_url, tmp_path,
                                                                   capsys):
    import json

    for sid in ("model", "seed", "fine"):
        cache = make_cache()
        add_blocks(cache, range(3))
        with CacheShadow(cache, store_url, sid, config=ShadowConfig(autostart=False)) as sh:
            sh.shadow_now()
    for sid, field, value in (("model", "model_id", {}), ("seed", "rotation_seed", None)):
        path = tmp_path / "shadow" / sid / "manifest.json"
        doc = json.loads(path.read_bytes())
        doc["identity"][field] = value
        path.write_text(json.dumps(doc))
    code, out, err = _main(["recover", "--store", store_url, "--no-progress", "--json"], capsys)
    assert code == 1 and "Traceback" not in out + err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["blocks"] == 3 and summary["session_ids"] == ["fine"]
    assert "model_id" in summary["errors"]["model"]
    assert "rotation_seed" in summary["errors"]["seed"]


def test_recover_says_whether_the_store_is_authenticated_and_sweeps(store_url, tmp_path,
                                                                    capsys, monkeypatch):
    import pytest
    from shadow_testkit import KEY

    from shadow import TamperedShadowError

    cache = make_cache()
    add_blocks(cache, range(4))
    with CacheShadow(cache, store_url, "s", config=ShadowConfig(autostart=False)) as sh:
        sh.shadow_now()
    (tmp_path / "shadow" / "s" / "seg-000005.k_packed.bin").write_bytes(b"debris")
    code, out, _ = _main(["recover", "--store", store_url, "--no-progress",
                          "--debris-age", "0"], capsys)
    assert code == 0 and "unauthenticated" in out
    assert not (tmp_path / "shadow" / "s" / "seg-000005.k_packed.bin").exists()
    assert "swept 1" in out

    monkeypatch.setenv("CONTEXTKIT_SHADOW_KEY", KEY.decode())
    # the unsigned session is now refused (its MAC is missing), by the writer and recovery
    with pytest.raises(TamperedShadowError):
        CacheShadow(cache, store_url, "s", config=ShadowConfig(autostart=False))
    code, out, _ = _main(["recover", "--store", store_url, "--no-progress"], capsys)
    assert code == 1 and "carries no MAC" in out
    signed = f"file://{tmp_path / 'signed'}"
    with CacheShadow(cache, signed, "s", config=ShadowConfig(autostart=False)) as sh:
        sh.shadow_now()
    code, out, _ = _main(["recover", "--store", signed, "--no-progress"], capsys)
    assert code == 0 and "authenticated (HMAC-SHA256" in out and "unauthenticated" not in out


def test_recover_of_an_unsigned_s3_store_needs_the_flag(s3_endpoint, request, capsys):
    import json

    from shadow_testkit import BUCKET, MEDIUM

    url = f"s3://{BUCKET}/{request.node.name}"
    cache = make_cache(MEDIUM)
    add_blocks(cache, range(3))
    from shadow import StoreConfig

    with CacheShadow(cache, url, "plain", config=ShadowConfig(autostart=False),
                     store_config=StoreConfig(endpoint_url=s3_endpoint)) as sh:
        sh.shadow_now()
    argv = ["recover", "--store", url, "--endpoint-url", s3_endpoint, "--no-progress", "--json"]
    code, out, err = _main(argv, capsys)
    summary = json.loads(out.strip().splitlines()[-1])
    assert code == 1 and summary["blocks"] == 0 and "Traceback" not in out + err
    assert "--allow-unauthenticated" in summary["errors"]["plain"]
    code, out, _ = _main([*argv, "--allow-unauthenticated"], capsys)
    summary = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and summary["blocks"] == 3 and "unauthenticated" in out


def test_recover_of_s3_without_credentials_is_one_line(s3_endpoint, capsys,
                                                        no_aws_credentials):
    code, out, err = _main(["recover", "--store", "s3://ck-shadow/x", "--endpoint-url",
                            s3_endpoint, "--no-progress"], capsys)
    assert code != 0 and "Traceback" not in out + err
    assert len(err.strip().splitlines()) == 1 and "AWS_ACCESS_KEY_ID" in err


def test_status_and_recover_say_unsigned_and_the_one_step_to_sign(store_url, capsys,
                                                                   monkeypatch):
    """Issue 33, item 9: unsigned stays the file:// default, and users see what it means."""
    import argparse

    from shadow_testkit import KEY

    from contextkit.cli.status import run_status

    cache = make_cache()
    add_blocks(cache, range(2))
    with CacheShadow(cache, store_url, "s", config=ShadowConfig(autostart=False)) as sh:
        sh.shadow_now()
    step = "export CONTEXTKIT_SHADOW_KEY=$(openssl rand -hex 32)"
    status = argparse.Namespace(store=store_url, endpoint_url=None, json=False, tenant=None,
                                tier_status=None, metrics=None)
    run_status(status)
    out = capsys.readouterr().out
    assert "unsigned" in out and step in out and "can change what is recovered" in out
    code, out, _ = _main(["recover", "--store", store_url, "--no-progress"], capsys)
    assert code == 0 and "unsigned" in out and step in out

    monkeypatch.setenv("CONTEXTKIT_SHADOW_KEY", KEY.decode())
    signed = store_url + "-signed"
    with CacheShadow(cache, signed, "s", config=ShadowConfig(autostart=False)) as sh:
        sh.shadow_now()
    run_status(argparse.Namespace(**{**vars(status), "store": signed}))
    out = capsys.readouterr().out
    assert "every block" in out and "unsigned" not in out and step not in out
