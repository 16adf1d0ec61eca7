"""Property test: random damage to the manifests and blobs of two signed sessions of two
tenants never recovers a block under another tenant or key, never lets a raw exception
out, and never costs the untouched session anything.

Besides random damage, an attacker's and an unlucky operator's moves (issue 33): block
bytes rewritten with their CRC-32 forged back to the recorded value (0 accepted with a
key), an older authentic manifest of the session put back (0 silently accepted), and a
writer whose manifest write lands but reports a failure, then fails outright on the next
shadow (0 committed blocks lost).
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import sys

import pytest
import torch
from shadow_testkit import KEY, FaultyStore, add_blocks, exported_by_key, forge_crc, make_cache

from gpu_cache import TENSOR_NAMES, Tier
from shadow import (
    CacheShadow,
    ShadowConfig,
    ShadowError,
    ShadowStoreError,
    open_store,
    recover_session,
    recover_sessions,
)

SESSIONS = {"alpha": "t-alpha", "beta": "t-beta"}  # session -> tenant
SERIALS = {"alpha": range(0, 6), "beta": range(100, 106)}
#: blocks of generation 1 that generation 2 deleted: a replayed generation 1 brings them back
DELETED = {"alpha": range(50, 52), "beta": range(150, 152)}
MUTATIONS = 360
SEED = 19
SIGNED = ShadowConfig(autostart=False, auth_key=KEY)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """The store (two generations per session), per key the tenant and bytes each block
    must keep, and per session its generation-1 manifest (for replays)."""
    root = tmp_path_factory.mktemp("fuzz") / "pristine"
    truth: dict[bytes, tuple[str, dict[str, torch.Tensor]]] = {}
    replays: dict[str, bytes] = {}
    for sid, tenant in SESSIONS.items():
        cache = make_cache()
        add_blocks(cache, SERIALS[sid], tenant=tenant)
        deleted = add_blocks(cache, DELETED[sid], tenant=tenant)
        with CacheShadow(cache, f"file://{root}", sid, config=SIGNED) as sh:
            sh.shadow_now()
            replays[sid] = (root / sid / "manifest.json").read_bytes()
            cache.remove_blocks(deleted)
            sh.shadow_now()
        truth.update({k: (tenant, v) for k, v in exported_by_key(cache).items()})
    return root, truth, replays


def _json_mutation(rng: random.Random, doc: dict, other: dict) -> str:
    blocks = doc["blocks"]
    i, j = rng.sample(range(len(blocks)), 2)
    o = rng.randrange(len(other["blocks"]))
    choice = rng.randrange(14)
    if choice == 0:
        blocks[i]["tenant"] = other["blocks"][o]["tenant"]
    elif choice == 1:
        blocks[i]["key"] = other["blocks"][o]["key"]
    elif choice == 2:
        blocks[i]["key"], blocks[j]["key"] = blocks[j]["key"], blocks[i]["key"]
    elif choice == 3:
        for f in ("offsets", "checksums"):
            blocks[i][f], blocks[j][f] = blocks[j][f], blocks[i][f]
    elif choice == 4:
        name = rng.choice(TENSOR_NAMES)
        blocks[i]["checksums"][name] = rng.randrange(2**32)
    elif choice == 5:
        blocks[i]["importance"] = rng.choice([1.5, -0.1, 0.5, "x", None])
    elif choice == 6:
        blocks[i] = other["blocks"][o]
    elif choice == 7:
        blocks[i], blocks[j] = blocks[j], blocks[i]
    elif choice == 8:
        del doc["mac"]
    elif choice == 9:
        doc["mac"] = other["mac"]
    elif choice == 10:
        doc.update({k: other[k] for k in ("session_id", "mac")})
    elif choice == 11:
        doc["identity"][rng.choice(list(doc["identity"]))] = rng.choice([{}, None, -1, "x"])
    elif choice == 12:
        del blocks[i][rng.choice(list(blocks[i]))]
    else:
        blocks[i]["offsets"][rng.choice(TENSOR_NAMES)] += rng.choice([-1, 1]) * 1024
    return f"json#{choice}"


def _mutate(rng: random.Random, root, target: str, other: str) -> str:
    """Damage session ``target`` (reading, never writing, ``other``); returns what was done."""
    manifest = root / target / "manifest.json"
    kind = rng.randrange(8)
    if kind <= 2:
        try:
            doc = json.loads(manifest.read_bytes())
        except ValueError:  # already cut by the first of two mutations
            kind = 3
    if kind <= 2:
        what = _json_mutation(rng, doc, json.loads((root / other / "manifest.json").read_bytes()))
        manifest.write_text(json.dumps(doc))
        return what
    if kind == 3:
        raw = manifest.read_bytes()
        cut = rng.randrange(len(raw))
        manifest.write_bytes(raw[:cut] if rng.random() < 0.5
                             else raw[:cut] + rng.randbytes(rng.randrange(1, 64)))
        return "manifest bytes"
    if kind == 4:
        shutil.copyfile(root / other / "manifest.json", manifest)
        return "other session's manifest"
    name = rng.choice(TENSOR_NAMES)
    blob = rng.choice(sorted((root / target).glob(f"*{name}.bin")))
    raw = bytearray(blob.read_bytes())
    if kind == 5:
        for _ in range(rng.randrange(1, 4)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        blob.write_bytes(bytes(raw))
        return "blob bit flips"
    if kind == 6:
        blob.write_bytes(bytes(raw[:rng.randrange(len(raw))]))
        return "blob truncated"
    shutil.copyfile(rng.choice(sorted((root / other).glob(f"*{name}.bin"))), blob)
    return "other session's blob"


def _forge(rng: random.Random, root, target: str) -> int:
    """Rewrite one block's bytes in one tensor and forge its CRC-32 back; returns the
    block's manifest position."""
    manifest = json.loads((root / target / "manifest.json").read_bytes())
    index = rng.randrange(len(manifest["blocks"]))
    record = manifest["blocks"][index]
    name = rng.choice(TENSOR_NAMES)
    seg = next(s for s in manifest["segments"] if s["id"] == record["segment"])
    size = manifest["tensors"][name]["block_bytes"]
    path, offset = root / seg["files"][name], record["offsets"][name]
    blob = bytearray(path.read_bytes())
    block = bytearray(blob[offset:offset + size])
    original = bytes(block)
    pos = rng.randrange(size - 3)
    for _ in range(rng.randrange(1, 4)):  # change bytes outside the four forged ones
        i = rng.choice([j for j in range(size) if not pos <= j < pos + 4])
        block[i] ^= rng.randrange(1, 256)
    forge_crc(block, pos, record["checksums"][name])
    assert bytes(block) != original
    blob[offset:offset + size] = block
    path.write_bytes(bytes(blob))
    return index


