"""Two connector replicas sharing one live tier (no vLLM): what replica A computes and
stores, replica B finds by name, brings into its DDR tier and loads byte for byte;
tenants, refusals and write-behind deduplication on the way."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from integrations.vllm.config import ConnectorConfig, ConnectorConfigError
from integrations.vllm.identity import vllm_cache_identity
from integrations.vllm.ledger import ledger_path
from integrations.vllm.metrics import ContextKitPromMetrics
from integrations.vllm.planning import RequestPlanner, StepRequest, WorkerReport
from integrations.vllm.shared import SharedLookups, SharedWriter
from integrations.vllm.store import ConnectorStore
from shadow.shared import SharedChunk, SharedTier
from shadow.shared.objects import assemble_object, split_object
from tests.integrations.vllm.conftest import TINY_DIM, TINY_HEADS, TINY_LAYERS
from tests.integrations.vllm.prometheus_registry import metric_types, samples
from tests.integrations.vllm.replica_kit import Replica
from tests.shadow.shared_mutations import signed, unsigned

BS, C = 16, 4
KEY = "shared-test-key"


def _replica(model: Path, tmp: Path, name: str, stats: Path | None = None,
             host_blocks: int = 64, ledger: Path | None = None) -> Replica:
    config = ConnectorConfig(block_size=BS, shadow_url="", shadow_on_save=False,
                             local_store=f"file://{tmp / name}", host_blocks=host_blocks,
                             shared_url=f"file://{tmp / 'shared'}", shared_chunk_blocks=C)
    ident = vllm_cache_identity(str(model), BS)
    store = ConnectorStore(ident, config)
    planner = RequestPlanner(ident.digest(), BS, policy=config.policy, head_dim=TINY_DIM,
                             chunk_blocks=C)
    tier = SharedTier(ident, config.shared_tier(), mac_key=KEY, writer=f"{name}-w")
    writer = SharedWriter(tier, store, log_path=str(stats or ""), ledger_path=ledger)
    lookups = SharedLookups(SharedTier(ident, config.shared_tier(), mac_key=KEY,
                                       writer=f"{name}-l"), C)
    return Replica(planner, store, writer, lookups)


@pytest.fixture
def replicas(model: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    a = _replica(model, tmp_path, "a", tmp_path / "a-stats.jsonl")
    b = _replica(model, tmp_path, "b")
    yield a, b
    a.close()
    b.close()


TOKENS = list(range(1000, 1000 + 10 * BS + 5))  # 10 full blocks and 5 tokens


def _compute(rep: Replica, req: str, tokens: list[int], tenant: str = "acme") -> list[bytes]:
    """Replica computes the whole prompt and saves its blocks (as the connector does)."""
    rep.planner.matched_tokens(req, tokens, len(tokens), 0, tenant=tenant)
    _, saves = rep.planner.plan([StepRequest(req, tokens, 0, len(tokens), list(range(11)))])
    g = torch.Generator().manual_seed(7)
    stored: list[bytes] = []
    for spec in saves:
        n = len(spec.keys)
        shape = (TINY_LAYERS, n, BS, TINY_HEADS, TINY_DIM)
        k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        result = rep.store.save(k, v, spec.keys, spec.tenant, spec.labels)
        held = set(spec.keys) - set(result.failed) - set(result.skipped)
        rep.writer.saved(spec, held)
        stored += result.stored
    assert rep.writer.flush()
    return stored


def _lookup(rep: Replica, req: str, tokens: list[int], tenant: str = "acme") -> int:
    """Blocks the replica would load (DDR, then the shared tier), polling as vLLM does."""
    hit = rep.planner.matched_tokens(req, tokens, len(tokens), 0, tenant=tenant)
    local = hit // BS
    t, keys = rep.planner.lookup_keys(req)
    for _ in range(500):
        end = rep.lookups.lookup(req, t, keys, local)
        if end is not None:
            break
        time.sleep(0.01)
    assert end is not None
    if end > local:
        rep.planner.note_shared(req, local, end)
    return end


def _load(rep: Replica, req: str, tokens: list[int], end: int) -> tuple[list[bytes], int]:
    rep.planner.on_alloc(req, end * BS)
    loads, _ = rep.planner.plan([StepRequest(req, tokens, end * BS, len(tokens) - end * BS,
                                             list(range(11)))])
    (spec,) = loads
    imported, _ = rep.writer.bring_in(spec)
    parts = rep.store.read_parts(spec.keys, spec.tenant)
    return imported, sum(len(p) for p, _, _ in parts)


def test_a_prompt_one_replica_computed_loads_on_the_other(replicas: tuple[Replica, Replica],
                                                           tmp_path: Path) -> None:
    a, b = replicas
    stored = _compute(a, "r1", TOKENS)
    assert len(stored) == 10
    # whole chunks only: blocks 0-7 (chunk 2 would end past the prompt's last full block)
    assert _lookup(b, "r2", TOKENS) == 8
    imported, loaded = _load(b, "r2", TOKENS, 8)
    assert len(imported) == 8 and loaded == 8
    ka, va = a.store.read(stored[:8], "acme")  # type: ignore[misc]
    kb, vb = b.store.read(stored[:8], "acme")  # type: ignore[misc]
    assert torch.equal(ka, kb) and torch.equal(va, vb)  # the same bytes, the same KV
    # B's DDR tier holds them now: its next lookup is local, no shared request
    b.lookups.tier.take_counters()
    assert b.planner.matched_tokens("r3", TOKENS, len(TOKENS), 0, tenant="acme") == 0
    b.planner.apply(WorkerReport(stored=set(imported)))  # the worker reports the import
    assert b.planner.matched_tokens("r4", TOKENS, len(TOKENS), 0, tenant="acme") == 8 * BS
    # the upload's lag is logged per chunk
    lines = [json.loads(x) for x in (tmp_path / "a-stats.jsonl").read_text().splitlines()]
    uploads = [x for x in lines if x["event"] == "shared_upload"]
    assert len(uploads) == 2 and all(x["uploaded"] and x["lag_s"] >= 0 for x in uploads)


def test_another_tenant_finds_nothing_of_the_same_prompt(replicas: tuple[Replica, Replica]
                                                         ) -> None:
    a, b = replicas
    _compute(a, "r1", TOKENS, tenant="acme")
    assert _lookup(b, "r2", TOKENS, tenant="globex") == 0
    assert b.lookups.tier.take_counters()["heads"] == 2  # asked, by globex's names


def test_a_tampered_chunk_is_refused_and_its_blocks_recomputed(
        replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    stored = _compute(a, "r1", TOKENS)
    second = a.writer.tier.path("acme", stored[7])
    data = bytearray(a.writer.tier.store.get(second))
    data[-100] ^= 0xFF
    a.writer.tier.store.put(second, bytes(data))
    assert _lookup(b, "r2", TOKENS) == 8  # a HEAD cannot tell
    imported, loaded = _load(b, "r2", TOKENS, 8)
    assert len(imported) == 4 and loaded == 4  # blocks 4-7: load errors, vLLM recomputes
    assert b.writer.ledger.totals()["counters"]["shared_refused"] == 1


def _nan_importance(doc: dict[str, Any]) -> None:
    doc["blocks"][0]["importance"] = float("nan")


def _version_99(doc: dict[str, Any]) -> None:
    doc["version"] = 99


def _position_past_the_chunk(doc: dict[str, Any]) -> None:
    doc["parts"][0]["positions"][-1] = 99


def _written_at_text(doc: dict[str, Any]) -> None:
    doc["written_at"] = "yesterday"


def _short_tensor(doc: dict[str, Any]) -> None:
    doc["parts"][0]["tensors"]["k_packed"]["shape"][-1] //= 2


@pytest.mark.parametrize("mutate", [_nan_importance, _version_99, _position_past_the_chunk,
                                    _written_at_text, _short_tensor])
def test_a_mac_valid_malformed_chunk_is_refused_on_the_load_path(
        replicas: tuple[Replica, Replica], mutate: Callable[[dict[str, Any]], None]) -> None:
    # a replica holding the key but running other code wrote chunk 1: the load
    # (start_load_kv -> bring_in) refuses it, counts it, and loads what it can
    a, b = replicas
    stored = _compute(a, "r1", TOKENS)
    second = a.writer.tier.path("acme", stored[7])
    doc, body = split_object(a.writer.tier.store.get(second))
    mutate(doc)
    a.writer.tier.store.put(second, assemble_object(json.dumps(doc).encode(), bytes(body),
                                                    KEY.encode()))
    assert _lookup(b, "r2", TOKENS) == 8
    imported, loaded = _load(b, "r2", TOKENS, 8)
    assert len(imported) == 4 and loaded == 4  # chunk 0; chunk 1's blocks recompute
    assert b.writer.ledger.totals()["counters"]["shared_refused"] == 1


def test_fuzzed_chunks_never_raise_out_of_the_load_path(replicas: tuple[Replica, Replica]
                                                        ) -> None:
    # seeded mutations of chunk 1, with and without the key: every load returns,
    # chunk 0 always loads, chunk 1 only when the reader serves what it holds
    a, b = replicas
    stored = _compute(a, "r1", TOKENS)
    second = a.writer.tier.path("acme", stored[7])
    original = a.writer.tier.store.get(second)
    rng = random.Random(53)
    for i in range(40):
        m = (signed(original, rng, KEY.encode()) if i % 2 else
             unsigned(original, rng, b.writer.tier.max_object_bytes))
        a.writer.tier.store.put(second, m.data)
        assert _lookup(b, f"f{i}", TOKENS) == 8
        imported, loaded = _load(b, f"f{i}", TOKENS, 8)  # never raises
        assert loaded in (4, 8) and set(imported) <= set(stored[:8]), m.name
        if loaded == 8:  # served: a MAC-valid object the reader accepts
            break


class UncheckedTier(SharedTier):
    """A tier that serves chunks no check saw (a bug past decode): the load path is
    the last line."""

    chunks: list[SharedChunk]

    def fetch(self, tenant: str, last_keys: Any, deadline_s: float | None = None
              ) -> list[SharedChunk]:
        return list(self.chunks)


def test_an_import_that_fails_is_a_refusal_not_an_exception(
        model: Path, tmp_path: Path, replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    stored = _compute(a, "r1", TOKENS)
    chunk = a.writer.tier.fetch("acme", [stored[3]])[0]
    chunk.parts[0].positions[-1] = 99  # past the chunk's blocks: import_chunk raises
    tier = UncheckedTier(b.writer.tier.identity, b.writer.tier.config, mac_key=KEY,
                         writer="b-unchecked")
    tier.chunks = [chunk]
    b.writer.tier, real = tier, b.writer.tier
    try:
        assert _lookup(b, "r2", TOKENS) == 8
        imported, loaded = _load(b, "r2", TOKENS, 8)
        assert imported == [] and loaded == 0  # all of it recomputes
        assert b.writer.ledger.totals()["counters"]["shared_refused"] == 1
    finally:
        b.writer.tier = real
        tier.close()


def test_a_replica_does_not_upload_what_the_tier_holds(replicas: tuple[Replica, Replica]
                                                       ) -> None:
    a, b = replicas
    _compute(a, "r1", TOKENS)
    _compute(b, "r2", TOKENS)  # B computed it too (its lookup missed the deadline)
    counters = b.writer.ledger.totals()["counters"]
    # no chunk uploaded (its one PUT is its lease: the chunks it holds)
    assert counters["shared_deduplicated"] == 2 and "shared_bytes_up" not in counters
    assert counters["shared_puts"] == 1


def test_a_chunk_completed_across_two_saves_is_uploaded_once_whole(
        replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    tokens = TOKENS[:6 * BS]
    a.planner.matched_tokens("r", tokens, len(tokens), 0, tenant="acme")
    g = torch.Generator().manual_seed(3)
    for done, step in ((0, 2 * BS), (2 * BS, 4 * BS)):  # chunked prefill: 2 then 4 blocks
        _, saves = a.planner.plan([StepRequest("r", tokens, done, step, list(range(6)))])
        for spec in saves:
            shape = (TINY_LAYERS, len(spec.keys), BS, TINY_HEADS, TINY_DIM)
            k = torch.randn(shape, generator=g)
            result = a.store.save(k, k.clone(), spec.keys, "acme", spec.labels)
            a.writer.saved(spec, set(result.stored))
    assert a.writer.flush()
    counters = a.writer.ledger.totals()["counters"]
    assert counters["shared_puts"] == 2  # chunk 0, whole, and the lease
    assert _lookup(b, "x", [*tokens, 1]) == 4


class _VllmConfig:
    instance_id = "replica-a"
    kv_transfer_config = None


def test_uploads_reach_metrics_when_they_land_not_with_the_next_step(model: Path,
                                                                      tmp_path: Path) -> None:
    # vLLM carries step stats only with a step: an upload that lands after its turn
    # would show at the server's next request. The writer publishes its ledger instead.
    ledgers = tmp_path / "ledgers"
    a = _replica(model, tmp_path, "a", ledger=ledger_path("replica-a", 0, ledgers))
    registry = CollectorRegistry()
    prom = ContextKitPromMetrics(_VllmConfig(), metric_types(registry),
                                 ["model_name", "engine"], {0: ["m", "0"]},
                                 ledger_dir=ledgers, ledger_poll_s=0)
    try:
        _compute(a, "r1", TOKENS)  # saves, then the writer thread uploads
        step = (a.store.take_stats() or {}).get("counters", {})
        assert not [name for name in step if name.startswith("shared_")]  # none rides a step
        prom.poll_ledgers()
        got = samples(registry)
        e0 = (("engine", "0"), ("model_name", "m"))
        assert got[("vllm:contextkit_shared_puts_total", e0)] == 3  # two chunks, the lease
        assert got[("vllm:contextkit_shared_bytes_up_total", e0)] > 0
        assert got[("vllm:contextkit_shared_lag_seconds", e0)] > 0
    finally:
        a.close()
    assert list(ledgers.iterdir()) == []  # a clean stop leaves no ledger


def test_shared_settings_are_checked_in_one_line() -> None:
    with pytest.raises(ConnectorConfigError, match="shared_deadline_s"):
        ConnectorConfig(shared_url="file:///tmp/x", shared_deadline_s=0)
    with pytest.raises(ConnectorConfigError, match="shared_url must be a URL"):
        ConnectorConfig(shared_url="/tmp/x")


def test_a_replica_that_starts_warms_its_ddr_tier_from_what_the_fleet_holds(
        model: Path, tmp_path: Path, replicas: tuple[Replica, Replica]) -> None:
    a, _ = replicas
    stored = _compute(a, "r1", TOKENS)
    a.writer._next_lease = 0.0  # renew now (it renews every lease_s / 3)
    a.writer._chores()
    c = _replica(model, tmp_path, "c")
    try:
        warmed: list[bytes] = []
        c.writer.start_warm(1 << 30, lambda keys, removed: warmed.extend(keys))
        assert c.writer.flush()
        assert sorted(warmed) == sorted(stored[:8])  # A's whole chunks, no request
        assert set(c.store.keys()) == set(stored[:8])
    finally:
        c.close()


def test_a_clean_stop_releases_the_writers_lease(model: Path, tmp_path: Path) -> None:
    # a stopped replica holds nothing: its lease goes, so collection may take its
    # chunks on age and a replica that starts warms nothing from it
    a = _replica(model, tmp_path, "a")
    _compute(a, "r1", TOKENS)
    a.writer._next_lease = 0.0  # renew now (it renews every lease_s / 3)
    a.writer._chores()
    leases = a.writer.tier.lease_prefix
    assert a.writer.tier.store.list(leases) == [leases + "a-w"]
    a.close()
    c = _replica(model, tmp_path, "c")
    try:
        assert c.writer.tier.store.list(leases) == []
        warmed: list[bytes] = []
        c.writer.start_warm(1 << 30, lambda keys, removed: warmed.extend(keys))
        assert c.writer.flush()
        assert warmed == []
    finally:
        c.close()


def test_blocks_evicted_to_make_room_for_an_import_are_forgotten(
        model: Path, tmp_path: Path, replicas: tuple[Replica, Replica]) -> None:
    a, _ = replicas
    _compute(a, "r1", TOKENS)
    c = _replica(model, tmp_path, "c", host_blocks=8)  # room for about 8 blocks
    try:
        own = _compute(c, "mine", list(range(5000, 5000 + 6 * BS + 1)))
        assert own
        assert _lookup(c, "r2", TOKENS) == 8
        _load(c, "r2", TOKENS, 8)
        # every key the store still lists is one it can read; the evicted are gone
        listed = set(c.store.keys())
        assert all(c.store.read([k], "acme") is not None for k in listed)
        assert not listed >= set(own)  # the import evicted some of its own blocks
    finally:
        c.close()
