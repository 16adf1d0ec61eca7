"""The live shared tier (shadow.shared) against a file store and moto's S3 server: names,
MAC, refusals, deduplication, visibility across replicas, deadlines and retention."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import time
from typing import Any

import pytest
import torch
from shadow_testkit import KEY, SMALL, block_tensors

from gpu_cache import CacheIdentity
from shadow import ShadowStore, StoreConfig, open_store
from shadow.shared import (
    BlockEntry,
    PoolPart,
    SharedChunk,
    SharedTier,
    SharedTierConfig,
    SharedTierError,
    collect,
    decode_chunk,
    encode_chunk,
)
from shadow.shared.objects import SharedObjectError, tenant_tag

C = 2  # blocks per chunk


def _keys(tenant: str, n: int, prompt: str = "p") -> list[bytes]:
    out, parent = [], b""
    for i in range(n):
        parent = hashlib.sha256(parent + f"{tenant}/{prompt}/{i}".encode()).digest()
        out.append(parent)
    return out


def _chunk(tier: SharedTier, tenant: str, keys: list[bytes], *, serial: int = 0,
           pinned: bool = False, importance: float = 0.5, layer: str = "memories",
           identity: CacheIdentity = SMALL) -> SharedChunk:
    n = len(keys)
    t = block_tensors(identity, [serial + i for i in range(n)])
    tensors = {name: x.transpose(0, 1).contiguous() for name, x in t.items()}  # block-major
    return SharedChunk(tier.path(tenant, keys[-1]), identity, tenant,
                       [BlockEntry(k, layer, importance, pinned) for k in keys],
                       [PoolPart(identity, list(range(n)), tensors, None)])


def _tier(url: str, request: pytest.FixtureRequest | None = None, *, store: ShadowStore | None
          = None, writer: str = "a", **kw: Any) -> SharedTier:
    endpoint = getattr(request.node, "endpoint", None) if request is not None else None
    return SharedTier(SMALL, SharedTierConfig(url=url, endpoint_url=endpoint, chunk_blocks=C,
                                              **kw), mac_key=KEY, writer=writer, store=store)


def test_a_chunk_one_replica_writes_another_finds_and_reads_by_name(
        url: str, request: pytest.FixtureRequest) -> None:
    a, b = _tier(url, request, writer="a"), _tier(url, request, writer="b")
    keys = _keys("acme", 4)
    chunks = [_chunk(a, "acme", keys[:2]), _chunk(a, "acme", keys[2:], serial=2)]
    assert [a.put(c) for c in chunks] == [True, True]
    # the name: model digest, a keyed tag of the tenant, the last block's key
    path = chunks[0].path
    assert path.split("/")[1:] == ["t", tenant_tag(KEY, "acme"), keys[1].hex()]
    assert "acme" not in path
    assert b.probe("acme", [keys[1], keys[3]]) == 2  # visible at once: no restart, no listing
    got = b.fetch("acme", [keys[1], keys[3]])
    assert [c.keys for c in got] == [keys[:2], keys[2:]]
    for want, have in zip(chunks, got, strict=True):
        for name, tensor in want.parts[0].tensors.items():
            assert torch.equal(have.parts[0].tensors[name], tensor)
    counters = b.take_counters()
    assert counters["heads"] == 2 and counters["gets"] == 2 and counters["lists"] == 0
    assert counters["bytes_down"] > 0


def test_a_probe_counts_the_leading_run_only(url: str, request: pytest.FixtureRequest) -> None:
    tier = _tier(url, request)
    keys = _keys("acme", 6)
    tier.put(_chunk(tier, "acme", keys[:2]))
    tier.put(_chunk(tier, "acme", keys[4:], serial=4))  # chunk 1 is missing
    assert tier.probe("acme", [keys[1], keys[3], keys[5]]) == 1
    assert [c.keys for c in tier.fetch("acme", [keys[1], keys[3], keys[5]])] == [keys[:2]]


def test_a_probe_asks_in_doubling_batches_and_stops_at_the_first_miss(
        url: str, request: pytest.FixtureRequest) -> None:
    """A prompt's tail the tier never saw costs one batch of HEADs, not one per chunk."""
    writer, reader = _tier(url, request, writer="a"), _tier(url, request, writer="b")
    keys = _keys("acme", 2 * 13)
    names = keys[1::2]  # 13 chunks of C blocks
    writer.put(_chunk(writer, "acme", keys[:2]))
    assert reader.probe("acme", names) == 1
    assert reader.take_counters()["heads"] == 4  # the first batch only
    for j in range(1, 13):
        writer.put(_chunk(writer, "acme", keys[2 * j:2 * j + 2], serial=2 * j))
    assert reader.probe("acme", names) == 13
    assert reader.take_counters()["heads"] == 13  # batches of 4, 8 and the last 1