def _lost_ack(rng: random.Random, work, target: str, serial: int) -> dict[bytes, dict]:
    """A writer of ``target`` whose manifest write lands but reports a timeout, and whose
    next shadow (another layout) fails before its manifest lands. Returns the blocks of
    the generation that did land, by key."""
    tenant = SESSIONS[target]
    store = FaultyStore(open_store(f"file://{work}", create=False))
    cache = make_cache()
    recover_session(store, target, cache, key=KEY)
    with CacheShadow(cache, store, target, config=SIGNED) as sh:
        fresh = add_blocks(cache, range(serial, serial + rng.randrange(2, 6)), tenant=tenant)
        store.faults.append("lost-ack")
        with contextlib.suppress(ShadowStoreError):
            sh.shadow_now()
        committed = exported_by_key(cache)
        cache.remove_blocks(rng.sample(fresh, rng.randrange(1, len(fresh))))
        add_blocks(cache, range(serial + 10, serial + 10 + rng.randrange(1, 4)), tenant=tenant)
        store.faults.append(rng.choice(["fail", "lost-ack"]))
        landed = store.faults[-1] == "lost-ack"
        with contextlib.suppress(ShadowStoreError):
            sh.shadow_now()
        if landed:
            committed = exported_by_key(cache)
    store.close()
    return committed


