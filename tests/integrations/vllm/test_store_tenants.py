"""The connector's store under tenant-fair pinning and with arbitrary vLLM cache salts
(no vLLM needed)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import torch

from gpu_cache import hash_token_blocks
from integrations.vllm.config import ConnectorConfig
from integrations.vllm.identity import vllm_cache_identity
from integrations.vllm.precision import BlockLabel
from integrations.vllm.store import ConnectorStore, SaveResult

BS, LAYERS, HEADS, DIM = 16, 2, 2, 64


def _kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    shape = (LAYERS, n, BS, HEADS, DIM)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _store(model: Path, tmp: Path, **config: Any) -> ConnectorStore:
    ident = vllm_cache_identity(str(model), BS)
    config = {"host_blocks": 256, "device_blocks": 16, "pin_share": 0.25, **config}
    return ConnectorStore(ident, ConnectorConfig(
        block_size=BS, shadow_url=f"file://{tmp / 'shadow'}", shadow_on_save=False, **config))


def _save_prefix(store: ConnectorStore, num_blocks: int, tenant: str = "acme") -> SaveResult:
    k, v = _kv(num_blocks)
    keys = hash_token_blocks(store.identity.digest(), tenant, list(range(num_blocks * BS)), BS)
    return store.save(k, v, keys, tenant, [BlockLabel("axioms", pinned=True)] * num_blocks)


def _pinned(store: ConnectorStore) -> int:
    return sum(len(pool.cache.metadata.pinned()) for pool in store.pools.values())


def test_the_documented_defaults_pin_a_realistic_stable_prefix(model: Path,
                                                               tmp_path: Path) -> None:
    # 33 blocks of 32 tokens: the ~1K-token stable layers of an agent's prompt
    defaults = ConnectorConfig()
    store = _store(model, tmp_path, host_blocks=64, device_blocks=defaults.device_blocks,
                   pin_share=defaults.pin_share)
    result = _save_prefix(store, 33)
    assert result.unpinned is None and _pinned(store) == 33


def test_an_unpinned_prefix_says_how_many_blocks_and_which_key_to_raise(
        model: Path, tmp_path: Path) -> None:
    store = _store(model, tmp_path, host_blocks=64, device_blocks=64, pin_share=0.25)
    result = _save_prefix(store, 33)
    assert len(result.stored) == 33 and _pinned(store) == 0
    assert result.unpinned is not None
    assert "needs 33 device blocks, over its quota of 16" in result.unpinned
    assert "pin_share=0.25 of device_blocks=64" in result.unpinned
    # either key, raised to a value that fits, named as the connector calls it
    assert "raise pin_share to 0.52 or device_blocks to 132" in result.unpinned
    assert "num_device_blocks" not in result.unpinned and "tenant_share" not in result.unpinned
    # and the advice works: the keys it names pin the same prefix
    for fix in ({"pin_share": 0.52}, {"device_blocks": 132}):
        sizes = {"host_blocks": 64, "device_blocks": 64, "pin_share": 0.25, **fix}
        again = _store(model, tmp_path / next(iter(fix)), **sizes)
        assert _save_prefix(again, 33).unpinned is None and _pinned(again) == 33


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
