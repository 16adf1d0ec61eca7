"""Helpers for shadow tests: small real caches filled with deterministic blocks.

Imported by the test modules and by the crash-test worker processes (conftest puts
this directory on ``sys.path``).
"""

from __future__ import annotations

import json
import zlib
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gpu_cache import TENSOR_NAMES, CacheConfig, CacheIdentity, Tier, TQGPUCache
from shadow import BlobWriter, MeteredStore, ShadowStore, ShadowStoreError

#: The bucket the moto server of the S3 tests holds.
BUCKET = "ck-shadow"
#: The MAC key of authenticated-shadow tests.
KEY = b"test-shadow-key-0123456789abcdef"

SMALL = CacheIdentity(model_id="test/tiny", num_layers=2, num_kv_heads=2, head_dim=16,
                      block_size=4, rotation_seed=7)
#: Blocks big enough (18 KiB) that manifests are small next to them.
MEDIUM = CacheIdentity(model_id="test/medium", num_layers=4, num_kv_heads=4, head_dim=64,
                       block_size=16)


def make_cache(identity: CacheIdentity = SMALL, *, device_blocks: int = 64,
               host_blocks: int = 512) -> TQGPUCache:
    return TQGPUCache(identity, CacheConfig(num_device_blocks=device_blocks,
                                            num_host_blocks=host_blocks, device="cpu"))


