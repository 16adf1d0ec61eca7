"""Property test: random damage to the manifests and blobs of two signed sessions of two
tenants never recovers a block under another tenant or key, never lets a raw exception
out, and never costs the untouched session anything."""

from __future__ import annotations

import json
import random
import shutil
import time

import pytest
import torch
from shadow_testkit import KEY, add_blocks, exported_by_key, make_cache

from gpu_cache import TENSOR_NAMES, Tier
from shadow import (
    CacheShadow,
    ShadowConfig,
    ShadowError,
    open_store,
    recover_session,
    recover_sessions,
)

SESSIONS = {"alpha": "t-alpha", "beta": "t-beta"}  # session -> tenant
SERIALS = {"alpha": range(0, 6), "beta": range(100, 106)}
MUTATIONS = 360
SEED = 19


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """The store, and per key the tenant and bytes each block must keep."""
    root = tmp_path_factory.mktemp("fuzz") / "pristine"
    truth: dict[bytes, tuple[str, dict[str, torch.Tensor]]] = {}
    for sid, tenant in SESSIONS.items():
        cache = make_cache()
        add_blocks(cache, SERIALS[sid], tenant=tenant)
        with CacheShadow(cache, f"file://{root}", sid,
                         config=ShadowConfig(autostart=False, auth_key=KEY)) as sh:
            sh.shadow_now()
        truth.update({k: (tenant, v) for k, v in exported_by_key(cache).items()})
    return root, truth


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
    blob = root / target / f"{rng.choice(TENSOR_NAMES)}.bin"
    raw = bytearray(blob.read_bytes())
    if kind == 5:
        for _ in range(rng.randrange(1, 4)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        blob.write_bytes(bytes(raw))
        return "blob bit flips"
    if kind == 6:
        blob.write_bytes(bytes(raw[:rng.randrange(len(raw))]))
        return "blob truncated"
    shutil.copyfile(root / other / blob.name, blob)
    return "other session's blob"


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
    root, truth = pristine
    rng = random.Random(SEED)
    start = time.monotonic()
    outcomes: dict[str, int] = {}
    for n in range(MUTATIONS):
        work = tmp_path / f"run{n % 2}"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(root, work)
        target, other = rng.sample(sorted(SESSIONS), 2)
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
        store.close()
    # the loop exercised both outcomes: whole sessions refused, single blocks skipped
    assert outcomes.get("refused", 0) > MUTATIONS // 3 and outcomes.get("skipped", 0) > 20, outcomes
    assert time.monotonic() - start < 60
