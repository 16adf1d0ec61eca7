"""The shadow persists the cache's chunk index (:mod:`gpu_cache.chunks`): a manifest
carries the entries over its blocks and their hops, recovery puts them back (those of
blocks it could not recover are dropped), every field is checked on read, and manifests
without them still read.

Real caches and a real local store; no model.
"""

from __future__ import annotations

import json
import re

import pytest
from shadow_testkit import KEY, add_prefix, make_cache

from gpu_cache.chunks import ChunkEntry
from shadow import (
    CacheShadow,
    CorruptShadowError,
    ShadowConfig,
    TamperedShadowError,
    load_manifest,
    open_store,
    recover_session,
)
from shadow._chunk_index import MAX_CHUNK_ENTRIES

MANUAL = ShadowConfig(autostart=False)
SIGNED = ShadowConfig(autostart=False, auth_key=KEY)


def _fill(cache, tenant="alice", seed=0):
    """Four chained blocks of ``tenant`` and two chunks over them: ``memories`` (blocks
    0-1, computed in full context) and ``user_turn`` (blocks 2-3, moved once); block 3
    later held K/V moved twice. Returns the entries by key, and the block keys."""
    ids = add_prefix(cache, 4, tenant=tenant, seed=seed)
    keys = [cache.metadata.get(b).key for b in ids]
    index = cache.chunks
    memories = ChunkEntry(tenant, "memories", tuple(keys[0:2]), offset=1, position=1,
                          length=6)
    turn = ChunkEntry(tenant, "user_turn", tuple(keys[2:4]), offset=0, position=8,
                      length=8, hops=1)
    k1 = index.key(tenant, "memories", [seed, 1, 2, 3, 4, 5])
    k2 = index.key(tenant, "user_turn", [seed, 100, 101, 102, 103, 104, 105, 106])
    index.put(k1, memories)
    index.put(k2, turn)
    index.taint(keys[2:4], 1)
    index.taint(keys[3:4], 2)
    return {k1: memories, k2: turn}, keys


def _shadow(cache, store_url, sid="s", config=MANUAL):
    with CacheShadow(cache, store_url, sid, config=config) as sh:
        return sh.shadow_now()


def _path(tmp_path, sid="s"):
    return tmp_path / "shadow" / sid / "manifest.json"


def _edit(path, fn):
    doc = json.loads(path.read_bytes())
    fn(doc)
    path.write_text(json.dumps(doc))


# ---------------------------------------------------------------- round trip
@pytest.mark.parametrize("config", [MANUAL, SIGNED], ids=["unsigned", "signed"])
def test_chunk_index_round_trips_through_a_shadow(config, store_url, tmp_path):
    cache = make_cache()
    entries, keys = _fill(cache)
    _shadow(cache, store_url, config=config)
    doc = json.loads(_path(tmp_path).read_bytes())
    assert [c["label"] for c in doc["chunks"]] == ["memories", "user_turn"]
    assert doc["chunks"][0] == {"key": next(iter(entries)).hex(), "tenant": "alice",
                                "label": "memories", "blocks": [k.hex() for k in keys[0:2]],
                                "offset": 1, "position": 1, "length": 6, "hops": 0}
    assert doc["block_hops"] == {keys[2].hex(): 1, keys[3].hex(): 2}

    fresh = make_cache()
    report = recover_session(open_store(store_url), "s", fresh,
                             key=KEY if config is SIGNED else None)
    assert report.blocks == 4 and report.chunks == 2
    assert not report.chunks_dropped and not report.chunks_refused
    for key, entry in entries.items():
        assert fresh.chunks.get(key, "alice") == entry
    # least recently used first, as in the shadowed cache
    assert fresh.chunks.items("alice") == cache.chunks.items("alice")
    assert [fresh.chunks.hops_of([k]) for k in keys] == [0, 0, 1, 2]
    assert report.to_dict()["chunks"] == 2


def test_a_cache_without_chunks_writes_the_manifest_it_always_wrote(store_url, tmp_path):
    cache = make_cache()
    add_prefix(cache, 3)
    _shadow(cache, store_url)
    doc = json.loads(_path(tmp_path).read_bytes())
    assert "chunks" not in doc and "block_hops" not in doc
    report = recover_session(open_store(store_url), "s", make_cache())
    assert report.blocks == 3 and report.chunks == 0 and not report.chunks_refused


