"""The connector's store evicts across its format pools lowest semantic priority first,
whatever the pools, the room formats, the demotions and the tenants (no vLLM needed).

The invariant, per save (:func:`integrations.vllm.pools.fit_budget`): every block a save
evicts ranks (layer priority, importance) at most as high as every unpinned block that
stays and that the save did not store itself, in any pool and of any tenant; and the
DDR tier holds at most the byte budget afterwards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch

from gpu_cache.metadata import DEFAULT_SOURCE_PRIORITY, PINNABLE_SOURCES
from integrations.vllm import store as store_module
from integrations.vllm.config import ConnectorConfig
from integrations.vllm.identity import vllm_cache_identity
from integrations.vllm.pools import Pool, held_bytes
from integrations.vllm.precision import DEFAULT_POLICY, BlockLabel, PrecisionPolicy
from integrations.vllm.store import ConnectorStore, SaveResult, shadow_manifest

BS, LAYERS, HEADS, DIM = 16, 2, 2, 64

#: key -> (tenant, source layer, importance, pinned) of every held block
Held = dict[bytes, tuple[str, str, float, bool]]


def _store(model: Path, host_blocks: int) -> ConnectorStore:
    config = ConnectorConfig(block_size=BS, shadow_url="", shadow_on_save=False,
                             host_blocks=host_blocks, device_blocks=64)
    return ConnectorStore(vllm_cache_identity(str(model), BS), config)


def _kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, n, BS, HEADS, DIM)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _key(tenant: str, *content: str) -> bytes:
    """A chained block key: the tenant and every block's content up to this one."""
    return hashlib.sha256("\0".join((tenant, *content)).encode()).digest()


def _held(store: ConnectorStore) -> Held:
    return {bytes(m.key): (m.tenant_slug, m.source_layer, m.importance, m.pinned)
            for pool in store.pools.values() for m in pool.cache.metadata.all()
            if m.key is not None}


def _rank(record: tuple[str, str, float, bool]) -> tuple[int, float]:
    return DEFAULT_SOURCE_PRIORITY.get(record[1], 50), record[2]


def _checked_save(store: ConnectorStore, keys: Sequence[bytes], tenant: str,
                  labels: Sequence[BlockLabel], seed: int) -> SaveResult:
    """``store.save`` of random K/V, then the invariant of this module on what it did."""
    before = _held(store)
    result = store.save(*_kv(len(keys), seed), list(keys), tenant, list(labels))
    after = _held(store)
    gone = {key: before[key] for key in before.keys() - after.keys()}
    stayed = {key: after[key] for key in before.keys() & after.keys() if not after[key][3]}
    assert set(result.removed) == gone.keys()
    if gone and stayed:
        worst = max(gone.values(), key=_rank)
        best = min(stayed.values(), key=_rank)
        assert _rank(worst) <= _rank(best), (
            f"evicted {worst[1]} ({worst[0]}) while {best[1]} ({best[0]}) stayed; gone "
            f"{sorted({r[1] for r in gone.values()})}, lower ones kept "
            f"{sorted({r[1] for r in stayed.values() if _rank(r) < _rank(worst)})}")
    held = held_bytes(list(store.pools.values()))
    assert held <= store.budget, f"{held} bytes held over the budget of {store.budget}"
    return result


def _policy_labels(layers: Sequence[str], policy: PrecisionPolicy,
                   importance: dict[str, float] | None = None) -> list[BlockLabel]:
    """A request's labels as the planner gives them (formats by ``policy``: sink,
    raised layers within the byte budget, room formats)."""
    imp = importance or {}
    labels = [BlockLabel(layer, imp.get(layer, 0.5), pinned=layer in PINNABLE_SOURCES)
              for layer in layers]
    fmts = policy.formats_for(labels, DIM)
    return [dataclasses.replace(label, fmt=fmt, room_fmt=policy.room_for(fmt))
            for label, fmt in zip(labels, fmts, strict=True)]