def block_tensors(identity: CacheIdentity, serials: Sequence[int]) -> dict[str, torch.Tensor]:
    """Deterministic block contents ``[L, n, BS, H, ...]``: block ``s`` depends only on ``s``."""
    per_block = []
    for s in serials:
        gen = torch.Generator().manual_seed(1000 + int(s))
        shape = (identity.num_layers, identity.block_size, identity.num_kv_heads)
        per_block.append({
            "k_packed": torch.randint(0, 256, (*shape, identity.head_dim // 2), generator=gen,
                                      dtype=torch.uint8),
            "k_norms": torch.rand(shape, generator=gen) + 0.5,
            "v_packed": torch.randint(0, 256, (*shape, identity.head_dim // 2), generator=gen,
                                      dtype=torch.uint8),
            "v_norms": torch.rand(shape, generator=gen) + 0.5,
        })
    return {n: torch.stack([b[n] for b in per_block], dim=1) for n in TENSOR_NAMES}


def add_blocks(cache: TQGPUCache, serials: Sequence[int], *, tenant: str = "default",
               source_layer: str = "memories", tier: Tier = Tier.HOST,
               keyed: bool = True) -> list[int]:
    """Import blocks whose bytes and key depend only on their serial number."""
    bs = cache.block_size
    metas = []
    for s in serials:
        tokens = [int(s) * 7919 + i for i in range(bs)]
        meta: dict[str, object] = {"source_layer": source_layer, "importance": 0.25,
                                   "token_range": (int(s) * bs, int(s) * bs + bs),
                                   "tenant_slug": tenant, "num_tokens": bs}
        if keyed:
            meta["key"] = cache.block_keys(tokens, tenant)[0]
        metas.append(meta)
    ids = cache.import_blocks(block_tensors(cache.identity, serials), metas, tier=tier)
    assert ids is not None, "test cache too small"
    return ids


def add_prefix(cache: TQGPUCache, num_blocks: int, *, tenant: str = "default",
               source_layer: str = "axioms", seed: int = 0) -> list[int]:
    """A chained prefix of blocks (keys via cache.block_keys over one token sequence)."""
    bs = cache.block_size
    tokens = [(seed * 131 + i * 17) % 50000 for i in range(num_blocks * bs)]
    keys = cache.block_keys(tokens, tenant)
    metas = [{"source_layer": source_layer, "importance": 0.9,
              "token_range": (i * bs, i * bs + bs), "tenant_slug": tenant, "num_tokens": bs,
              "key": keys[i]} for i in range(num_blocks)]
    serials = [10_000 * (seed + 1) + i for i in range(num_blocks)]
    ids = cache.import_blocks(block_tensors(cache.identity, serials), metas, tier=Tier.HOST)
    assert ids is not None
    return ids


def exported_by_key(cache: TQGPUCache, ids: Sequence[int] | None = None) -> dict[bytes, dict]:
    """Key -> that block's bytes per tensor, for exact comparisons across caches."""
    metas = [cache.metadata.get(b) for b in ids] if ids is not None else cache.metadata.all()
    metas = [m for m in metas if m.key is not None]
    tensors = cache.export_blocks([m.block_id for m in metas])
    return {m.key: {n: tensors[n][:, i].contiguous() for n in TENSOR_NAMES}
            for i, m in enumerate(metas)}


def forge_crc(data: bytearray, pos: int, target: int) -> None:
    """Rewrite ``data[pos:pos + 4]`` in place so that ``zlib.crc32(data) == target``.

    CRC-32 is affine over GF(2): flipping input bits flips a fixed set of output bits
    whatever the rest of the input, so the four bytes that restore any CRC are one
    32x32 linear system away. This is what a writer of the store can do to any block.
    """
    n = len(data)
    data[pos:pos + 4] = bytes(4)
    base = zlib.crc32(bytes(data))
    zero = zlib.crc32(bytes(n))
    columns = []
    for bit in range(32):
        unit = bytearray(n)
        unit[pos + bit // 8] = 1 << (bit % 8)
        columns.append(zlib.crc32(bytes(unit)) ^ zero)
    # rows: (coefficient mask over the 32 unknown bits, right-hand side bit)
    want = target ^ base
    rows = [(sum(((columns[i] >> j) & 1) << i for i in range(32)), (want >> j) & 1)
            for j in range(32)]
    solution = 0
    pivots: list[tuple[int, int, int]] = []
    for col in range(32):
        found = next((r for r in range(len(rows)) if (rows[r][0] >> col) & 1), None)
        assert found is not None, "CRC-32 over four consecutive bytes is always solvable"
        mask, rhs = rows.pop(found)
        rows = [(m ^ mask, r ^ rhs) if (m >> col) & 1 else (m, r) for m, r in rows]
        pivots = [(c, m ^ mask, r ^ rhs) if (m >> col) & 1 else (c, m, r)
                  for c, m, r in pivots]
        pivots.append((col, mask, rhs))
    for col, mask, rhs in pivots:
        assert mask == 1 << col
        solution |= rhs << col
    data[pos:pos + 4] = solution.to_bytes(4, "little")
    assert zlib.crc32(bytes(data)) == target


class FaultyStore(MeteredStore):
    """The real store, with queued faults on manifest writes (the commit point).

    ``faults`` holds what the next manifest writes do: ``"lost-ack"`` writes the
    manifest and then raises (the PUT reached the store, its response did not reach the
    writer: a timeout); ``"fail"`` raises before anything reaches the store. ``puts``
    counts writes per key, so a test can see that no object was written twice.
    """

    def __init__(self, inner: ShadowStore) -> None:
        super().__init__(inner)
        self.faults: list[str] = []
        self.puts: Counter[str] = Counter()

    def _fault(self, key: str) -> str | None:
        if key.endswith("/manifest.json") and self.faults:
            return self.faults.pop(0)
        return None

    def put(self, key: str, data: Any) -> None:
        fault = self._fault(key)
        if fault == "fail":
            raise ShadowStoreError(f"{self.url}/{key}: connection reset (simulated)")
        super().put(key, data)
        self.puts[key] += 1
        if fault == "lost-ack":
            raise ShadowStoreError(f"{self.url}/{key}: timed out waiting for the response "
                                   "(simulated; the write landed)")

    def open_writer(self, key: str) -> BlobWriter:
        self.puts[key] += 1
        return super().open_writer(key)


def segment_blob(root: Path, session_id: str, tensor: str, segment: int = -1) -> Path:
    """The file of ``tensor`` in a session's ``segment``-th segment (by its manifest)."""
    manifest = json.loads((root / session_id / "manifest.json").read_bytes())
    return root / manifest["segments"][segment]["files"][tensor]