def test_tenants_never_find_each_others_chunks(url: str, request: pytest.FixtureRequest
                                                ) -> None:
    tier = _tier(url, request)
    keys = _keys("acme", 2)
    tier.put(_chunk(tier, "acme", keys))
    # the same names asked for by another tenant: another prefix, nothing found
    assert tier.probe("globex", [keys[1]]) == 0
    assert tier.fetch("globex", [keys[1]]) == []


def test_a_chunk_held_already_is_not_uploaded_again(url: str, request: pytest.FixtureRequest
                                                   ) -> None:
    a, b = _tier(url, request, writer="a"), _tier(url, request, writer="b")
    keys = _keys("acme", 2)
    assert a.put(_chunk(a, "acme", keys))
    assert not a.put(_chunk(a, "acme", keys))  # known: no request at all
    assert not b.put(_chunk(b, "acme", keys))  # another replica: one HEAD, no PUT
    ca, cb = a.take_counters(), b.take_counters()
    assert (ca["puts"], ca["deduplicated"]) == (1, 1)
    assert (cb["puts"], cb["heads"], cb["deduplicated"]) == (0, 1, 1)


# ---------------------------------------------------------------------- refusals
def _raw(tier: SharedTier, path: str) -> bytes:
    return tier.store.get(path)


def test_a_tampered_object_is_refused(url: str, request: pytest.FixtureRequest) -> None:
    tier = _tier(url, request)
    keys = _keys("acme", 2)
    chunk = _chunk(tier, "acme", keys)
    tier.put(chunk)
    data = bytearray(_raw(tier, chunk.path))
    data[len(data) // 2] ^= 0x01  # one bit of the KV bytes
    tier.store.put(chunk.path, bytes(data))
    assert tier.fetch("acme", [keys[1]]) == []
    assert tier.take_counters()["refused_tampered"] == 1


def test_an_object_copied_to_another_name_is_refused_as_replayed(
        url: str, request: pytest.FixtureRequest) -> None:
    tier = _tier(url, request)
    mine, other = _keys("acme", 2), _keys("globex", 2)
    chunk = _chunk(tier, "acme", mine)
    tier.put(chunk)
    data = _raw(tier, chunk.path)
    # to another tenant's name for the same tokens, and to another prefix of the tenant
    tier.store.put(tier.path("globex", other[1]), data)
    moved = _keys("acme", 2, prompt="q")
    tier.store.put(tier.path("acme", moved[1]), data)
    assert tier.fetch("globex", [other[1]]) == []
    assert tier.fetch("acme", [moved[1]]) == []
    assert tier.take_counters()["refused_replayed"] == 2


def test_an_object_of_another_model_is_refused_as_foreign(url: str,
                                                          request: pytest.FixtureRequest
                                                          ) -> None:
    tier = _tier(url, request)
    keys = _keys("acme", 2)
    other = dataclasses.replace(SMALL, model_id="test/other")
    # signed with the deployment's key, at this model's name: written by a replica
    # serving another model under a wrong configuration
    chunk = _chunk(tier, "acme", keys, identity=other)
    tier.store.put(chunk.path, encode_chunk(chunk, KEY))
    assert tier.fetch("acme", [keys[1]]) == []
    assert tier.take_counters()["refused_foreign"] == 1


def test_an_old_object_at_its_own_name_is_still_the_same_kv(url: str,
                                                          request: pytest.FixtureRequest
                                                          ) -> None:
    # a name fixes the content: an object collected and put back is served as it was
    # (a leased chunk older than the expiry stays usable); collection bounds age
    tier = _tier(url, request, max_age_s=60.0)
    keys = _keys("acme", 2)
    old = _chunk(tier, "acme", keys)
    old.written_at = time.time() - 3600
    tier.store.put(old.path, encode_chunk(old, KEY))
    assert [c.keys for c in tier.fetch("acme", [keys[1]])] == [keys]
    assert collect(tier).expired == 1 and tier.probe("acme", [keys[1]]) == 0


def test_another_deployment_key_is_refused_as_tampered() -> None:
    chunk = SharedChunk("m/t/x/y", SMALL, "acme", [], [])
    data = encode_chunk(chunk, b"another key")
    with pytest.raises(SharedObjectError) as err:
        decode_chunk(data, KEY, path="m/t/x/y", identity=SMALL, tenant="acme")
    assert err.value.reason == "tampered"


def test_without_a_key_the_tier_refuses_to_start(tmp_path: Any) -> None:
    with pytest.raises(SharedTierError, match="CONTEXTKIT_SHADOW_KEY"):
        SharedTier(SMALL, SharedTierConfig(url=f"file://{tmp_path}"))


@pytest.mark.parametrize("field,value", [("chunk_blocks", 0), ("deadline_s", 0),
                                         ("max_age_s", -1), ("url", ""),
                                         ("deadline_s", float("inf")),
                                         ("lease_s", float("nan")),
                                         ("max_age_s", float("nan")),
                                         ("tenant_budget_bytes", 1.5),
                                         ("chunk_blocks", True)])
def test_bad_settings_are_named(field: str, value: object) -> None:
    kw: dict[str, Any] = {"url": "file:///tmp/x", field: value}
    with pytest.raises(SharedTierError, match=field if field != "url" else "url"):
        SharedTierConfig(**kw)


# ---------------------------------------------------------------------- deadlines
class SlowStore(ShadowStore):
    """A real store whose reads wait until released (a slow or stuck endpoint)."""

    scheme = "file"

    def __init__(self, inner: ShadowStore) -> None:
        self.inner = inner
        self.url = inner.url
        self.gate = threading.Event()

    def put(self, key: str, data: Any) -> None:
        self.inner.put(key, data)

    def open_writer(self, key: str) -> Any:
        return self.inner.open_writer(key)

    def get(self, key: str) -> bytes:
        self.gate.wait(10)
        return self.inner.get(key)

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        return self.inner.read_into(key, offset, buffer)

    def size(self, key: str) -> int | None:
        self.gate.wait(10)
        return self.inner.size(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)


def test_a_slow_tier_gives_up_at_the_deadline(tmp_path: Any) -> None:
    url = f"file://{tmp_path / 'shared'}"
    writer = _tier(url)
    keys = _keys("acme", 2)
    writer.put(_chunk(writer, "acme", keys))
    slow = SlowStore(open_store(url, StoreConfig(fsync=False)))
    reader = _tier(url, store=slow, deadline_s=0.2)
    try:
        assert reader.probe("acme", [keys[1]]) == 0  # found nothing in time: recompute
        assert reader.fetch("acme", [keys[1]]) == []
        assert reader.take_counters()["deadline_misses"] == 2
        slow.gate.set()  # the endpoint recovers: the same chunk is found and read
        assert reader.probe("acme", [keys[1]]) == 1
        assert len(reader.fetch("acme", [keys[1]])) == 1
    finally:
        slow.gate.set()


# ---------------------------------------------------------------------- retention
def test_collection_expires_unleased_chunks_and_keeps_leased_and_pinned_ones(
        url: str, request: pytest.FixtureRequest) -> None:
    tier = _tier(url, request, max_age_s=60.0, pinned_max_age_s=3600.0)
    now = time.time()
    old, leased, pinned, fresh = (_keys("acme", 2, prompt=p) for p in "olpf")
    for keys, kw in ((old, {}), (leased, {}), (pinned, {"pinned": True}), (fresh, {})):
        chunk = _chunk(tier, "acme", keys, **kw)
        chunk.written_at = now - (10 if keys is fresh else 600)
        tier.store.put(chunk.path, encode_chunk(chunk, KEY))
    live = tier.path("acme", leased[1])
    tier.write_lease({live: "acme"}, now=now)
    stale = _tier(url, request, writer="gone")
    stale.write_lease({tier.path("acme", old[1]): "acme"}, now=now - 10_000)  # ran out
    report = collect(tier, now=now)
    assert (report.expired, report.leased, report.leases_expired) == (1, 1, 1)
    left = {p.rsplit("/", 1)[1] for p in tier.store.list(tier.tenants_prefix)}
    assert left == {leased[1].hex(), pinned[1].hex(), fresh[1].hex()}
    assert tier.store.list(tier.lease_prefix) == [tier.lease_prefix + "a"]


def test_a_tenant_over_its_budget_loses_its_least_valuable_chunks_only(
        url: str, request: pytest.FixtureRequest) -> None:
    tier = _tier(url, request)
    size = len(encode_chunk(_chunk(tier, "acme", _keys("acme", 2)), KEY))
    tier = _tier(url, request, tenant_budget_bytes=2 * size + size // 2)  # 2 chunks fit
    now = time.time()
    acme = {p: _keys("acme", 2, prompt=p) for p in ("low", "mid", "high", "pin")}
    imp = {"low": 0.1, "mid": 0.5, "high": 0.9, "pin": 0.1}
    for p, keys in acme.items():
        chunk = _chunk(tier, "acme", keys, importance=imp[p], pinned=p == "pin")
        chunk.written_at = now
        tier.store.put(chunk.path, encode_chunk(chunk, KEY))
    globex = [_keys("globex", 2, prompt=p) for p in ("a", "b", "c")]
    for keys in globex:  # another tenant, also over: its own chunks pay for it
        tier.store.put(tier.path("globex", keys[1]),
                       encode_chunk(_chunk(tier, "globex", keys, importance=0.0), KEY))
    report = collect(tier, now=now)
    left = {p.rsplit("/", 1)[1] for p in tier.store.list(tier.tenants_prefix)}
    # acme keeps its pinned chunk and its most important unpinned one
    assert {acme["pin"][1].hex(), acme["high"][1].hex()} <= left
    assert acme["low"][1].hex() not in left and acme["mid"][1].hex() not in left
    assert sum(k[1].hex() in left for k in globex) == 2
    assert report.over_budget == 3
    assert all(held <= tier.config.tenant_budget_bytes for held in report.tenants.values())


def test_a_lease_is_what_the_writer_holds_tenants_sealed(url: str,
                                                         request: pytest.FixtureRequest
                                                         ) -> None:
    tier = _tier(url, request, lease_s=30.0)
    keys = _keys("acme-secret-salt", 2)
    path = tier.path("acme-secret-salt", keys[1])
    tier.write_lease({path: "acme-secret-salt"}, now=1000.0)
    raw = tier.store.get(tier.lease_prefix + "a")
    doc = json.loads(raw)
    assert (doc["writer"], doc["expires_at"], doc["chunks"]) == ("a", 1030.0, [path])
    assert b"acme-secret-salt" not in raw  # the salt is sealed
    assert tier.leased(now=1010.0) == [(path, "acme-secret-salt", keys[1])]
    assert tier.leased(now=1031.0) == []  # ran out
    other = SharedTier(SMALL, tier.config, mac_key=b"another deployment", writer="x",
                       store=tier.store)
    assert other.leased(now=1010.0) == []  # another key cannot unseal it


def test_contextkit_shared_gc_collects_every_model_in_the_store(
        tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    from contextkit.cli.commands import main

    monkeypatch.setenv("CONTEXTKIT_SHADOW_KEY", KEY.decode())
    url = f"file://{tmp_path / 'shared'}"
    tier = _tier(url, max_age_s=60.0)
    other = SharedTier(dataclasses.replace(SMALL, model_id="test/other"),
                       SharedTierConfig(url=url, chunk_blocks=C), mac_key=KEY)
    old, fresh = _keys("acme", 2, prompt="o"), _keys("acme", 2, prompt="f")
    for t in (tier, other):
        chunk = _chunk(t, "acme", old, identity=t.identity)
        chunk.written_at = time.time() - 600
        t.store.put(chunk.path, encode_chunk(chunk, KEY))
        t.put(_chunk(t, "acme", fresh, identity=t.identity))
    assert main(["shared", "gc", url, "--max-age-s", "60", "--json"]) == 0
    models = json.loads(capsys.readouterr().out.splitlines()[-1])["models"]
    assert len(models) == 2 and all(r["expired"] == 1 for r in models.values())
    assert tier.probe("acme", [fresh[1]]) == 1 and tier.probe("acme", [old[1]]) == 0
