"""The connector's store with blocks of several formats: pools, key offsets, their
shadows, the recovery job over them and refusals (no vLLM needed)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpu_cache import hash_token_blocks
from gpu_cache.calibration import key_offset_digest, mean_key_offsets
from integrations.vllm.config import ConnectorConfig
from integrations.vllm.identity import same_model, vllm_cache_identity
from integrations.vllm.pools import pool_identity
from integrations.vllm.precision import BlockLabel
from integrations.vllm.recovery import recover_for_vllm
from integrations.vllm.store import (
    ConnectorStore,
    local_session_keys,
    shadow_manifest,
    shadow_manifests,
)

BS, LAYERS, HEADS, DIM = 16, 2, 2, 64
FP16_BYTES_PER_TOKEN = 2 * 2 * LAYERS * HEADS * DIM


def _config(tmp: Path, **kw: object) -> ConnectorConfig:
    return ConnectorConfig(block_size=BS, shadow_url=f"file://{tmp / 'shadow'}",
                           local_store=f"file://{tmp / 'local'}", host_blocks=64,
                           shadow_on_save=False, **kw)  # type: ignore[arg-type]


def _kv(n: int, seed: int = 0, key_mean: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K/V; with ``key_mean`` the keys share a large per-head mean (as real keys do)."""
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, n, BS, HEADS, DIM)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    if key_mean:
        k = k + key_mean * torch.randn((LAYERS, 1, 1, HEADS, DIM), generator=g)
    return k, v


def _keys(store: ConnectorStore, n: int, tenant: str = "default", offset: int = 0
          ) -> list[bytes]:
    return [bytes(key) for key in hash_token_blocks(store.identity.digest(), tenant,
                             list(range(offset, offset + n * BS)), BS)]


def _labels(*fmts: str) -> list[BlockLabel]:
    return [BlockLabel("memories", 0.5, fmt=fmt) for fmt in fmts]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _mixed_store(model: Path, tmp: Path) -> tuple[ConnectorStore, list[bytes], torch.Tensor]:
    """A shadowed store holding one request of 13 blocks: an fp16 sink, two int8 blocks,
    nine tq4 blocks (enough to calibrate the tq4 offsets) and a native one."""
    store = ConnectorStore(vllm_cache_identity(str(model), BS), _config(tmp))
    store.open_shadow(restored=False)
    k, v = _kv(13, seed=3, key_mean=4.0)
    keys = _keys(store, 13, tenant="acme")
    fmts = ("fp16", "int8", "int8", *["tq4"] * 9, "native")
    result = store.save(k, v, keys, "acme", _labels(*fmts))
    assert result.stored == keys and result.failed == []
    store.shadow_now()
    return store, keys, k


def test_same_model_ignores_only_the_block_format(model: Path) -> None:
    base = vllm_cache_identity(str(model), BS)
    assert same_model(base, dataclasses.replace(base, codec="int8",
                                                key_offset_digest="ab" * 8)) == []
    assert same_model(base, dataclasses.replace(base, block_size=32, codec="fp16")) == [
        "block_size"]
    assert same_model(base, dataclasses.replace(base, model_id="other",
                                                tokenizer_id="t")) == ["model_id",
                                                                       "tokenizer_id"]


