"""Helpers for shadow tests: small real caches filled with deterministic blocks.

Imported by the test modules and by the crash-test worker processes (conftest puts
this directory on ``sys.path``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu_cache import TENSOR_NAMES, CacheConfig, CacheIdentity, Tier, TQGPUCache

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