def test_an_older_manifest_without_chunks_still_recovers(store_url, tmp_path):
    cache = make_cache()
    _fill(cache)
    _shadow(cache, store_url)

    def strip(doc):
        del doc["chunks"], doc["block_hops"]
    _edit(_path(tmp_path), strip)
    fresh = make_cache()
    report = recover_session(open_store(store_url), "s", fresh)
    assert report.blocks == 4 and not report.skipped and report.chunks == 0
    assert len(fresh.chunks) == 0


def test_an_incremental_shadow_persists_the_index_of_its_time(store_url, tmp_path):
    cache = make_cache()
    entries, _ = _fill(cache)
    with CacheShadow(cache, store_url, "s", config=MANUAL) as sh:
        sh.shadow_now()
        first = next(iter(entries))
        cache.chunks.discard(first)
        more, _ = _fill(cache, seed=1)
        assert sh.shadow_now().blocks_written == 4
    fresh = make_cache()
    assert recover_session(open_store(store_url), "s", fresh).chunks == 3
    assert fresh.chunks.get(first, "alice") is None
    assert all(fresh.chunks.get(k, "alice") == e for k, e in more.items())


# ---------------------------------------------------------------- tenants
def test_entries_are_restored_under_their_tenant_only(store_url):
    cache = make_cache()
    alice, _ = _fill(cache, "alice", seed=0)
    bob, _ = _fill(cache, "bob", seed=1)
    _shadow(cache, store_url)
    fresh = make_cache()
    assert recover_session(open_store(store_url), "s", fresh).chunks == 4
    for key, entry in alice.items():
        assert fresh.chunks.get(key, "alice") == entry
        assert fresh.chunks.get(key, "bob") is None
    for key, entry in bob.items():
        assert fresh.chunks.get(key, "bob") == entry
        assert fresh.chunks.get(key, "alice") is None
    assert {e.tenant for e in fresh.chunks.of_tenant("bob")} == {"bob"}


def test_a_tenant_shadow_persists_only_that_tenants_entries(store_url, tmp_path):
    cache = make_cache()
    alice, _ = _fill(cache, "alice", seed=0)
    _fill(cache, "bob", seed=1)
    _shadow(cache, store_url, config=ShadowConfig(autostart=False, tenant="alice"))
    doc = json.loads(_path(tmp_path).read_bytes())
    assert {c["tenant"] for c in doc["chunks"]} == {"alice"}
    fresh = make_cache()
    assert recover_session(open_store(store_url), "s", fresh).chunks == 2
    assert fresh.chunks.items("alice") == list(alice.items())
    assert fresh.chunks.items("bob") == []


def test_entries_over_blocks_the_manifest_does_not_hold_are_not_written(store_url, tmp_path):
    cache = make_cache()
    entries, keys = _fill(cache, "alice")
    _, bob_keys = _fill(cache, "bob", seed=1)
    index = cache.chunks
    # an entry of alice naming bob's blocks, one naming a block no cache holds, one whose
    # label a manifest cannot hold
    index.put(b"\x01" * 32, ChunkEntry("alice", "memories", tuple(bob_keys[0:1]), 0, 0, 4))
    index.put(b"\x02" * 32, ChunkEntry("alice", "memories", (b"\x09" * 32,), 0, 0, 4))
    index.put(b"\x03" * 32, ChunkEntry("alice", "bad\nlabel", tuple(keys[0:1]), 0, 0, 4))
    _shadow(cache, store_url)
    doc = json.loads(_path(tmp_path).read_bytes())
    written = {bytes.fromhex(c["key"]) for c in doc["chunks"] if c["tenant"] == "alice"}
    assert written == set(entries)


# ---------------------------------------------------------------- blocks not recovered
def test_entries_of_blocks_that_were_not_recovered_are_dropped(store_url, tmp_path):
    cache = make_cache()
    entries, keys = _fill(cache)
    _shadow(cache, store_url)
    root = tmp_path / "shadow"
    doc = json.loads(_path(tmp_path).read_bytes())
    rec = next(b for b in doc["blocks"] if b["key"] == keys[1].hex())
    seg = next(s for s in doc["segments"] if s["id"] == rec["segment"])
    blob = root / seg["files"]["k_packed"]
    data = bytearray(blob.read_bytes())
    data[rec["offsets"]["k_packed"]] ^= 0xFF  # block 1 fails its CRC
    blob.write_bytes(bytes(data))

    fresh = make_cache()
    report = recover_session(open_store(store_url), "s", fresh)
    assert report.blocks == 3 and len(report.skipped) == 1
    assert report.chunks == 1 and report.chunks_dropped == 1
    memories, turn = entries
    assert fresh.chunks.get(memories, "alice") is None  # its block 1 is gone
    assert fresh.chunks.get(turn, "alice") == entries[turn]
    assert [fresh.chunks.hops_of([k]) for k in keys] == [0, 0, 1, 2]