# ---------------------------------------------------------------- demotion into a new pool
def test_blocks_demoted_into_a_pool_made_by_the_demotion_are_evicted_in_order(
        model: Path) -> None:
    # budget: 10 tq4 blocks of bytes (36 units each at D=64; int8 68, k5v4 40, fp16 128)
    store = _store(model, host_blocks=10)
    # 4 memories stored int8 (their rules' format) and 1 system_state block whose rules
    # say k5v4, stored int8 while there is room: 340 of 360 units; no k5v4 pool yet
    mem = [_key("acme", "mem", str(i)) for i in range(4)]
    state = [_key("acme", "state")]
    assert _checked_save(store, mem, "acme", [BlockLabel("memories", 0.5, fmt="int8")] * 4,
                         seed=1).stored == mem
    assert _checked_save(store, state, "acme",
                         [BlockLabel("system_state", 0.5, fmt="k5v4", room_fmt="int8")],
                         seed=2).stored == state
    assert not any(p.fmt == "k5v4" for p in store.pools.values())
    # a request's sink (fp16, its first group) needs 108 units more: the system_state
    # block is transcoded to k5v4 (into a pool the demotion makes), which frees 28;
    # then 80 more go by eviction: the system_state block (priority 12, now 40 units
    # in the k5v4 pool) before any memory (35), then one memory (68)
    sink = [_key("acme", "sink")]
    result = _checked_save(store, sink, "acme",
                           [BlockLabel("axioms", 1.0, fmt="fp16")], seed=3)
    assert result.stored == sink
    assert sorted(map(str, result.removed_layers)) == ["memories", "system_state"]


