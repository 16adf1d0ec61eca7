"""Chunk reuse across replicas (no vLLM): a span replica A registers is published to
the shared tier as a span object; replica B, whose chunk index lacks it, finds it by
its content key, plans it at another position and brings its blocks in byte for byte.
Tenants, forged objects and spans at the wrong name are refused on the way."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from contextkit.pipeline.served.wire import chunk_salt
from integrations.vllm.chunk_planning import ChunkLoad, ChunkPlanner
from integrations.vllm.config import ConnectorConfig
from integrations.vllm.identity import vllm_cache_identity
from integrations.vllm.planning import RequestPlanner, StepRequest, WorkerReport, semantic_params
from integrations.vllm.shared import SharedLookups, SharedWriter
from integrations.vllm.store import ConnectorStore
from shadow.shared import SharedObjectError, SharedTier, decode_chunk, encode_chunk
from shadow.shared.retention import collect
from tests.integrations.vllm.conftest import TINY_DIM, TINY_HEADS, TINY_LAYERS
from tests.integrations.vllm.replica_kit import Replica

BS, C = 16, 4
KEY = "shared-chunks-test-key"
TENANT = chunk_salt("acme")
HEAD = list(range(10, 10 + BS))  # one block of rules, the same every turn
DOCS = {"a": list(range(1000, 1000 + 2 * BS)), "b": list(range(2000, 2000 + 2 * BS))}


def prompt(order: str, question: int) -> tuple[list[int], dict]:
    ids, spans = list(HEAD), [(0, BS, "rules")]
    for name in order:
        spans.append((len(ids), len(ids) + len(DOCS[name]), "documents"))
        ids += DOCS[name]
    turn = [question] * 5
    spans.append((len(ids), len(ids) + len(turn), "user_turn"))
    ids += turn
    return ids, semantic_params(spans, prompt_token_ids=ids)


def replica(model: Path, tmp: Path, name: str) -> Replica:
    config = ConnectorConfig(block_size=BS, shadow_url="", shadow_on_save=False,
                             local_store=f"file://{tmp / name}", host_blocks=64,
                             shared_url=f"file://{tmp / 'shared'}", shared_chunk_blocks=C)
    ident = vllm_cache_identity(str(model), BS)
    chunks = ChunkPlanner(ident.digest(), BS, min_tokens=16, repair_first=2)
    planner = RequestPlanner(ident.digest(), BS, policy=config.policy, head_dim=TINY_DIM,
                             chunk_blocks=C, chunks=chunks)
    planner.apply(WorkerReport(chunk_status=""))  # the worker's model check passed
    store = ConnectorStore(ident, config)
    writer = SharedWriter(SharedTier(ident, config.shared_tier(), mac_key=KEY,
                                     writer=f"{name}-w"), store)
    lookups = SharedLookups(SharedTier(ident, config.shared_tier(), mac_key=KEY,
                                       writer=f"{name}-l"), C)
    return Replica(planner, store, writer, lookups)


@pytest.fixture
def replicas(model: Path, tmp_path: Path) -> Iterator[tuple[Replica, Replica]]:
    a, b = replica(model, tmp_path, "a"), replica(model, tmp_path, "b")
    yield a, b
    a.close()
    b.close()


def compute(rep: Replica, req: str, ids: list[int], params: dict, tenant: str = TENANT
            ) -> None:
    """The replica computes the whole prompt, stores its blocks, finishes the request
    and publishes its spans (as the connector's two roles do)."""
    rep.planner.matched_tokens(req, ids, len(ids), 0, tenant=tenant, params=params)
    rep.planner.on_alloc(req, 0)
    _, saves = rep.planner.plan([StepRequest(req, ids, 0, len(ids), list(range(20)))])
    g = torch.Generator().manual_seed(11)
    stored = set()
    for spec in saves:
        shape = (TINY_LAYERS, len(spec.keys), BS, TINY_HEADS, TINY_DIM)
        result = rep.store.save(torch.randn(shape, generator=g), torch.randn(shape, generator=g),
                                spec.keys, spec.tenant, spec.labels)
        stored |= set(result.stored)
    rep.planner.apply(WorkerReport(stored=stored))
    rep.planner.finish(req, ids)
    for share in rep.planner.take_shares():
        rep.writer.share(share)
    assert rep.writer.flush()


def find(rep: Replica, req: str, ids: list[int], params: dict, tenant: str = TENANT
         ) -> tuple[int, dict]:
    """The chunk lookup of a replica whose DDR tier lacks the spans: the shared tier's
    span objects, polled as vLLM polls a lookup; the tokens chunk reuse then promises."""
    hit = rep.planner.matched_tokens(req, ids, len(ids), 0, tenant=tenant, params=params)
    misses = rep.planner.chunk_misses(req, ids, hit)
    found = None
    for _ in range(500):
        found = rep.lookups.spans(req, tenant, misses)
        if found is not None:
            break
        time.sleep(0.01)
    assert found is not None
    return hit + rep.planner.chunk_tokens(req, ids, hit, found), found


def allocate(rep: Replica, req: str, ids: list[int], hit: int) -> ChunkLoad:
    rep.planner.on_alloc(req, hit)
    (load,), _ = rep.planner.plan([StepRequest(req, ids, 0, len(ids), list(range(20, 40)))])
    assert load.chunk is not None
    return load.chunk


def a_computed_ab(a: Replica) -> tuple[list[int], dict]:
    """Replica A computes documents a, b (and publishes their spans); returns the
    prompt B gets next: b, a and another question."""
    ids, params = prompt("ab", 7)
    compute(a, "r1", ids, params)
    return prompt("ba", 8)


def test_a_span_one_replica_computed_is_placed_by_another_at_another_position(
        replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    ids_a, params_a = prompt("ab", 7)
    compute(a, "r1", ids_a, params_a)
    published = a.writer.ledger.totals()["counters"]["shared_spans_published"]
    assert published == 3  # the rules and both documents (the 5-token turn is too short)

    ids_b, params_b = prompt("ba", 8)  # the documents swapped, another question
    hit, found = find(b, "r2", ids_b, params_b)
    assert len(found) == 3
    chunk = allocate(b, "r2", ids_b, hit)
    assert [(m.label, m.position, m.source_position, m.shared is not None)
            for m in chunk.chunks] == [("rules", 0, 0, True), ("documents", 16, 48, True),
                                        ("documents", 48, 16, True)]
    assert hit == chunk.end == 80 and chunk.reused_tokens > 0
    assert b.planner.stats.take()["counters"]["shared_span_hits"] == 3

    imported, _ = b.writer.bring_in_spans(chunk)
    sources = [k for m in chunk.chunks for k in m.source_keys]
    assert set(imported) == set(sources) and not b.store.missing(sources)
    for key in sources:  # the same bytes, the same K/V
        ka, va = a.store.read([key], TENANT)  # type: ignore[misc]
        kb, vb = b.store.read([key], TENANT)  # type: ignore[misc]
        assert torch.equal(ka, kb) and torch.equal(va, vb)

    # adopted: once the worker reports the import, B finds them in its own index
    b.planner.apply(WorkerReport(stored=set(imported)))
    b.planner.finish("r2", ids_b)
    hit3 = b.planner.matched_tokens("r3", ids_b, len(ids_b), 0, tenant=TENANT,
                                    params=params_b)
    assert b.planner.chunk_misses("r3", ids_b, hit3) == []


def test_another_tenant_finds_no_span_of_the_same_text(
        replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    ids_b, params_b = a_computed_ab(a)
    hit, found = find(b, "r2", ids_b, params_b, tenant=chunk_salt("globex"))
    assert found == {} and hit == 0
    assert b.lookups.tier.take_counters()["gets"] == 3  # asked, by globex's names


def test_a_span_lookup_begun_early_answers_the_narrower_question_after_the_prefix(
        replicas: tuple[Replica, Replica]) -> None:
    """The scheduler asks for the spans past the DDR hit while the prefix lookup is in
    flight; once the prefix hit grows, the spans past it are a subset, answered by
    the same lookup without another request."""
    a, b = replicas
    ids_b, params_b = a_computed_ab(a)
    _, found = find(b, "r2", ids_b, params_b)
    assert len(found) == 3
    b.lookups.tier.take_counters()
    later = [k for k in found if found[k].span.position != 0]  # past a longer prefix
    again = b.lookups.spans("r2", TENANT, later)
    assert again is not None and set(again) == set(later)
    assert b.lookups.tier.take_counters()["gets"] == 0
    b.lookups.forget("r2")  # allocated: the next lookup asks again
    for _ in range(500):
        if b.lookups.spans("r2", TENANT, later) is not None:
            break
        time.sleep(0.01)
    assert b.lookups.tier.take_counters()["gets"] == len(later)


def flip_a_body_byte(tier: SharedTier, path: str) -> None:
    """A changed byte in the body: the header (and so the lookup) cannot tell."""
    data = bytearray(tier.store.get(path))
    data[-100] ^= 0xFF
    tier.store.put(path, bytes(data))


def other_blocks(tier: SharedTier, path: str) -> None:
    """A valid object at the same name holding other blocks (rewritten since the lookup)."""
    content = bytes.fromhex(path.rsplit("span-", 1)[1])
    obj = tier.fetch_spans(TENANT, [content]).get(content)
    assert obj is not None
    for block in obj.blocks:
        block.key = hashlib.sha256(b"other" + block.key).digest()
    tier.store.put(path, encode_chunk(obj, tier.mac_key))


@pytest.mark.parametrize("spoil", [flip_a_body_byte, other_blocks])
def test_a_span_spoiled_after_its_lookup_is_refused_and_its_range_recomputed(
        replicas: tuple[Replica, Replica], spoil: Callable[[SharedTier, str], None]) -> None:
    a, b = replicas
    ids_b, params_b = a_computed_ab(a)
    hit, found = find(b, "r2", ids_b, params_b)
    spoil(a.writer.tier, next(f for f in found.values() if f.span.position == 48).path)
    chunk = allocate(b, "r2", ids_b, hit)
    imported, _ = b.writer.bring_in_spans(chunk)
    moved_b = next(m for m in chunk.chunks if m.source_position == 48)
    assert b.store.missing(moved_b.source_keys)  # not placed: the worker's load fails
    assert not set(moved_b.source_keys) & set(imported)
    assert b.writer.ledger.totals()["counters"]["shared_refused"] == 1


def test_a_span_object_copied_to_another_spans_name_is_refused(
        replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    ids_b, params_b = a_computed_ab(a)
    _, found = find(b, "r2", ids_b, params_b)
    doc_a, doc_b = sorted((f for f in found.values() if f.span.label == "documents"),
                          key=lambda f: f.span.position)
    store = a.writer.tier.store
    store.put(doc_b.path, store.get(doc_a.path))  # b's name now holds a's object
    b.lookups.forget("r3")
    _, found3 = find(b, "r3", ids_b, params_b)
    assert doc_b.span.content not in found3 and len(found3) == 2
    refused = b.lookups.tier.take_counters()
    assert refused["refused_replayed"] == 1


def test_a_span_object_at_a_prefix_chunks_name_is_corrupt(
        replicas: tuple[Replica, Replica]) -> None:
    a, _ = replicas
    ids, params = prompt("ab", 7)
    compute(a, "r1", ids, params)
    tier = a.writer.tier
    span_name = next(p for p in tier.store.list(tier.tenants_prefix) if "/span-" in p)
    content = bytes.fromhex(span_name.rsplit("span-", 1)[1])
    chunk = tier.fetch_spans(TENANT, [content]).get(content)
    assert chunk is not None and chunk.span is not None
    chunk.path = tier.path(TENANT, chunk.keys[-1])  # signed for a prefix chunk's name
    tier.put(chunk)
    with pytest.raises(SharedObjectError) as err:
        decode_chunk(tier.store.get(chunk.path), tier.mac_key, path=chunk.path,
                     identity=tier.identity, tenant=TENANT)
    assert err.value.reason == "corrupt"
    report = collect(tier)  # the collector deletes what no reader would serve
    assert report.refused.get("corrupt") == 1 and not tier.store.exists(chunk.path)
