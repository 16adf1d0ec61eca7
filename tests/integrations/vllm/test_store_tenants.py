"""The connector's store under tenant-fair pinning and with arbitrary vLLM cache salts
(no vLLM needed)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from gpu_cache import hash_token_blocks
from integrations.vllm.config import ConnectorConfig
from integrations.vllm.identity import vllm_cache_identity
from integrations.vllm.planning import BlockLabel
from integrations.vllm.store import ConnectorStore

BS, LAYERS, HEADS, DIM = 16, 2, 2, 64


def _kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    shape = (LAYERS, n, BS, HEADS, DIM)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _store(model: Path, tmp: Path) -> ConnectorStore:
    ident = vllm_cache_identity(str(model), BS)
    return ConnectorStore(ident, ConnectorConfig(
        block_size=BS, shadow_url=f"file://{tmp / 'shadow'}", host_blocks=256,
        device_blocks=16, shadow_on_save=False))


def test_pinned_saves_respect_each_tenants_quota(model: Path, tmp_path: Path) -> None:
    store = _store(model, tmp_path)  # 16 device blocks: quota 4 per tenant, cap 12
    k, v = _kv(6)
    for i in range(5):
        tenant = f"tenant-{i}"
        keys = hash_token_blocks(store.identity.digest(), tenant, list(range(6 * BS)), BS)
        result = store.save(k, v, keys, tenant, [BlockLabel("axioms", pinned=True)] * 6)
        assert result.stored == keys  # stored whatever the pins
        held = Counter(m.tenant_slug for m in store.cache.metadata.pinned())
        assert max(held.values(), default=0) <= 4 and sum(held.values()) <= 12
        assert store.read(keys, tenant) is not None


def test_any_cache_salt_is_a_tenant_of_its_own(model: Path, tmp_path: Path) -> None:
    store = _store(model, tmp_path)
    k, v = _kv(2)
    salts = ["user 42", "c2FsdA+/==", "", "a\nb", "acme"]
    for salt in salts:
        keys = hash_token_blocks(store.identity.digest(), salt, list(range(2 * BS)), BS)
        assert store.save(k, v, keys, salt, [BlockLabel("memories")] * 2).stored == keys
        got = store.read(keys, salt)
        assert got is not None and got[0].shape[1] == 2
        for other in salts:
            if other != salt:
                assert store.read(keys, other) is None
    assert len({m.tenant_slug for m in store.cache.metadata.all()}) == len(salts)