def _check(dst, truth, report, target: str, other: str, what: str) -> None:
    # every recovered block is exactly a block that was shadowed: same key, same
    # tenant, same bytes
    for key, tensors in exported_by_key(dst).items():
        assert key in truth, (what, "a block under a key that was never shadowed")
        tenant, want = truth[key]
        metas = [m for m in dst.metadata.all() if m.key == key]
        assert [m.tenant_slug for m in metas] == [tenant], (what, "block under another tenant")
        assert all(torch.equal(tensors[n], want[n]) for n in TENSOR_NAMES), (
            what, "a key serves another block's bytes")
    # the untouched session recovers fully
    assert other in report.sessions and other not in report.errors, what
    assert report.block_ids[other].count(None) == 0, what
    assert not [s for s in report.skipped if s.session_id == other], what
    # the damaged one is refused, or its bad blocks are skipped with a reason
    if target in report.errors:
        assert report.errors[target] and "\n" not in report.errors[target], what
    else:
        skipped = [s for s in report.skipped if s.session_id == target]
        assert all(s.reason for s in skipped), what
        assert len(skipped) + sum(b is not None for b in report.block_ids[target]) \
            == len(SERIALS[target]), what
    assert dst.num_free(Tier.HOST) + dst.num_used(Tier.HOST) == dst.capacity(Tier.HOST)


def test_random_damage_never_crosses_tenants_keys_or_sessions(pristine, tmp_path):
    root, truth, replays = pristine
    rng = random.Random(SEED)
    outcomes: dict[str, int] = {}
    moves = {"forged": 0, "forgeries accepted": 0, "replayed": 0, "replays accepted": 0,
             "lost acks": 0, "committed blocks lost": 0}
    for n in range(MUTATIONS):
        work = tmp_path / f"run{n % 2}"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(root, work)
        target, other = rng.sample(sorted(SESSIONS), 2)
        move = rng.randrange(11)
        if move == 10:  # a lost acknowledgement, then a failed shadow
            committed = _lost_ack(rng, work, target, serial=1000 + 100 * n)
            dst = make_cache()
            report = recover_session(open_store(f"file://{work}", create=False), target, dst,
                                     key=KEY)
            got = exported_by_key(dst)
            lost = [k for k in committed if k not in got or not all(
                torch.equal(got[k][t], committed[k][t]) for t in TENSOR_NAMES)]
            moves["lost acks"] += 1
            moves["committed blocks lost"] += len(lost) + report.num_skipped
            assert not lost and not report.skipped and set(got) == set(committed), n
            continue
        forged = None
        if move == 9:
            (work / target / "manifest.json").write_bytes(replays[target])
            what = "replayed generation 1"
        elif move == 8:
            forged = _forge(rng, work, target)
            what = f"forged block {forged} with a valid CRC"
        else:
            what = " + ".join(_mutate(rng, work, target, other)
                              for _ in range(1 if rng.random() < 0.8 else 2))
        store = open_store(f"file://{work}", create=False)
        dst = make_cache()
        try:
            report = recover_sessions(store, dst, key=KEY)
        except ShadowError as exc:  # only the typed family may escape
            pytest.fail(f"{what}: recover_sessions raised {exc!r}")
        _check(dst, truth, report, target, other, what)
        try:  # the single-session call raises only typed errors, and cleans up
            single = make_cache()
            recover_session(store, target, single, key=KEY)
        except ShadowError:
            assert len(single.metadata) == 0 and single.num_used(Tier.HOST) == 0, what
        outcome = ("refused" if target in report.errors
                   else "skipped" if any(s.session_id == target for s in report.skipped)
                   else "intact")
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if forged is not None:
            moves["forged"] += 1
            accepted = target in report.block_ids and report.block_ids[target][forged] is not None
            moves["forgeries accepted"] += accepted
            assert not accepted, what
        if move == 9:
            moves["replayed"] += 1
            silent = "rollback" not in report.errors.get(target, "")
            moves["replays accepted"] += silent
            assert not silent, (what, report.errors)
        store.close()
    sys.stdout.write(f"\nfuzz: {MUTATIONS} mutations (seed {SEED}): {outcomes}, {moves}\n")
    # the loop exercised every outcome: sessions refused, single blocks skipped, and
    # each of the attacker's moves, with none of them getting through
    assert outcomes.get("refused", 0) > MUTATIONS // 4 and outcomes.get("skipped", 0) > 20, outcomes
    assert min(moves["forged"], moves["replayed"], moves["lost acks"]) >= 20, moves
    assert moves["forgeries accepted"] == moves["replays accepted"] \
        == moves["committed blocks lost"] == 0, moves