def test_a_held_entry_fewer_hops_away_is_kept_over_the_manifests(store_url):
    cache = make_cache()
    entries, keys = _fill(cache)
    _shadow(cache, store_url)
    live = make_cache()
    add_prefix(live, 4, tenant="alice")  # the same blocks, already cached
    turn = list(entries)[1]
    computed = ChunkEntry("alice", "user_turn", tuple(keys[2:4]), 0, 8, 8, hops=0)
    live.chunks.put(turn, computed)
    report = recover_session(open_store(store_url), "s", live)
    assert report.already_present == 4 and report.chunks == 1
    assert live.chunks.get(turn, "alice") == computed


def test_an_entry_over_blocks_the_cache_held_is_no_fewer_hops_away_than_they(store_url):
    cache = make_cache()
    entries, keys = _fill(cache)
    _shadow(cache, store_url)
    live = make_cache()
    add_prefix(live, 4, tenant="alice")  # the same keys, K/V moved twice in this cache
    live.chunks.taint(keys[0:2], 2)
    report = recover_session(open_store(store_url), "s", live)
    assert report.already_present == 4 and report.chunks == 2
    memories, turn = entries
    assert live.chunks.get(memories, "alice").hops == 2
    assert live.chunks.get(turn, "alice") == entries[turn]
    assert [live.chunks.hops_of([k]) for k in keys] == [2, 2, 1, 2]


# ---------------------------------------------------------------- integrity
@pytest.mark.parametrize("tamper", ["hops", "blocks", "tenant", "added", "block_hops"])
def test_a_tampered_chunk_entry_in_a_signed_manifest_is_refused(tamper, store_url, tmp_path):
    cache = make_cache()
    _, keys = _fill(cache)
    _fill(cache, "bob", seed=1)
    _shadow(cache, store_url, config=SIGNED)

    def damage(doc):
        chunks = doc["chunks"]
        if tamper == "hops":
            chunks[1]["hops"] = 0  # launder moved K/V as computed
        elif tamper == "blocks":
            chunks[0]["blocks"] = chunks[1]["blocks"]
        elif tamper == "tenant":
            chunks[0]["tenant"] = "bob"
        elif tamper == "added":
            chunks.append(dict(chunks[0], key="ab" * 32))
        else:
            del doc["block_hops"][keys[3].hex()]
    _edit(_path(tmp_path), damage)
    fresh = make_cache()
    with pytest.raises(TamperedShadowError, match="MAC"):
        recover_session(open_store(store_url), "s", fresh, key=KEY)
    assert len(fresh.metadata) == 0 and len(fresh.chunks) == 0


def _bad_entries(keys, bob_keys, first):
    """(name, how the second entry is damaged, what the refusal says)."""
    return [
        ("key not hex", lambda e: e.update(key="zz" * 32), "chunks[1].key"),
        ("key short", lambda e: e.update(key="ab" * 16), "chunks[1].key"),
        ("key upper", lambda e: e.update(key=e["key"].upper()), "chunks[1].key"),
        ("tenant", lambda e: e.update(tenant="../etc"), "chunks[1].tenant"),
        ("label", lambda e: e.update(label="a\u200bb"), "chunks[1].label"),
        ("label type", lambda e: e.update(label=7), "chunks[1].label"),
        ("offset", lambda e: e.update(offset=4), "chunks[1].offset"),
        ("offset negative", lambda e: e.update(offset=-1), "chunks[1].offset"),
        ("length beyond", lambda e: e.update(length=9), "chunks[1].length"),
        ("length short", lambda e: e.update(length=4), "chunks[1].length"),
        ("length bool", lambda e: e.update(length=True), "chunks[1].length"),
        ("position float", lambda e: e.update(position=8.0), "chunks[1].position"),
        ("position huge", lambda e: e.update(position=1 << 70), "chunks[1].position"),
        ("hops negative", lambda e: e.update(hops=-1), "chunks[1].hops"),
        ("hops huge", lambda e: e.update(hops=1 << 40), "chunks[1].hops"),
        ("blocks empty", lambda e: e.update(blocks=[]), "chunks[1].blocks"),
        ("blocks not a list", lambda e: e.update(blocks="ab"), "chunks[1].blocks"),
        ("block not hex", lambda e: e["blocks"].__setitem__(0, 12), "chunks[1].blocks[0]"),
        ("block unknown", lambda e: e["blocks"].__setitem__(0, "cd" * 32),
         "no readable record"),
        ("block of another tenant", lambda e: e["blocks"].__setitem__(0, bob_keys[2].hex()),
         "no readable record of tenant 'alice'"),
        ("too many blocks", lambda e: e.update(blocks=[keys[2].hex()] * 100),
         "chunks[1].blocks"),
        ("missing field", lambda e: e.pop("hops"), "missing field 'hops'"),
        ("duplicate key", lambda e: e.update(key=first), "twice"),
    ]