def test_mixed_formats_read_back_within_each_formats_bounds(model: Path,
                                                            tmp_path: Path) -> None:
    store = ConnectorStore(vllm_cache_identity(str(model), BS), _config(tmp_path))
    k, v = _kv(6, seed=1)
    keys = _keys(store, 6)
    # interleaved formats: each block to its pool, the read reassembles key order
    result = store.save(k, v, keys, "default",
                        _labels("fp16", "tq4", "native", "int8", "tq4", "k5v4"))
    assert result.stored == keys and result.failed == [] and result.removed == []
    got = store.read(keys, "default")
    assert got is not None
    k2, v2 = got
    assert k2.shape == v2.shape == (LAYERS, 6, BS, HEADS, DIM) and k2.dtype == torch.float32
    for x, y in ((k, k2), (v, v2)):
        assert torch.equal(y[:, 0], x[:, 0].half().float())  # fp16: its rounding, nothing else
        assert torch.equal(y[:, 2], x[:, 2])  # native: exact
        assert _rel(y[:, 3], x[:, 3]) < 1e-2  # int8
        for i in (1, 4):  # tq4
            cos = torch.nn.functional.cosine_similarity(y[:, i].reshape(-1, DIM),
                                                        x[:, i].reshape(-1, DIM), dim=-1)
            assert float(cos.mean()) > 0.99 and _rel(y[:, i], x[:, i]) > 1e-2
    # k5v4: keys between tq4 and int8, values as tq4
    assert 1e-2 < _rel(k2[:, 5], k[:, 5]) < 0.6 * _rel(k2[:, 1], k[:, 1])
    assert 0.5 * _rel(v2[:, 1], v[:, 1]) < _rel(v2[:, 5], v[:, 5]) < 2 * _rel(v2[:, 1], v[:, 1])
    # the connector's form: one part per pool, copied into vLLM's pages as it is
    parts = store.read_parts(keys, "default")
    assert sorted(p for positions, _, _ in parts for p in positions) == list(range(6))
    assert len(parts) == 5  # fp16, tq4, native, int8, k5v4
    for positions, pk, pv in parts:
        assert torch.equal(pk, k2[:, positions]) and torch.equal(pv, v2[:, positions])
    assert store.read_parts([b"\0" * 32, *keys], "default") == []
    # a prefix held across pools stops at the first key not held
    part = store.read([*keys[:3], b"\0" * 32, keys[4]], "default")
    assert part is not None and part[0].shape[1] == 3
    assert torch.equal(part[0], k2[:, :3]) and torch.equal(part[1], v2[:, :3])

    stats = store.format_stats()
    assert {fmt: row["blocks"] for fmt, row in stats.items()} == {
        "fp16": 1, "int8": 1, "native": 1, "tq4": 2, "k5v4": 1}
    for fmt, per_token_head in (("fp16", 128), ("int8", 68), ("native", 256), ("tq4", 36),
                                ("k5v4", 40)):
        row = stats[fmt]
        want = 2 * LAYERS * HEADS * per_token_head
        assert row["bytes_per_token"] == want and row["bytes"] == want * BS * row["blocks"]
        assert row["vs_fp16"] == want / FP16_BYTES_PER_TOKEN
    assert stats["fp16"]["vs_fp16"] == 1.0


def test_exported_parts_decode_straight_into_vllm_cpu_pages(model: Path,
                                                            tmp_path: Path) -> None:
    """The connector's load path: each pool's exported blocks, decoded layer by layer
    into the rows of vLLM's CPU pages (fused kernels for the tq4 part: 9 blocks), write
    the pages that reading the blocks and joining them into pages writes."""
    from integrations.vllm.layout import CPU_LAYOUT
    from integrations.vllm.pools import decode_pool_layer_into

    store, keys, _ = _mixed_store(model, tmp_path)
    assert store.cache.codec.fused_cpu(torch.device("cpu"), 9 * BS * HEADS)
    page_of = [17 - i for i in range(13)]  # vLLM's block ids, descending
    got = [torch.zeros(20, HEADS, BS, 2 * DIM) for _ in range(LAYERS)]
    want = [torch.zeros(20, HEADS, BS, 2 * DIM) for _ in range(LAYERS)]
    parts = store.export_parts(keys, "acme")
    assert len(parts) == 4 and sorted(p for _, pos, _ in parts for p in pos) == list(range(13))
    for pool, positions, data in parts:
        ids = torch.tensor([page_of[i] for i in positions])
        k_rows, v_rows = CPU_LAYOUT.rows(ids, HEADS, BS)  # type: ignore[misc]
        for layer in range(LAYERS):
            decode_pool_layer_into(pool, data, layer, got[layer].view(-1, DIM), k_rows, v_rows)
    for positions, k, v in store.read_parts(keys, "acme"):
        ids = torch.tensor([page_of[i] for i in positions])
        for layer in range(LAYERS):
            CPU_LAYOUT.pages(want[layer]).index_copy_(0, ids, CPU_LAYOUT.join(
                k[layer].permute(0, 2, 1, 3), v[layer].permute(0, 2, 1, 3)))
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-5) and float(w.abs().sum()) > 0
    assert store.export_parts(keys, "intruder") == []  # another tenant's keys load nothing