def test_every_budget_check_sees_every_pool(model: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # the agent e2e's opening: two small requests whose k5v4 blocks fit as int8 (room
    # format), then an agent's first prompt, whose fp16 sink group is saved first and
    # needs room: its demotion makes the k5v4 pool, which the eviction must count
    store = _store(model, host_blocks=31)
    seen: list[tuple[set[int], set[int]]] = []
    real = store_module.fit_budget

    def spy(pools: Sequence[Pool], pool: Pool, num_blocks: int, budget: int,
            protect: Mapping[int, set[int]] | None = None) -> bool:
        seen.append(({id(p) for p in pools}, {id(p) for p in store.pools.values()}))
        return real(pools, pool, num_blocks, budget, protect)

    monkeypatch.setattr(store_module, "fit_budget", spy)
    probe = ["axioms", "axioms", "memories", "memories", *["user_turn"] * 4]
    mismatch = ["user_turn"] * 8  # labels refused: the default layer, nothing pinned
    for seed, (tenant, layers) in enumerate((("probe", probe), ("probe-mismatch", mismatch))):
        keys = [_key(tenant, *map(str, range(b + 1))) for b in range(len(layers))]
        _checked_save(store, keys, tenant, _policy_labels(layers, DEFAULT_POLICY), seed=seed)
    agent = [*["axioms"] * 3, *["identity"] * 2, *["rules"] * 4, *["capabilities"] * 3,
             "neurons", *["memories"] * 5, *["system_state"] * 3, "current_time", "affect",
             "awareness"]
    keys = [_key("acme", *map(str, range(b + 1))) for b in range(len(agent))]
    result = _checked_save(store, keys, "acme", _policy_labels(agent, DEFAULT_POLICY), seed=9)
    assert result.stored == keys
    assert seen and all(given == live for given, live in seen), [
        (len(given), len(live)) for given, live in seen if given != live]


# ---------------------------------------------------------------- agent-shaped sequences
STABLE = [("axioms", 2), ("identity", 2), ("rules", 2), ("capabilities", 2)]
LATE = [("neurons", 1), ("memories", 3), ("affect", 1), ("awareness", 1)]


def _prompt(turn: int, volatile_in_main: bool, history: Sequence[int]) -> list[tuple[str, str]]:
    """(source layer, content) per block of an agent's prompt at ``turn``: the stable
    layers, the state and time (in the main message until the pipeline moves them
    last), memories, the history of earlier turns, the question."""
    blocks = [(layer, f"{layer}{i}") for layer, n in STABLE for i in range(n)]
    volatile = [("system_state", f"state{turn}a"), ("system_state", f"state{turn}b"),
                ("current_time", f"time{turn}")]
    if volatile_in_main:
        blocks += volatile
    blocks += [(layer, f"{layer}{i}") for layer, n in LATE for i in range(n)]
    for t in range(turn):
        blocks += [("user_turn", f"turn{t}.{i}") for i in range(history[t])]
    if not volatile_in_main:
        blocks += volatile
    return [*blocks, ("user_turn", f"question{turn}")]


@pytest.mark.parametrize(("host_blocks", "policy", "tenants", "seed"), [
    (24, DEFAULT_POLICY, ("acme",), 0),
    (31, DEFAULT_POLICY, ("acme", "globex"), 1),
    (40, DEFAULT_POLICY, ("acme", "globex"), 2),
    (31, dataclasses.replace(DEFAULT_POLICY, room_format=None), ("acme", "globex"), 3),
    (29, PrecisionPolicy(default="tq4", max_vs_fp16=0.33, room_format="int8"),
     ("acme", "globex"), 4),
], ids=["one-tenant", "two-tenants", "two-tenants-roomy", "no-room-format", "tq4"])
def test_agent_turns_evict_lowest_priority_first_across_pools(
        model: Path, host_blocks: int, policy: PrecisionPolicy, tenants: tuple[str, ...],
        seed: int) -> None:
    rng = random.Random(seed)
    store = _store(model, host_blocks)
    importance = {"user_turn": 0.3}
    history = [rng.randint(1, 3) for _ in range(8)]
    schedule = [(tenant, turn) for tenant in tenants for turn in range(5)]
    schedule.insert(5, (tenants[0], 0))  # the first prompt again: re-saves what left
    for step, (tenant, turn) in enumerate(schedule):
        blocks = _prompt(turn, volatile_in_main=turn == 0, history=history)
        layers = [layer for layer, _ in blocks]
        keys = [_key(tenant, *(c for _, c in blocks[:b + 1])) for b in range(len(blocks))]
        labels = _policy_labels(layers, policy, importance)
        if rng.random() < 0.5:
            store.read(keys, tenant)  # a load touches the held prefix
        # a chunked prefill saves a prompt in runs; keys already held are skipped
        cut = rng.randint(1, len(keys) - 1) if rng.random() < 0.4 else len(keys)
        for a, b in ((0, cut), (cut, len(keys))):
            if a < b:
                _checked_save(store, keys[a:b], tenant, labels[a:b], seed=100 * step + a)


# ---------------------------------------------------------------- what the shadow says
def test_the_shadow_of_a_pool_evicted_empty_holds_none_of_its_blocks(
        model: Path, tmp_path: Path) -> None:
    # what the agent e2e test reads (shadow_manifest: every pool's session, merged) must
    # be what the store holds: a pool whose last block was evicted commits an empty
    # session, or its evicted block reads as kept (there: an int8 system_state block
    # "stayed" while the memories evicted after it were gone)
    config = ConnectorConfig(block_size=BS, shadow_url=f"file://{tmp_path / 'shadow'}",
                             local_store=f"file://{tmp_path / 'local'}", shadow_on_save=False,
                             host_blocks=10, device_blocks=64)
    store = ConnectorStore(vllm_cache_identity(str(model), BS), config)
    store.open_shadow(restored=False)
    state = [_key("acme", "state")]
    assert _checked_save(store, state, "acme", [BlockLabel("system_state", 0.5, fmt="int8")],
                         seed=1).stored == state
    store.shadow_now()
    # 8 memories in k5v4 (320 of 360 units) do not fit beside it (68): it is evicted and
    # the int8 pool is empty
    mem = [_key("acme", "mem", str(i)) for i in range(8)]
    result = _checked_save(store, mem, "acme", [BlockLabel("memories", 0.5, fmt="k5v4")] * 8,
                           seed=2)
    assert result.stored == mem and result.removed == state
    assert not any(len(p.cache.metadata) for p in store.pools.values() if p.fmt == "int8")
    store.shadow_now()
    manifest = shadow_manifest(config)
    assert manifest is not None
    assert {bytes.fromhex(r.key) for r in manifest.blocks if r.key} == set(store.keys())
    store.close()
