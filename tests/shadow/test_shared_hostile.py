"""The shared tier against hostile objects (issue 53, items 2-5), on a file store and
moto's S3 server: MAC-valid but malformed objects are refused, never raised; object
and header sizes are checked before anything is read; the collector skips what it
cannot parse and trusts no unauthenticated header or lease."""

from __future__ import annotations

import hashlib
import json
import struct
import time
import tracemalloc
from typing import Any

import pytest
import torch
from shadow_testkit import KEY, SMALL, block_tensors

from gpu_cache import CacheIdentity
from shadow import MeteredStore, StoreConfig, open_store
from shadow.shared import (
    BlockEntry,
    PoolPart,
    SharedChunk,
    SharedTier,
    SharedTierConfig,
    collect,
    encode_chunk,
)
from shadow.shared.objects import MAGIC, SpanRecord, assemble_object, split_object

C = 2  # blocks per chunk
#: The largest legal object of SMALL at C = 2 is a few tens of KiB (its header bound
#: included); every read here must stay far below this.
READ_BOUND = 1 << 20


def _keys(tenant: str, n: int, prompt: str = "p") -> list[bytes]:
    out, parent = [], b""
    for i in range(n):
        parent = hashlib.sha256(parent + f"{tenant}/{prompt}/{i}".encode()).digest()
        out.append(parent)
    return out


def _chunk(tier: SharedTier, tenant: str, keys: list[bytes], *, importance: float = 0.5,
           pinned: bool = False, identity: CacheIdentity = SMALL) -> SharedChunk:
    n = len(keys)
    t = block_tensors(identity, list(range(n)))
    tensors = {name: x.transpose(0, 1).contiguous() for name, x in t.items()}
    return SharedChunk(tier.path(tenant, keys[-1]), identity, tenant,
                       [BlockEntry(k, "memories", importance, pinned) for k in keys],
                       [PoolPart(identity, list(range(n)), tensors, None)])


def _tier(url: str, request: pytest.FixtureRequest, **kw: Any) -> SharedTier:
    """A tier over the real store, metered (bytes read)."""
    endpoint = getattr(request.node, "endpoint", None)
    store = MeteredStore(open_store(url, StoreConfig(endpoint_url=endpoint, fsync=False)))
    return SharedTier(SMALL, SharedTierConfig(url=url, endpoint_url=endpoint, chunk_blocks=C,
                                              **kw), mac_key=KEY, writer="a", store=store)


def _bytes_read(tier: SharedTier) -> int:
    assert isinstance(tier.store, MeteredStore)
    return tier.store.bytes_read


def _raw(header: Any, tail: bytes = b"", declared: int | None = None) -> bytes:
    """An object with a header of our choosing, no valid MAC (a writer without the key)."""
    doc = json.dumps(header).encode()
    n = len(doc) if declared is None else declared
    return MAGIC + struct.pack("<I", n) + doc + tail + bytes(32)


# ---------------------------------------------------------------------- item 2
def resign(data: bytes, mutate: Any) -> bytes:
    """``data`` with its header changed by ``mutate`` and signed again with the key:
    what a replica holding the key but running other code could write."""
    doc, body = split_object(data)
    mutate(doc)
    return assemble_object(json.dumps(doc).encode(), bytes(body), KEY)


def _no_written_at(c: SharedChunk) -> None:
    c.written_at = "yesterday"  # type: ignore[assignment]


def _nan_importance(doc: dict[str, Any]) -> None:
    doc["blocks"][0]["importance"] = float("nan")


def _version_99(doc: dict[str, Any]) -> None:
    doc["version"] = 99


def _nbytes(doc: dict[str, Any]) -> None:
    doc["parts"][0]["tensors"]["v_packed"]["nbytes"] += 1


def _offset_past_the_body(doc: dict[str, Any]) -> None:
    doc["parts"][0]["tensors"]["v_norms"]["offset"] += 1 << 20