def test_unknown_format_in_a_label_is_one_line_and_stores_nothing(model: Path,
                                                                  tmp_path: Path) -> None:
    store = ConnectorStore(vllm_cache_identity(str(model), BS), _config(tmp_path))
    k, v = _kv(2)
    with pytest.raises(ValueError, match="tq3") as err:
        store.save(k, v, _keys(store, 2), "default", _labels("tq4", "tq3"))
    assert "\n" not in str(err.value)
    assert store.keys() == []


def test_key_offsets_calibrated_on_the_first_big_save_and_persisted(
        model: Path, tmp_path: Path) -> None:
    config = _config(tmp_path)
    store = ConnectorStore(vllm_cache_identity(str(model), BS), config)
    store.open_shadow(restored=False)
    k, v = _kv(12, seed=2, key_mean=4.0)
    small, big = _keys(store, 2, offset=0), _keys(store, 10, offset=10_000)
    # a small save before calibration goes to the plain pool (the old session)
    store.save(k[:, :2], v[:, :2], small, "default", _labels("tq4", "tq4"))
    assert list(store.pools) == [""]
    store.save(k[:, 2:], v[:, 2:], big, "default", _labels(*["tq4"] * 10))
    want = mean_key_offsets([k[layer, 2:].reshape(-1, HEADS, DIM).transpose(0, 1)
                             for layer in range(LAYERS)])
    digest = key_offset_digest(want)
    assert list(store.pools) == ["", f"@tq4.{digest[:8]}"]
    pool = store.pools[f"@tq4.{digest[:8]}"]
    assert pool.identity.key_offset_digest == digest
    assert pool.cache.key_offsets is not None and torch.allclose(pool.cache.key_offsets, want)
    # keys come back as the keys, and centering helps keys with a large common mean
    k_big = store.read(big, "default")[0]  # type: ignore[index]
    plain = ConnectorStore(store.identity, _config(tmp_path / "plain"), key_offsets=False)
    plain.save(k[:, 2:], v[:, 2:], big, "default", _labels(*["tq4"] * 10))
    assert list(plain.pools) == [""]
    k_plain = plain.read(big, "default")[0]  # type: ignore[index]
    assert _rel(k_big, k[:, 2:]) < 0.7 * _rel(k_plain, k[:, 2:])
    # later saves of the format use the calibrated pool, whatever their size
    later = _keys(store, 1, offset=50_000)
    store.save(k[:, :1], v[:, :1], later, "default", _labels("tq4"))
    assert len(store.pools) == 2 and len(pool.cache.metadata) == 11

    store.shadow_now()
    sessions = {m.session_id: m for m in shadow_manifests(config)}
    assert set(sessions) == {"vllm", f"vllm@tq4.{digest[:8]}"}
    assert len(sessions["vllm"].blocks) == 2 and sessions["vllm"].key_offsets is None
    offsets = sessions[f"vllm@tq4.{digest[:8]}"].key_offsets_tensor()
    assert offsets is not None and torch.equal(offsets, want)
    merged = shadow_manifest(config)
    assert merged is not None and merged.session_id == "vllm"
    assert merged.identity == store.identity
    assert {bytes.fromhex(r.key) for r in merged.blocks if r.key} == {*small, *big, *later}
    store.close()

    summary = recover_for_vllm(str(model), config)
    assert summary["errors"] == {} and summary["snapshot_blocks"] == 13
    assert summary["formats"] == {"tq4": {"blocks": 13, "bytes": 13 * BS * 2 * LAYERS * HEADS * 36,
                                          "bytes_per_token": 2 * LAYERS * HEADS * 36,
                                          "vs_fp16": 36 / 128}}
    restarted = ConnectorStore(store.identity, config)
    report = restarted.restore_local()
    assert report is not None and report.blocks == 13
    assert set(restarted.pools) == set(store.pools)
    assert torch.equal(restarted.read(big, "default")[0], k_big)  # type: ignore[index]
    # the restored offset pool is the active one: no recalibration on the next big save
    restarted.save(*_kv(9, seed=9, key_mean=4.0), _keys(restarted, 9, offset=90_000),
                   "default", _labels(*["tq4"] * 9))
    assert set(restarted.pools) == set(store.pools)
    assert len(restarted.pools[f"@tq4.{digest[:8]}"].cache.metadata) == 20