@pytest.mark.parametrize("case", [name for name, _, _ in _bad_entries([b""] * 4,
                                                                       [b""] * 4, "")])
def test_an_unsigned_manifest_with_a_malformed_entry_refuses_that_entry(case, store_url,
                                                                        tmp_path):
    cache = make_cache()
    entries, keys = _fill(cache)
    _, bob_keys = _fill(cache, "bob", seed=1)
    _shadow(cache, store_url)
    cases = {name: (damage, says) for name, damage, says
             in _bad_entries(keys, bob_keys, next(iter(entries)).hex())}
    damage, says = cases[case]

    def edit(doc):
        alice = [c for c in doc["chunks"] if c["tenant"] == "alice"]
        doc["chunks"] = alice  # [memories, user_turn]
        damage(alice[1])
    _edit(_path(tmp_path), edit)
    manifest = load_manifest(open_store(store_url), "s")
    [why] = manifest.chunk_index.refused
    assert why.startswith("chunks[1] ") and says in why, why

    fresh = make_cache()
    report = recover_session(open_store(store_url), "s", fresh)
    assert report.blocks == 8 and not report.skipped  # the blocks all recover
    assert report.chunks == 1 and report.chunks_refused == [f"s: {why}"]
    memories = next(iter(entries))
    assert fresh.chunks.get(memories, "alice") == entries[memories]
    assert len(fresh.chunks) == 1


def test_an_entry_that_is_not_an_object_is_refused(store_url, tmp_path):
    cache = make_cache()
    _fill(cache)
    _shadow(cache, store_url)
    _edit(_path(tmp_path), lambda doc: doc["chunks"].insert(0, ["not", "an", "entry"]))
    report = recover_session(open_store(store_url), "s", make_cache())
    assert report.chunks == 2 and report.blocks == 4
    assert report.chunks_refused == ["s: chunks[0] is malformed (chunks[0] must be an "
                                     "object, got list)"]


@pytest.mark.parametrize("value,says", [({}, "must be an integer"),
                                        (0, r"outside \[1, "), (True, "integer")])
def test_a_malformed_block_hops_item_is_refused(value, says, store_url, tmp_path):
    cache = make_cache()
    _, keys = _fill(cache)
    _shadow(cache, store_url)
    _edit(_path(tmp_path), lambda doc: doc["block_hops"].update({keys[3].hex(): value}))
    fresh = make_cache()
    report = recover_session(open_store(store_url), "s", fresh)
    [why] = report.chunks_refused
    assert why.startswith(f"s: block_hops['{keys[3].hex()[:16]}'] is malformed")
    assert re.search(says, why), why
    assert report.chunks == 2 and fresh.chunks.hops_of([keys[3]]) == 1  # from its entry


def test_block_hops_of_a_block_the_manifest_does_not_hold_are_refused(store_url, tmp_path):
    cache = make_cache()
    _fill(cache)
    _shadow(cache, store_url)
    _edit(_path(tmp_path), lambda doc: doc["block_hops"].update({"ef" * 32: 1, "x": 1}))
    [a, b] = load_manifest(open_store(store_url), "s").chunk_index.refused
    assert "no readable record" in a and "64 lowercase hex" in b


@pytest.mark.parametrize("field,value,says", [
    ("chunks", {"a": 1}, "chunks must be a list"),
    ("chunks", "x", "chunks must be a list"),
    ("chunks", [{}] * (MAX_CHUNK_ENTRIES + 1), "more than the 65536"),
    ("block_hops", [1], "block_hops must be an object"),
    ("block_hops", {f"{i:064x}": 1 for i in range(5)}, "more than the manifest's 4"),
])
def test_a_malformed_chunk_list_refuses_the_manifest(field, value, says, store_url,
                                                     tmp_path):
    cache = make_cache()
    _fill(cache)
    _shadow(cache, store_url)
    _edit(_path(tmp_path), lambda doc: doc.update({field: value}))
    fresh = make_cache()
    with pytest.raises(CorruptShadowError, match=f"malformed field.*{says}"):
        recover_session(open_store(store_url), "s", fresh)
    assert len(fresh.metadata) == 0 and len(fresh.chunks) == 0
