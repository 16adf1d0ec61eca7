"""Seeded fuzz of shared-tier objects and headers (issue 53): mutations with and
without the key, on a file store (most) and moto's S3 server (a subset).

For every mutation: no exception out of ``fetch`` or ``collect``; a fetched chunk is
one the reader can use. After collection: nothing forged or malformed is kept, and no
chunk the reader serves was collected (the budget fits exactly those). Peak memory
of a fetch stays within the largest legal object's bound (read buffer and tensors);
of a collection, within the largest legal header's."""

from __future__ import annotations

import hashlib
import random
import time
import tracemalloc
from typing import Any

import pytest
import torch
from shadow_testkit import BUCKET, KEY, SMALL, block_tensors
from shared_mutations import Mutation, signed, unsigned

from shadow import StoreConfig, open_store
from shadow.shared import (
    BlockEntry,
    PoolPart,
    SharedChunk,
    SharedObjectError,
    SharedTier,
    SharedTierConfig,
    collect,
    decode_chunk,
    encode_chunk,
)
from shadow.shared.objects import MAX_HEADER_BYTES

C = 2
SEED = 53


def _keys(prompt: str) -> list[bytes]:
    out, parent = [], b""
    for i in range(C):
        parent = hashlib.sha256(parent + f"acme/{prompt}/{i}".encode()).digest()
        out.append(parent)
    return out


def _legit(tier: SharedTier, prompt: str, now: float) -> tuple[list[bytes], bytes]:
    keys = _keys(prompt)
    t = block_tensors(SMALL, [hash(prompt) % 1000 + i for i in range(C)])
    tensors = {name: x.transpose(0, 1).contiguous() for name, x in t.items()}
    chunk = SharedChunk(tier.path("acme", keys[-1]), SMALL, "acme",
                        [BlockEntry(k, "memories", 0.1, False) for k in keys],
                        [PoolPart(SMALL, list(range(C)), tensors, None)], written_at=now - 10)
    return keys, encode_chunk(chunk, KEY)


def _mutations(n: int, seed: int, tier: SharedTier, now: float
               ) -> list[tuple[list[bytes], Mutation]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        keys, data = _legit(tier, f"m{seed}-{i}", now)
        m = (signed(data, rng, KEY) if i % 2 else
             unsigned(data, rng, tier.max_object_bytes))
        out.append((keys, m))
    return out


def transient() -> int:
    """Peak traced memory above what is still held now: what a call used and gave
    back. Interpreter-wide tables (interned strings) grow at random moments and stay;
    they are not a read's, and this leaves them out."""
    now, peak = tracemalloc.get_traced_memory()
    return peak - now


def _serves(tier: SharedTier, path: str, data: bytes) -> bool:
    try:
        decode_chunk(data, KEY, path=path, identity=SMALL, tenant="acme")
    except SharedObjectError:
        return False
    return len(data) <= tier.max_object_bytes


def _fuzz(tier: SharedTier, n: int, *, measure: bool) -> None:
    now = time.time()
    muts = _mutations(n, SEED + n, tier, now)
    served: set[str] = set()
    for i in range(8):  # untouched chunks among the mutated ones
        keys, data = _legit(tier, f"legit-{i}", now)
        tier.store.put(tier.path("acme", keys[-1]), data)
        served.add(tier.path("acme", keys[-1]))
    assert len(tier.fetch("acme", [keys[-1]])) == 1  # warm: torch's first decode allocates
    forged: set[str] = set()
    fetch_peak = 0
    for keys, m in muts:
        path = tier.path("acme", keys[-1])
        tier.store.put(path, m.data)
        if measure:
            tracemalloc.start()
        try:
            got = tier.fetch("acme", [keys[-1]])  # must not raise, whatever it holds
            if measure:
                fetch_peak = max(fetch_peak, transient())
        finally:
            if measure:
                tracemalloc.stop()
        if _serves(tier, path, m.data):
            served.add(path)
            (chunk,) = got
            assert chunk.keys == keys
            assert all(0.0 <= b.importance <= 1.0 for b in chunk.blocks)
            for part in chunk.parts:
                for t in part.tensors.values():
                    assert t.shape[0] == len(part.positions)
        else:
            assert got == [], m.name
            if m.header or m.signed:  # forged, or malformed by a writer with the key
                forged.add(path)
    # the collector: nothing forged kept, nothing the reader serves lost; the budget
    # fits exactly what is not forged (an object whose body alone was changed keeps
    # its writer's header: the collector reads headers only), and nothing is old
    sizes = dict(tier.store.list_sizes(tier.tenants_prefix))
    budget = sum(size for p, size in sizes.items() if p not in forged)
    config = SharedTierConfig(url=tier.config.url, chunk_blocks=C, max_age_s=1e10,
                              pinned_max_age_s=1e10, tenant_budget_bytes=budget)
    collector = SharedTier(SMALL, config, mac_key=KEY, writer="gc", store=tier.store)
    if measure:
        tracemalloc.start()
    try:
        report = collect(collector, now=now)
        collect_peak = transient() if measure else 0
    finally:
        if measure:
            tracemalloc.stop()
    left = set(tier.store.list(tier.tenants_prefix))
    assert served <= left, f"{len(served - left)} served chunks collected"
    assert not forged & left, f"{len(forged & left)} forged objects kept"
    assert report.objects == n + 8
    assert len(forged) > n // 4 and report.unreadable >= len(forged)
    if measure:
        # a fetch holds at most the object read (bounded before reading) and its tensors
        assert fetch_peak < 3 * tier.max_object_bytes
        # a collection reads one header at a time, at most MAX_HEADER_BYTES
        assert collect_peak < 4 * MAX_HEADER_BYTES


def test_fuzz_file_store(tmp_path: Any) -> None:
    url = f"file://{tmp_path / 'shared'}"
    tier = SharedTier(SMALL, SharedTierConfig(url=url, chunk_blocks=C), mac_key=KEY,
                      writer="a")
    _fuzz(tier, 320, measure=True)


def test_fuzz_s3(s3_endpoint: str, tmp_path: Any) -> None:
    prefix = hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12]
    url = f"s3://{BUCKET}/{prefix}"
    store = open_store(url, StoreConfig(endpoint_url=s3_endpoint, fsync=False))
    tier = SharedTier(SMALL, SharedTierConfig(url=url, endpoint_url=s3_endpoint,
                                              chunk_blocks=C), mac_key=KEY, writer="a",
                      store=store)
    _fuzz(tier, 48, measure=False)  # moto serves in this process: memory is the file run's


@pytest.mark.parametrize("seed", range(3))
def test_a_legit_chunk_survives_its_mutated_neighbours_byte_for_byte(tmp_path: Any,
                                                                     seed: int) -> None:
    url = f"file://{tmp_path / 'shared'}"
    tier = SharedTier(SMALL, SharedTierConfig(url=url, chunk_blocks=C), mac_key=KEY)
    now = time.time()
    keys, data = _legit(tier, "keep", now)
    tier.store.put(tier.path("acme", keys[-1]), data)
    for k, m in _mutations(20, seed, tier, now):
        tier.store.put(tier.path("acme", k[-1]), m.data)
    (got,) = tier.fetch("acme", [keys[-1]])
    want = decode_chunk(data, KEY, path=got.path, identity=SMALL, tenant="acme")
    for name, t in want.parts[0].tensors.items():
        assert torch.equal(got.parts[0].tensors[name], t)