def test_mixed_format_shadow_recovers_byte_for_byte(model: Path, tmp_path: Path) -> None:
    store, keys, _ = _mixed_store(model, tmp_path)
    config = store.config
    before = store.read(keys, "acme")
    assert before is not None and before[0].shape[1] == 13
    names = {m.session_id for m in shadow_manifests(config)}
    tq4 = next(name for name in store.pools if name.startswith("@tq4."))
    # the key identity's pool holds nothing: its session is never written
    assert names == {"vllm@fp16", "vllm@int8", f"vllm{tq4}", "vllm@native"}
    stats = store.format_stats()
    store.close()
    # closing writes the (empty) session of the key identity's pool, as before pools
    assert {m.session_id: len(m.blocks) for m in shadow_manifests(config)}["vllm"] == 0
    names.add("vllm")

    summary = recover_for_vllm(str(model), config)
    assert summary["errors"] == {} and summary["snapshot_blocks"] == 13
    assert {fmt: row["blocks"] for fmt, row in summary["formats"].items()} == {
        "fp16": 1, "int8": 2, "native": 1, "tq4": 9}
    assert summary["formats"] == stats
    total = sum(row["bytes"] for row in stats.values()) / (13 * BS)
    assert summary["bytes_per_token"] == total
    assert summary["vs_fp16"] == total / FP16_BYTES_PER_TOKEN
    assert sorted(local_session_keys(config.local_store, store.identity)) == sorted(keys)

    restarted = ConnectorStore(store.identity, config)
    report = restarted.restore_local()
    assert report is not None and report.blocks == 13 and report.errors == {}
    after = restarted.read(keys, "acme")
    assert after is not None
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    assert restarted.format_stats() == stats
    # the restart shadows incrementally into the same sessions, recovering nothing twice
    restarted.open_shadow(restored=True)
    generations = {m.session_id: m.generation for m in shadow_manifests(config)}
    assert set(generations) == names
    assert len(shadow_manifest(config).blocks) == 13  # type: ignore[union-attr]
    # a save shadows the pools it changed, and only those
    more = _keys(restarted, 1, tenant="acme", offset=70_000)
    restarted.save(*_kv(1, seed=7), more, "acme", _labels("tq4"))
    result = restarted.shadow_now()
    assert result is not None and result.session_id == f"vllm{tq4}"
    assert result.blocks_written == 1
    assert restarted.shadow_now() is None  # nothing changed since
    after_save = {m.session_id: m.generation for m in shadow_manifests(config)}
    assert {sid for sid in names if after_save[sid] != generations[sid]} == {f"vllm{tq4}"}
    # the merged view's generation moves with any session's commit (watchers poll it
    # to see a save land; vllm@int8 or the plain session may be at a higher one)
    assert shadow_manifest(config).generation == sum(after_save.values())  # type: ignore[union-attr]
    assert sum(after_save.values()) > sum(generations.values())
    restarted.close()


def test_server_without_the_recovery_job_recovers_every_pool_from_the_shadow(
        model: Path, tmp_path: Path) -> None:
    store, keys, _ = _mixed_store(model, tmp_path)
    before = store.read(keys, "acme")
    store.close()
    config = dataclasses.replace(store.config, local_store="")
    restarted = ConnectorStore(store.identity, config)
    restarted.open_shadow(restored=False)
    after = restarted.read(keys, "acme")
    assert after is not None and before is not None
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    restarted.close()


def _set_codec(manifest_path: Path, codec: str) -> None:
    doc = json.loads(manifest_path.read_text())
    doc["identity"]["codec"] = codec
    manifest_path.write_text(json.dumps(doc))