def _wrong_shape(c: SharedChunk) -> None:
    t = c.parts[0].tensors["k_packed"]
    c.parts[0].tensors["k_packed"] = t[..., : t.shape[-1] // 2].contiguous()


def _bad_positions(c: SharedChunk) -> None:
    c.parts[0].positions = [0, 5]


def _wrong_dtype(c: SharedChunk) -> None:
    c.parts[0].tensors["k_norms"] = c.parts[0].tensors["k_norms"].half()


def _duplicate_position(c: SharedChunk) -> None:
    c.parts[0].positions = [0, 0]


#: Changes to the chunk before it is encoded, or (resigned) to its header after.
MALFORMED = {"written_at text": _no_written_at, "tensor shape": _wrong_shape,
             "positions": _bad_positions, "dtype": _wrong_dtype,
             "duplicate position": _duplicate_position}
RESIGNED = {"importance nan": _nan_importance, "version 99": _version_99,
            "byte count": _nbytes, "offset": _offset_past_the_body}


def malformed(chunk: SharedChunk, variant: str) -> bytes:
    """A MAC-valid object of ``chunk`` broken as ``variant`` says."""
    if variant in MALFORMED:
        MALFORMED[variant](chunk)
        return encode_chunk(chunk, KEY)
    return resign(encode_chunk(chunk, KEY), RESIGNED[variant])


@pytest.mark.parametrize("variant", sorted([*MALFORMED, *RESIGNED]))
def test_a_mac_valid_malformed_object_is_refused_not_raised(
        url: str, request: pytest.FixtureRequest, variant: str) -> None:
    tier = _tier(url, request)
    keys = _keys("acme", 2)
    chunk = _chunk(tier, "acme", keys)
    tier.store.put(chunk.path, malformed(chunk, variant))  # a replica on other code
    assert tier.fetch("acme", [keys[1]]) == []
    assert tier.take_counters()["refused_corrupt"] == 1


# ---------------------------------------------------------------------- item 3
def _peak(fn: Any) -> tuple[Any, int]:
    """``fn()`` and the peak of Python's allocations while it ran, above what is held
    after (interned strings' table grows at random and stays). On S3 that includes
    moto's server, in this process: those tests bound the bytes read instead."""
    tracemalloc.start()
    try:
        out = fn()
        now, peak = tracemalloc.get_traced_memory()
        return out, peak - now
    finally:
        tracemalloc.stop()


def test_an_oversized_object_at_a_chunks_name_is_refused_unread(
        url: str, request: pytest.FixtureRequest) -> None:
    tier = _tier(url, request)
    keys = _keys("acme", 2)
    big = 8 << 20
    tier.store.put(tier.path("acme", keys[1]), MAGIC + bytes(big))  # no key needed
    got, peak = _peak(lambda: tier.fetch("acme", [keys[1]]))
    assert got == []
    assert _bytes_read(tier) == 0  # its size was checked before a byte of it was read
    if url.startswith("file:"):
        assert peak < READ_BOUND
    assert tier.take_counters()["refused_oversize"] == 1


def test_the_collector_bounds_a_declared_header_length(url: str,
                                                       request: pytest.FixtureRequest
                                                       ) -> None:
    tier = _tier(url, request, max_age_s=60.0)
    now = time.time()
    bomb = tier.path("acme", bytes(32))  # first in the listing
    tier.store.put(bomb, _raw({}, declared=0xFFFFFFFF)[:80])  # 80 bytes, "4 GiB" header
    old = _chunk(tier, "acme", _keys("acme", 2))
    old.written_at = now - 600
    tier.store.put(old.path, encode_chunk(old, KEY))
    report, peak = _peak(lambda: collect(tier, now=now))
    assert _bytes_read(tier) < READ_BOUND
    if url.startswith("file:"):
        assert peak < READ_BOUND
    assert report.unreadable == 1 and report.expired == 1
    assert tier.store.list(tier.tenants_prefix) == []


# ---------------------------------------------------------------------- item 4
UNPARSEABLE = [{"blocks": [1]}, {"blocks": "x"}, {"written_at": "x", "blocks": []},
               {"blocks": [{"importance": "hi"}]}, {"blocks": None, "written_at": None},
               [1, 2]]


def test_one_unparseable_header_does_not_stop_collection(url: str,
                                                         request: pytest.FixtureRequest
                                                         ) -> None:
    tier = _tier(url, request, max_age_s=60.0)
    now = time.time()
    for i, header in enumerate(UNPARSEABLE):  # named to come first in the listing
        tier.store.put(tier.path("acme", bytes([0] * 31 + [i])), _raw(header))
    old = _chunk(tier, "acme", _keys("acme", 2))
    old.written_at = now - 600
    tier.store.put(old.path, encode_chunk(old, KEY))
    fresh = _chunk(tier, "acme", _keys("acme", 2, prompt="f"))
    fresh.written_at = now
    tier.store.put(fresh.path, encode_chunk(fresh, KEY))
    report = collect(tier, now=now)
    assert report.unreadable == len(UNPARSEABLE)
    assert report.expired == 1  # the pass went on past them
    assert tier.store.list(tier.tenants_prefix) == [fresh.path]


# ---------------------------------------------------------------------- item 5
def _forged(tier: SharedTier, keys: list[bytes], written_at: float = 1e300) -> str:
    """Garbage claiming everything that keeps an object: pinned, importance 1, new."""
    path = tier.path("acme", keys[-1])
    header = {"version": 1, "path": path, "identity": SMALL.to_dict(), "writer": "x",
              "tenant": path.split("/")[2], "written_at": written_at, "parts": [],
              "blocks": [{"key": k.hex(), "layer": "system", "importance": 1.0,
                          "pinned": True} for k in keys]}
    tier.store.put(path, _raw(header, tail=bytes(4096)))
    return path


def test_a_forged_header_is_neither_kept_past_expiry_nor_ahead_of_real_chunks(
        url: str, request: pytest.FixtureRequest) -> None:
    probe = _tier(url, request)
    size = len(encode_chunk(_chunk(probe, "acme", _keys("acme", 2)), KEY))
    tier = _tier(url, request, max_age_s=60.0, tenant_budget_bytes=2 * size + size // 2)
    now = time.time()
    forged = [_forged(tier, _keys("acme", 2, prompt=f"x{i}"), w)
              for i, w in enumerate((1e300, now))]
    real = []
    for p in ("a", "b"):
        chunk = _chunk(tier, "acme", _keys("acme", 2, prompt=p), importance=0.1)
        chunk.written_at = now - 10
        tier.store.put(chunk.path, encode_chunk(chunk, KEY))
        real.append(chunk.path)
    collect(tier, now=now)
    left = set(tier.store.list(tier.tenants_prefix))
    assert not left & set(forged)
    assert left == set(real)  # both fit once the forgeries are gone


@pytest.mark.parametrize("expires", ["NaN", "Infinity", "1e308", "forged"])
def test_a_lease_that_cannot_be_trusted_keeps_nothing(url: str, request: pytest.FixtureRequest,
                                                      expires: str) -> None:
    tier = _tier(url, request, max_age_s=60.0)
    now = time.time()
    old = _chunk(tier, "acme", _keys("acme", 2))
    old.written_at = now - 600
    tier.store.put(old.path, encode_chunk(old, KEY))
    if expires == "forged":  # a plausible lease written without the key
        tier.store.put(tier.lease_prefix + "x", json.dumps(
            {"writer": "x", "expires_at": now + 100, "chunks": [old.path],
             "tenants": {}}).encode())
    else:
        tier.store.put(tier.lease_prefix + "x", (
            f'{{"writer": "x", "expires_at": {expires}, "chunks": ["{old.path}"], '
            '"tenants": {}}').encode())
    report = collect(tier, now=now)
    assert report.leased == 0 and report.expired == 1
    assert tier.store.list(tier.tenants_prefix) == []
    assert tier.store.list(tier.lease_prefix) == []


def test_a_lease_written_by_the_tier_still_keeps_its_chunks(
        url: str, request: pytest.FixtureRequest) -> None:
    tier = _tier(url, request, max_age_s=60.0)
    now = time.time()
    old = _chunk(tier, "acme", _keys("acme", 2))
    old.written_at = now - 600
    tier.store.put(old.path, encode_chunk(old, KEY))
    tier.write_lease({old.path: "acme"}, now=now)
    report = collect(tier, now=now)
    assert report.leased == 1 and report.expired == 0
    assert tier.leased(now=now) == [(old.path, "acme", old.keys[-1])]


def test_decoded_objects_round_trip(url: str, request: pytest.FixtureRequest) -> None:
    tier = _tier(url, request)
    keys = _keys("acme", 2)
    chunk = _chunk(tier, "acme", keys, importance=0.25, pinned=True)
    assert tier.put(chunk)
    (got,) = tier.fetch("acme", [keys[1]])
    assert [(b.importance, b.pinned) for b in got.blocks] == [(0.25, True)] * 2
    for name, t in chunk.parts[0].tensors.items():
        assert torch.equal(got.parts[0].tensors[name], t)


def test_contextkit_shared_gc_survives_a_header_bomb_and_needs_the_key(
        tmp_path: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    from contextkit.cli.commands import main

    url = f"file://{tmp_path / 'shared'}"
    tier = SharedTier(SMALL, SharedTierConfig(url=url, chunk_blocks=C), mac_key=KEY)
    tier.store.put(tier.path("acme", bytes(32)), _raw({}, declared=0xFFFFFFFF)[:80])
    fresh = _chunk(tier, "acme", _keys("acme", 2))
    assert tier.put(fresh)
    assert main(["shared", "gc", url, "--json"]) == 2  # no key: nothing can be trusted
    assert "CONTEXTKIT_SHADOW_KEY" in capsys.readouterr().err
    assert len(tier.store.list(tier.tenants_prefix)) == 2  # and nothing was touched
    monkeypatch.setenv("CONTEXTKIT_SHADOW_KEY", KEY.decode())
    assert main(["shared", "gc", url, "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out.splitlines()[-1])["models"].values()
    assert report["unreadable"] == 1 and report["refused"] == {"corrupt": 1}
    assert tier.store.list(tier.tenants_prefix) == [fresh.path]


# ---------------------------------------------------------------------- span objects
CONTENT = hashlib.sha256(b"acme/documents/the text").digest()


def _span_object(tier: SharedTier, keys: list[bytes]) -> SharedChunk:
    chunk = _chunk(tier, "acme", keys)
    chunk.path = tier.span_path("acme", CONTENT)
    bs = SMALL.block_size
    chunk.span = SpanRecord(CONTENT, "documents", 3 * bs + 1, 2 * bs - 1)  # 2 blocks
    return chunk


def _span_length(doc: dict[str, Any]) -> None:
    doc["span"]["length"] += SMALL.block_size  # would need a third block


def _span_content(doc: dict[str, Any]) -> None:
    doc["span"]["content"] = "zz" * 32


def _span_extra_field(doc: dict[str, Any]) -> None:
    doc["span"]["offset"] = 0


def _span_hops(doc: dict[str, Any]) -> None:
    doc["span"]["hops"] = -1


def _span_dropped(doc: dict[str, Any]) -> None:
    del doc["span"]  # a prefix chunk's header at a span's name


@pytest.mark.parametrize("mutate", [_span_length, _span_content, _span_extra_field, _span_hops,
                                    _span_dropped])
def test_a_mac_valid_malformed_span_object_is_refused_by_lookup_and_load(
        url: str, request: pytest.FixtureRequest, mutate: Any) -> None:
    tier = _tier(url, request)
    good = _span_object(tier, _keys("acme", 2))
    tier.store.put(good.path, encode_chunk(good, KEY))
    found = tier.find_spans("acme", [CONTENT])
    assert found[CONTENT].span == good.span and found[CONTENT].block_keys == good.keys
    assert tier.fetch_spans("acme", [CONTENT]).get(CONTENT) is not None
    tier.take_counters()
    tier.store.put(good.path, resign(encode_chunk(good, KEY), mutate))
    assert tier.find_spans("acme", [CONTENT]) == {}
    assert tier.fetch_spans("acme", [CONTENT]).get(CONTENT) is None
    assert tier.take_counters()["refused_corrupt"] == 2


def test_a_span_object_is_another_tenants_to_no_one(url: str,
                                                    request: pytest.FixtureRequest) -> None:
    tier = _tier(url, request)
    good = _span_object(tier, _keys("acme", 2))
    tier.put(good)
    assert tier.find_spans("globex", [CONTENT]) == {}  # globex's name: nothing there
    tier.store.put(tier.span_path("globex", CONTENT), tier.store.get(good.path))
    assert tier.find_spans("globex", [CONTENT]) == {}  # acme's object at globex's name
    assert tier.fetch_spans("globex", [CONTENT]).get(CONTENT) is None
    assert tier.take_counters()["refused_replayed"] == 2