def test_a_session_of_an_unknown_format_is_refused_and_the_others_restore(
        model: Path, tmp_path: Path) -> None:
    store, keys, _ = _mixed_store(model, tmp_path)
    config = store.config
    store.close()
    # a newer contextkit wrote the int8 session in a format this one does not know
    _set_codec(tmp_path / "shadow" / "vllm@int8" / "manifest.json", "tq3")
    summary = recover_for_vllm(str(model), config)
    why = summary["errors"]["vllm@int8"]
    assert "'tq3'" in why and "format" in why and "\n" not in why
    assert set(summary["errors"]) == {"vllm@int8"}
    assert {fmt: row["blocks"] for fmt, row in summary["formats"].items()} == {
        "fp16": 1, "native": 1, "tq4": 9}
    restarted = ConnectorStore(store.identity, config)
    report = restarted.restore_local()
    assert report is not None and report.blocks == 11
    got = restarted.read(keys, "acme")
    assert got is not None and got[0].shape[1] == 1  # the chain breaks at the int8 block

    # the same refusal in the connector, for a snapshot session it cannot read
    _set_codec(tmp_path / "local" / "vllm-recovered@fp16" / "manifest.json", "tq3")
    again = ConnectorStore(store.identity, config)
    report = again.restore_local()
    assert report is not None and report.blocks == 10
    assert "tq3" in report.errors["vllm-recovered@fp16"]
    assert again.read(keys, "acme") is None  # the sink is gone: nothing from block 0
    assert sorted(local_session_keys(config.local_store, store.identity)) == sorted(
        keys[3:])


def test_a_snapshot_of_another_model_is_refused_in_every_pool(model: Path,
                                                              tmp_path: Path) -> None:
    store, _, _ = _mixed_store(model, tmp_path)
    config = store.config
    store.close()
    assert recover_for_vllm(str(model), config)["snapshot_blocks"] == 13
    other = ConnectorStore(vllm_cache_identity(str(model), BS, model_id="other"), config)
    assert other.restore_local() is None
    assert list(other.pools) == [""] and len(other.cache.metadata) == 0
    assert local_session_keys(config.local_store, other.identity) == []


def test_tenants_stay_isolated_across_pools(model: Path, tmp_path: Path) -> None:
    store = ConnectorStore(vllm_cache_identity(str(model), BS), _config(tmp_path))
    k, v = _kv(3)
    fmts = _labels("fp16", "int8", "tq4")
    for tenant in ("alice", "bob"):
        keys = _keys(store, 3, tenant=tenant)
        assert store.save(k, v, keys, tenant, fmts).stored == keys
    alice = _keys(store, 3, tenant="alice")
    assert store.read(alice, "bob") is None
    got = store.read(alice, "alice")
    assert got is not None and got[0].shape[1] == 3
    for pool in store.pools.values():
        assert {m.tenant_slug for m in pool.cache.metadata.all()} <= {"alice", "bob"}
    # a key of alice's in a non-sink pool is not bob's either, mid-prefix
    bob = _keys(store, 3, tenant="bob")
    part = store.read([bob[0], alice[1]], "bob")
    assert part is not None and part[0].shape[1] == 1


def test_recover_cli_prints_each_format_and_the_refused_session(
        model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from integrations.vllm.recovery import run_recover_for_vllm

    store, _, _ = _mixed_store(model, tmp_path)
    store.close()
    _set_codec(tmp_path / "shadow" / "vllm@fp16" / "manifest.json", "tq3")
    config = json.dumps(store.config.to_extra_config())
    summary = run_recover_for_vllm(argparse.Namespace(
        model=str(model), connector_config=config, store=None, session=None,
        endpoint_url=None, allow_unauthenticated=False))
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("recovered 4 session(s)") and "12 blocks" in out[0]
    assert "  int8: 2 blocks, 544 bytes/token (0.531 of fp16)" in out
    assert "  tq4: 9 blocks, 288 bytes/token (0.281 of fp16)" in out
    assert any(line.startswith("  vllm@fp16: ") and "'tq3'" in line for line in out)
    assert summary["snapshot_blocks"] == 12


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """A real S3 endpoint over HTTP: moto's threaded server on 127.0.0.1."""
    import boto3
    import moto.server as moto_server

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                 aws_secret_access_key="testing", region_name="us-east-1"
                 ).create_bucket(Bucket="formats")
    yield endpoint
    server.stop()


def test_signed_mixed_format_shadow_on_s3_recovers_and_refuses_a_resigned_unknown_format(
        model: Path, tmp_path: Path, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import boto3

    from shadow.auth import sign

    for var, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_DEFAULT_REGION", "us-east-1"), ("CONTEXTKIT_SHADOW_KEY", "k3y")):
        monkeypatch.setenv(var, value)
    config = ConnectorConfig(block_size=BS, shadow_url="s3://formats/run", host_blocks=64,
                             endpoint_url=s3_endpoint, local_store=f"file://{tmp_path / 'local'}",
                             shadow_on_save=False)
    store = ConnectorStore(vllm_cache_identity(str(model), BS), config)
    store.open_shadow(restored=False)
    k, v = _kv(12, seed=5, key_mean=4.0)
    keys = _keys(store, 12)
    store.save(k, v, keys, "default", _labels("fp16", *["tq4"] * 10, "int8"))
    store.shadow_now()
    before = store.read(keys, "default")
    store.close()
    manifests = shadow_manifests(config)
    assert all(m.authenticated for m in manifests)
    tq4 = next(m.session_id for m in manifests if m.identity.codec == "tq4" and m.blocks)
    # the one int8 block takes the offsets the tq4 blocks calibrated (same digest)
    int8 = "vllm@int8." + tq4.split(".")[1]
    assert {m.session_id for m in manifests} == {"vllm", "vllm@fp16", int8, tq4}

    # a newer contextkit, with the same key, wrote the int8 session in a format unknown here
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    path = f"run/{int8}/manifest.json"
    doc = json.loads(s3.get_object(Bucket="formats", Key=path)["Body"].read())
    doc.pop("mac")
    doc["identity"]["codec"] = "tq3"
    doc["mac"] = sign(doc, b"k3y", "manifest")
    s3.put_object(Bucket="formats", Key=path, Body=json.dumps(doc).encode())

    summary = recover_for_vllm(str(model), config)
    assert set(summary["errors"]) == {int8} and "'tq3'" in summary["errors"][int8]
    assert {fmt: row["blocks"] for fmt, row in summary["formats"].items()} == {
        "fp16": 1, "tq4": 10}
    restarted = ConnectorStore(store.identity, config)
    report = restarted.restore_local()
    assert report is not None and report.blocks == 11
    after = restarted.read(keys, "default")
    assert before is not None and after is not None and after[0].shape[1] == 11
    assert torch.equal(after[0], before[0][:, :11]) and torch.equal(after[1], before[1][:, :11])


def test_the_store_evicts_across_pools_by_semantic_priority(model: Path,
                                                            tmp_path: Path) -> None:
    # one byte budget for the whole store (host_blocks blocks of the key identity's
    # format): a save into one pool evicts the lowest-priority block of ANY pool
    config = dataclasses.replace(_config(tmp_path), host_blocks=8, shadow_url="")
    store = ConnectorStore(vllm_cache_identity(str(model), BS), config)
    budget = 8 * store.identity.bytes_per_block
    late = _keys(store, 2, offset=0)
    mid = _keys(store, 4, offset=10_000)
    front = _keys(store, 1, offset=20_000)
    assert store.save(*_kv(2, seed=1), late, "default",
                      [BlockLabel("current_time", 1.0, fmt="int8")] * 2).stored == late
    assert store.save(*_kv(4, seed=2), mid, "default",
                      [BlockLabel("memories", 0.9, fmt="tq4")] * 4).stored == mid
    # 2 int8 + 4 tq4 blocks fit; one tq4 block more does not: the oldest current_time
    # block (priority 10, in the int8 pool) goes, not a memory of the tq4 pool
    result = store.save(*_kv(1, seed=3), front, "default",
                        [BlockLabel("axioms", 1.0, fmt="tq4")])
    assert result.stored == front and result.failed == []
    (gone,) = result.removed  # one of the two (saved together: a tie)
    assert gone in late and result.removed_layers == ["current_time"]
    assert set(store.keys()) == {*late, *mid, *front} - {gone}
    held = sum(row["bytes"] for row in store.format_stats().values())
    assert held <= budget
    # a save that cannot fit even after every evictable block is gone fails cleanly
    big = _keys(store, 9, offset=30_000)
    result = store.save(*_kv(9, seed=4), big, "default",
                        [BlockLabel("axioms", 1.0, fmt="tq4")] * 9)
    assert result.stored == [] and result.failed == big
    assert sum(row["bytes"] for row in store.format_stats().values()) <= budget


def test_a_save_never_evicts_its_own_blocks_to_fit_the_budget(model: Path,
                                                              tmp_path: Path) -> None:
    # budget: 4 tq4 blocks of bytes; one save of an fp16 block (~3.6 tq4 blocks, the
    # lowest priority) then a tq4 one: the second group may not evict the first
    config = dataclasses.replace(_config(tmp_path), host_blocks=4, shadow_url="")
    store = ConnectorStore(vllm_cache_identity(str(model), BS), config)
    keys = _keys(store, 2)
    result = store.save(*_kv(2, seed=5), keys, "default",
                        [BlockLabel("current_time", 1.0, fmt="fp16"),
                         BlockLabel("axioms", 1.0, fmt="tq4")])
    assert result.stored == keys[:1] and result.failed == keys[1:] and result.removed == []
    assert store.keys() == keys[:1]
    held = sum(row["bytes"] for row in store.format_stats().values())
    assert held <= 4 * store.identity.bytes_per_block


# ---------------------------------------------------------------- precision that follows the budget
def _room(fmt: str, room: str | None, importance: float, n: int) -> list[BlockLabel]:
    return [BlockLabel("memories", importance, fmt=fmt, room_fmt=room)] * n


def _held(store: ConnectorStore) -> dict[str, int]:
    return {fmt: row["blocks"] for fmt, row in store.format_stats().items()}


def _budget_store(model: Path, tmp: Path, host_blocks: int) -> ConnectorStore:
    """An unshadowed store whose DDR budget is ``host_blocks`` tq4 blocks of bytes."""
    config = dataclasses.replace(_config(tmp), host_blocks=host_blocks, shadow_url="")
    return ConnectorStore(vllm_cache_identity(str(model), BS), config)


def test_blocks_are_stored_above_their_format_while_the_budget_has_room(
        model: Path, tmp_path: Path) -> None:
    store = _budget_store(model, tmp_path, 64)
    k, v = _kv(10, seed=11, key_mean=4.0)
    keys = _keys(store, 10)
    result = store.save(k, v, keys, "default", _room("tq4", "int8", 0.5, 10))
    assert result.stored == keys and result.removed == []
    assert _held(store) == {"int8": 10}
    got = store.read(keys, "default")
    assert got is not None
    assert _rel(got[0], k) < 0.02 and _rel(got[1], v) < 0.02  # int8's error, not tq4's


def test_a_pinned_prefix_stays_in_its_rules_format_while_there_is_room(
        model: Path, tmp_path: Path) -> None:
    # a pin is never transcoded down, so the room format would hold it for good, in a
    # pool whose pin quota counts fewer blocks: a prefix that fits the k5v4 pool's
    # quota would not fit int8's
    store = _budget_store(model, tmp_path, 4096)
    quota = {fmt: int(store.config.device_blocks * store.identity.bytes_per_block
                      // pool_identity(store.identity, fmt).bytes_per_block) // 2
             for fmt in ("k5v4", "int8")}
    n = quota["k5v4"]
    assert n > quota["int8"]
    keys = _keys(store, n, tenant="acme")
    labels = [BlockLabel("axioms", 1.0, pinned=True, fmt="k5v4", room_fmt="int8")] * n
    result = store.save(*_kv(n, seed=21), keys, "acme", labels)
    assert result.stored == keys and result.unpinned is None
    assert _held(store) == {"k5v4": n}
    pinned = {p.fmt: sum(p.pins.pinned_by_tenant().values()) for p in store.pools.values()
              if len(p.cache.metadata)}
    assert pinned == {"k5v4": n}
    # unpinned blocks of the same save would still go up while there is room
    more = _keys(store, 4, tenant="acme", offset=50_000)
    store.save(*_kv(4, seed=22), more, "acme", _room("k5v4", "int8", 0.5, 4))
    assert _held(store) == {"k5v4": n, "int8": 4}


@pytest.mark.parametrize("fmt", ["tq4", "k5v4"])  # k5v4: the default policy's
def test_under_pressure_upgraded_blocks_are_transcoded_before_anything_is_evicted(
        model: Path, tmp_path: Path, fmt: str) -> None:
    store = _budget_store(model, tmp_path, 32)
    budget = 32 * store.identity.bytes_per_block
    k_old, v_old = _kv(12, seed=12, key_mean=4.0)
    old = _keys(store, 12, tenant="acme")
    assert store.save(k_old, v_old, old, "acme", _room(fmt, "int8", 0.2, 12)).stored == old
    assert _held(store) == {"int8": 12}  # 12 int8 blocks: ~0.7 of the budget
    store.take_stats()
    # 12 more do not fit as int8, nor as fmt beside 12 int8: the new ones go in as fmt
    # and the least important int8 blocks are transcoded to fmt; nothing is evicted
    new = _keys(store, 12, tenant="acme", offset=10_000)
    result = store.save(*_kv(12, seed=13), new, "acme", _room(fmt, "int8", 0.9, 12))
    assert result.stored == new and result.removed == [] and result.failed == []
    held = _held(store)
    demoted = 12 - held["int8"]
    assert 1 <= demoted < 12 and held[fmt] == 12 + demoted
    assert sum(row["bytes"] for row in store.format_stats().values()) <= budget
    stats = store.take_stats()
    assert stats is not None and stats["counters"]["demoted_blocks"] == demoted
    assert set(store.keys()) == {*old, *new}
    # the old blocks read back, each within its format's error; another tenant sees none
    got = store.read(old, "acme")
    assert got is not None and got[0].shape[1] == 12
    errors = [_rel(got[1][:, b], v_old[:, b]) for b in range(12)]
    assert sum(e > 0.05 for e in errors) == demoted  # 4-bit values on the demoted ones
    assert sum(e < 0.02 for e in errors) == 12 - demoted
    # into the pool the new save calibrated (12 blocks): key offsets subtracted
    (low_pool,) = [p for p in store.pools.values() if p.fmt == fmt and len(p.cache.metadata)]
    assert low_pool.identity.key_offset_digest


def test_transcoded_blocks_take_their_pools_key_offsets_when_none_is_calibrated(
        model: Path, tmp_path: Path) -> None:
    store = _budget_store(model, tmp_path, 24)
    k_old, v_old = _kv(12, seed=16, key_mean=4.0)
    old = _keys(store, 12)
    assert store.save(k_old, v_old, old, "default",
                      _room("tq4", "int8", 0.2, 12)).stored == old
    # two tq4 blocks, too few to calibrate on: they and the demoted blocks still get
    # offsets, the int8 pool's (the keys' large per-head mean costs tq4 much without)
    new = _keys(store, 2, offset=10_000)
    assert store.save(*_kv(2, seed=17), new, "default",
                      _room("tq4", None, 0.9, 2)).stored == new
    (int8_pool,) = [p for p in store.pools.values() if p.fmt == "int8"]
    demoted = [p for p in store.pools.values()
               if p.fmt == "tq4" and p.identity.key_offset_digest and len(p.cache.metadata)]
    assert [p.identity.key_offset_digest for p in demoted] == [
        int8_pool.identity.key_offset_digest]
    got = store.read(old, "default")
    assert got is not None and got[0].shape[1] == 12
    assert max(_rel(got[0][:, b], k_old[:, b]) for b in range(12)) < 0.05
    assert store.read(old, "other") is None


def test_with_nothing_left_to_transcode_the_store_evicts(model: Path, tmp_path: Path) -> None:
    store = _budget_store(model, tmp_path, 16)
    old = _keys(store, 8)
    assert store.save(*_kv(8, seed=14), old, "default",
                      _room("tq4", "int8", 0.2, 8)).stored == old
    assert _held(store) == {"int8": 8}
    # 16 tq4 blocks (no room format) fill the budget alone: every int8 block is
    # transcoded and then, still over budget, evicted (lowest importance first)
    new = _keys(store, 16, offset=10_000)
    result = store.save(*_kv(16, seed=15), new, "default", _room("tq4", None, 0.9, 16))
    assert result.stored == new and sorted(result.removed) == sorted(old)
    assert _held(store) == {"tq4": 16}
