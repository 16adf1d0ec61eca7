"""GraphBlockReserver with the real tiered cache and the real SmolLM2 tokenizer."""

from __future__ import annotations

import hashlib
import itertools
import random
import threading

import pytest
import torch

from gpu_cache import Tier, TQGPUCache
from memory_graph import (
    GraphBlockReserver,
    MemoryGraph,
    ReservationState,
    ReserverConfig,
    UnknownReservationError,
)

TEXTS = [
    "Dana moved to Lisbon in March and started a job at a bakery near the river.",
    "Dana's sister Ines visits every summer and they hike in the Serra da Estrela.",
    "The bakery opens at six; Dana bakes sourdough and custard tarts before dawn.",
    "Dana is allergic to walnuts and avoids them in every recipe.",
    "In October Dana adopted a grey cat named Pixel from the shelter.",
    "Dana plans to open her own cafe in the Alfama district next year, with a long "
    "counter, six small tables, a record player and a menu that changes every week.",
]


@pytest.fixture
def graph(embedder, clock) -> MemoryGraph:
    g = MemoryGraph(embedder=embedder, clock=clock)
    ids = g.add_nodes(TEXTS, tenant="acme")
    g.add_nodes(TEXTS[:2], tenant="globex")
    for a, b in itertools.pairwise(ids):
        g.add_edge(a, b, "follows", 0.7)
    return g


def _blocks(cache: TQGPUCache, tier: Tier, layer: str = "memories") -> set[int]:
    return {m.block_id for m in cache.metadata.in_tier(tier) if m.source_layer == layer}


def test_reserve_warm_release(graph, cache, count_tokens, clock) -> None:
    free_host, free_dev = cache.num_free(Tier.HOST), cache.num_free(Tier.DEVICE)
    with GraphBlockReserver(cache, count_tokens, graph=graph, clock=clock) as reserver:
        res = reserver.reserve_query("What does Dana bake?", tenant="acme", k=3, hops=1)
        assert res.state is ReservationState.RESERVED and res.reason == ""
        assert len(res.node_ids) >= 3
        tokens = [count_tokens(graph.get_node(n).text) for n in res.node_ids]
        assert res.estimated_tokens == sum(tokens)
        assert [s.num_tokens for s in res.spans] == tokens
        assert [len(s.block_ids) for s in res.spans] == [-(-t // 16) for t in tokens]
        assert res.block_ids == tuple(b for s in res.spans for b in s.block_ids)
        assert res.num_bytes == len(res.block_ids) * cache.bytes_per_block
        assert res.expires_at == clock() + 30.0
        assert set(res.block_ids) == _blocks(cache, Tier.HOST)
        assert cache.num_free(Tier.HOST) == free_host - len(res.block_ids)
        first = cache.metadata.get(res.spans[0].block_ids[0])
        assert first.tenant_slug == "acme" and first.token_range[0] == 0

        warm = reserver.warm_reservation(res.reservation_id, tenant="acme")
        assert warm.state is ReservationState.WARMED
        assert set(res.block_ids) == _blocks(cache, Tier.DEVICE)
        assert all(cache.metadata.get(b).tier is Tier.DEVICE for b in res.block_ids)
        assert cache.num_free(Tier.HOST) == free_host
        again = reserver.warm_reservation(res.reservation_id)
        assert again.state is ReservationState.WARMED and "already" in again.reason

        clock.advance(3600)  # warmed reservations do not expire
        assert reserver.sweep() == 0
        done = reserver.release(res.reservation_id, tenant="acme")
        assert done.state is ReservationState.RELEASED
        assert reserver.release(res.reservation_id).state is ReservationState.RELEASED
        assert cache.num_free(Tier.HOST) == free_host
        assert cache.num_free(Tier.DEVICE) == free_dev
        stats = reserver.stats()
        assert (stats.reserved, stats.warmed, stats.released, stats.expired) == (1, 1, 1, 0)
        assert stats.hit_rate == 1.0 and stats.blocks_held == 0 and stats.active == 0
        assert stats.bytes_warmed == res.num_bytes


def test_unwarmed_reservations_expire(graph, cache, count_tokens, clock) -> None:
    free_host = cache.num_free(Tier.HOST)
    reserver = GraphBlockReserver(cache, count_tokens, graph=graph, clock=clock,
                                  config=ReserverConfig(ttl_s=5.0))
    a = reserver.reserve_query("Dana's cat", tenant="acme", k=2, hops=0)
    b = reserver.reserve_query("Lisbon bakery", tenant="acme", k=2, hops=0)
    c = reserver.reserve_query("walnut allergy", tenant="acme", k=1, hops=0)
    assert cache.num_free(Tier.HOST) < free_host
    clock.advance(4.0)
    assert reserver.sweep() == 0
    assert reserver.expire_now(c.reservation_id) == 1
    assert reserver.get(c.reservation_id).state is ReservationState.EXPIRED
    clock.advance(1.5)
    # lazily: warming an expired reservation reports it and raises nothing
    late = reserver.warm_reservation(a.reservation_id)
    assert late.state is ReservationState.EXPIRED and "ttl" in late.reason
    assert reserver.get(b.reservation_id).state is ReservationState.EXPIRED
    assert cache.num_free(Tier.HOST) == free_host
    assert not _blocks(cache, Tier.HOST)
    stats = reserver.stats()
    assert stats.expired == 3 and stats.warmed == 0 and stats.hit_rate == 0.0
    assert reserver.release(a.reservation_id).state is ReservationState.EXPIRED
    reserver.close()


def test_full_host_tier_gives_partial_then_empty(graph, cache_factory, count_tokens,
                                                 clock) -> None:
    cache = cache_factory(num_device_blocks=64, num_host_blocks=5)
    reserver = GraphBlockReserver(cache, count_tokens, graph=graph, clock=clock)
    hits = graph.hybrid_query("Dana", k=6, hops=0, tenant="acme")
    need = sum(-(-count_tokens(h.text) // 16) for h in hits)
    assert need > 5
    part = reserver.reserve(hits, tenant="acme")
    assert part.state is ReservationState.PARTIAL
    assert "host (DDR) tier full" in part.reason
    assert 0 < len(part.block_ids) <= 5 and part.skipped_node_ids
    assert set(part.node_ids) | set(part.skipped_node_ids) == {h.node_id for h in hits}
    rest = cache.num_free(Tier.HOST)
    smallest = min(-(-count_tokens(h.text) // 16) for h in hits)
    empty_hits = [h for h in hits if -(-count_tokens(h.text) // 16) > rest]
    empty = reserver.reserve(empty_hits, tenant="acme")
    assert empty.state is ReservationState.EMPTY and empty.block_ids == ()
    assert "none of" in empty.reason and "num_host_blocks" in empty.reason
    assert smallest >= 1
    assert reserver.warm_reservation(empty.reservation_id).state is ReservationState.EMPTY
    reserver.release(part.reservation_id)
    assert cache.num_free(Tier.HOST) == 5
    stats = reserver.stats()
    assert (stats.partial, stats.empty, stats.reserved) == (1, 1, 1)
    reserver.close()


def test_full_device_tier_leaves_reservation_warmable_later(graph, cache_factory,
                                                             count_tokens, clock) -> None:
    cache = cache_factory(num_device_blocks=1, num_host_blocks=32)
    pinned = cache.allocate(1, Tier.DEVICE, source_layer="axioms")
    assert pinned is not None
    cache.acquire(pinned)  # nothing on the device can make room
    reserver = GraphBlockReserver(cache, count_tokens, graph=graph, clock=clock)
    res = reserver.reserve_query("Dana's cafe plans", tenant="acme", k=1, hops=0)
    out = reserver.warm_reservation(res.reservation_id)
    assert out.state is ReservationState.RESERVED and "device tier full" in out.reason
    reserver.release(res.reservation_id)
    assert cache.num_free(Tier.HOST) == 32
    reserver.close()


def test_tenants_never_see_each_others_reservations(graph, cache, count_tokens,
                                                    clock) -> None:
    reserver = GraphBlockReserver(cache, count_tokens, graph=graph, clock=clock)
    mine = reserver.reserve_query("Dana hiking", tenant="acme", k=2, hops=0)
    theirs = reserver.reserve_query("Dana hiking", tenant="globex", k=2, hops=0)
    assert not set(mine.node_ids) & set(theirs.node_ids)
    for bid in theirs.block_ids:
        assert cache.metadata.get(bid).tenant_slug == "globex"
    with pytest.raises(UnknownReservationError, match="tenant 'globex'"):
        reserver.warm_reservation(mine.reservation_id, tenant="globex")
    with pytest.raises(UnknownReservationError):
        reserver.release(mine.reservation_id, tenant="globex")
    with pytest.raises(UnknownReservationError, match="returned by reserve"):
        reserver.get("not-an-id")
    assert [r.reservation_id for r in reserver.active("acme")] == [mine.reservation_id]
    assert [r.reservation_id for r in reserver.active("globex")] == [theirs.reservation_id]
    hits = graph.hybrid_query("Dana", k=1, hops=0, tenant="globex")
    with pytest.raises(ValueError, match="belongs to tenant 'globex'"):
        reserver.reserve(hits, tenant="acme")
    reserver.close()
    assert not _blocks(cache, Tier.HOST)


def test_concurrent_reserve_warm_release_leaks_nothing(graph, cache_factory, count_tokens,
                                                        clock) -> None:
    cache = cache_factory(num_device_blocks=24, num_host_blocks=40)
    free = (cache.num_free(Tier.HOST), cache.num_free(Tier.DEVICE))
    hits = graph.hybrid_query("Dana", k=6, hops=0, tenant="acme")
    reserver = GraphBlockReserver(cache, count_tokens, clock=clock,
                                  config=ReserverConfig(ttl_s=1e9))
    errors: list[BaseException] = []
    states: list[ReservationState] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(40):
                res = reserver.reserve(rng.sample(hits, rng.randint(1, 4)), tenant="acme")
                states.append(res.state)
                action = rng.random()
                if action < 0.5:
                    reserver.warm_reservation(res.reservation_id)
                if action < 0.9:
                    reserver.release(res.reservation_id)
                else:
                    reserver.expire_now(res.reservation_id)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert len(states) == 240
    assert ReservationState.RESERVED in states
    assert (cache.num_free(Tier.HOST), cache.num_free(Tier.DEVICE)) == free
    assert not _blocks(cache, Tier.HOST) and not _blocks(cache, Tier.DEVICE)
    stats = reserver.stats()
    assert stats.blocks_held == 0 and stats.active == 0
    assert stats.released + stats.expired == stats.reserved
    reserver.close()


class KVWriter:
    """A real prefill: deterministic K/V per text, TQ4-encoded into the host blocks."""

    def __init__(self, cache: TQGPUCache, gate: threading.Event | None = None) -> None:
        self.cache = cache
        self.gate = gate
        self.expected: dict[int, torch.Tensor] = {}  # block id -> K packed [L, BS, H, D/2]

    def __call__(self, texts: list[str], block_ids: list[list[int]]) -> None:
        if self.gate is not None:
            assert self.gate.wait(timeout=60)
        ident = self.cache.identity
        for text, ids in zip(texts, block_ids, strict=True):
            seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")
            gen = torch.Generator().manual_seed(seed)
            shape = (ident.num_layers, len(ids), ident.block_size, ident.num_kv_heads,
                     ident.head_dim)
            k_enc = self.cache.codec.encode(torch.randn(shape, generator=gen))
            v_enc = self.cache.codec.encode(torch.randn(shape, generator=gen))
            for j, bid in enumerate(ids):
                slot = self.cache.metadata.get(bid).slot
                for layer in range(ident.num_layers):
                    view = self.cache.layer_view(layer, Tier.HOST)
                    view.k_packed[slot] = k_enc.packed[layer, j]
                    view.k_norms[slot] = k_enc.norms[layer, j]
                    view.v_packed[slot] = v_enc.packed[layer, j]
                    view.v_norms[slot] = v_enc.norms[layer, j]
                self.expected[bid] = k_enc.packed[:, j].clone()


def test_background_prefill_writes_kv_that_warming_moves(graph, cache, count_tokens,
                                                         clock) -> None:
    writer = KVWriter(cache)
    reserver = GraphBlockReserver(cache, count_tokens, graph=graph, clock=clock,
                                  prefill=writer)
    res = reserver.reserve_query("Dana's sister", tenant="acme", k=2, hops=0)
    assert reserver.wait_prefill(res.reservation_id, timeout=60)
    assert reserver.get(res.reservation_id).prefilled
    assert set(writer.expected) == set(res.block_ids)
    reserver.warm_reservation(res.reservation_id)
    for bid in res.block_ids:
        meta = cache.metadata.get(bid)
        assert meta.tier is Tier.DEVICE and meta.source_layer == "memories"
        for layer in range(cache.identity.num_layers):
            got = cache.layer_view(layer, Tier.DEVICE).k_packed[meta.slot]
            assert torch.equal(got.cpu(), writer.expected[bid][layer])
    assert reserver.stats().prefills_done == 1
    reserver.close()
    assert not _blocks(cache, Tier.DEVICE)


def test_release_during_prefill_frees_after_it_ends(graph, cache, count_tokens,
                                                    clock) -> None:
    free_host = cache.num_free(Tier.HOST)
    gate = threading.Event()
    reserver = GraphBlockReserver(cache, count_tokens, graph=graph, clock=clock,
                                  prefill=KVWriter(cache, gate))
    first = reserver.reserve_query("Dana's cat Pixel", tenant="acme", k=1, hops=0)
    queued = reserver.reserve_query("Dana's bakery", tenant="acme", k=1, hops=0)
    assert reserver.release(queued.reservation_id).state is ReservationState.RELEASED
    # the queued prefill was cancelled and its blocks freed at once
    assert not set(queued.block_ids) & _blocks(cache, Tier.HOST)
    released = reserver.release(first.reservation_id)
    assert released.state is ReservationState.RELEASED
    assert set(first.block_ids) <= _blocks(cache, Tier.HOST)  # the prefill still writes
    gate.set()
    assert reserver.wait_prefill(first.reservation_id, timeout=60)
    assert cache.num_free(Tier.HOST) == free_host
    reserver.close()


def test_failing_prefill_is_counted_not_raised(graph, cache, count_tokens, clock) -> None:
    def broken(texts: list[str], block_ids: list[list[int]]) -> None:
        raise RuntimeError("model offline")

    reserver = GraphBlockReserver(cache, count_tokens, graph=graph, clock=clock,
                                  prefill=broken)
    res = reserver.reserve_query("Dana", tenant="acme", k=1, hops=0)
    assert not reserver.wait_prefill(res.reservation_id, timeout=60)
    warm = reserver.warm_reservation(res.reservation_id)
    assert warm.state is ReservationState.WARMED and not warm.prefilled
    assert reserver.stats().prefills_failed == 1
    reserver.close()
    with pytest.raises(RuntimeError, match="closed"):
        reserver.reserve([], tenant="acme")


def test_finished_reservations_are_forgotten_beyond_the_limit(graph, cache, count_tokens,
                                                              clock) -> None:
    reserver = GraphBlockReserver(cache, count_tokens, graph=graph, clock=clock,
                                  config=ReserverConfig(keep_finished=2))
    ids = []
    for _ in range(4):
        res = reserver.reserve_query("Dana", tenant="acme", k=1, hops=0)
        reserver.release(res.reservation_id)
        ids.append(res.reservation_id)
    live = reserver.reserve_query("Dana", tenant="acme", k=1, hops=0)
    for rid in ids[:2]:
        with pytest.raises(UnknownReservationError, match="forgotten"):
            reserver.get(rid)
    assert reserver.get(ids[3]).state is ReservationState.RELEASED
    assert reserver.get(live.reservation_id).state is ReservationState.RESERVED
    assert len(reserver._reservations) == 3
    reserver.close()


def _keyed_blocks(cache: TQGPUCache, tenant: str, n: int, tier: Tier = Tier.HOST,
                  seed: int = 0) -> tuple[list[int], list]:
    """``n`` blocks registered under the chained keys of a token run, one reference
    held (what a background prefill with ``hold=True`` hands over)."""
    ids = cache.allocate(n, tier, tenant=tenant, source_layer="memories")
    assert ids is not None
    tokens = [(seed * 1000 + i) % 4000 for i in range(n * cache.block_size)]
    keys = cache.block_keys(tokens, tenant)
    for bid, key in zip(ids, keys, strict=True):
        cache.set_key(bid, key)
    cache.acquire(ids)
    return ids, keys


def test_adopt_then_expiry_frees_every_block(cache, count_tokens, clock) -> None:
    free_host = cache.num_free(Tier.HOST)
    reserver = GraphBlockReserver(cache, count_tokens, clock=clock,
                                  config=ReserverConfig(ttl_s=5.0))
    ids, keys = _keyed_blocks(cache, "acme", 3)
    res = reserver.adopt(ids, tenant="acme", node_ids=["n1", "n2"], key="billing")
    assert res.state is ReservationState.RESERVED and res.prefilled
    assert res.key == "billing" and res.node_ids == ("n1", "n2")
    assert res.block_ids == tuple(ids) and res.estimated_tokens == 3 * cache.block_size
    assert res.expires_at == clock() + 5.0
    # the reservation took the caller's reference over: no new one
    assert [cache.metadata.get(b).ref_count for b in ids] == [1, 1, 1]
    assert [r.reservation_id for r in reserver.active("acme")] == [res.reservation_id]
    assert reserver.stats().blocks_held == 3
    clock.advance(5.0)
    assert reserver.sweep() == 1
    assert reserver.get(res.reservation_id).state is ReservationState.EXPIRED
    assert cache.num_free(Tier.HOST) == free_host
    assert cache.lookup(keys, "acme") == []
    assert reserver.stats().blocks_held == 0 and reserver.active("acme") == []
    reserver.close()


def test_consume_keeps_blocks_cached_without_references(cache, count_tokens, clock) -> None:
    free_host = cache.num_free(Tier.HOST)
    reserver = GraphBlockReserver(cache, count_tokens, clock=clock)
    ids, keys = _keyed_blocks(cache, "acme", 2)
    res = reserver.adopt(ids, tenant="acme", key="deploys")
    hit = reserver.consume(res.reservation_id, tenant="acme")
    assert hit.state is ReservationState.WARMED and hit.key == "deploys"
    assert cache.lookup(keys, "acme") == ids  # still found by key
    assert [cache.metadata.get(b).ref_count for b in ids] == [0, 0]
    assert cache.num_free(Tier.HOST) == free_host - 2
    stats = reserver.stats()
    assert (stats.reserved, stats.warmed, stats.active, stats.blocks_held) == (1, 1, 0, 0)
    assert stats.hit_rate == 1.0
    # idempotent, error-free; release and expiry no longer touch the blocks
    again = reserver.consume(res.reservation_id)
    assert again.state is ReservationState.WARMED and "nothing to consume" in again.reason
    assert reserver.release(res.reservation_id).state is ReservationState.WARMED
    clock.advance(3600)
    assert reserver.expire_now() == 0
    assert cache.lookup(keys, "acme") == ids
    # ordinary cache blocks now: eviction may take them
    assert {m.block_id for m in cache.metadata.eviction_order(Tier.HOST, cache.policy)} >= set(ids)
    reserver.close()
    assert cache.lookup(keys, "acme") == ids
    with pytest.raises(UnknownReservationError):
        reserver.consume("nope")


def test_consume_after_expiry_reports_it(cache, count_tokens, clock) -> None:
    reserver = GraphBlockReserver(cache, count_tokens, clock=clock,
                                  config=ReserverConfig(ttl_s=1.0))
    ids, _ = _keyed_blocks(cache, "acme", 2)
    res = reserver.adopt(ids, tenant="acme", key="k")
    clock.advance(2.0)
    late = reserver.consume(res.reservation_id, tenant="acme")
    assert late.state is ReservationState.EXPIRED and "nothing to consume" in late.reason
    with pytest.raises(UnknownReservationError):
        reserver.consume(res.reservation_id, tenant="globex")
    assert reserver.stats().warmed == 0
    reserver.close()


def test_adopt_refuses_broken_contracts_and_takes_nothing(cache, count_tokens, clock) -> None:
    reserver = GraphBlockReserver(cache, count_tokens, clock=clock)
    ids, _ = _keyed_blocks(cache, "acme", 2)
    with pytest.raises(ValueError, match="tenant 'acme', not 'globex'"):
        reserver.adopt(ids, tenant="globex")
    cache.release(ids[1:])
    with pytest.raises(ValueError, match="holds no reference"):
        reserver.adopt(ids, tenant="acme")
    with pytest.raises(ValueError, match="duplicate"):
        reserver.adopt([ids[0], ids[0]], tenant="acme")
    assert reserver.stats().reserved == 0 and reserver.active("acme") == []
    assert [cache.metadata.get(b).ref_count for b in ids] == [1, 0]
    empty = reserver.adopt([], tenant="acme", key="none")
    assert empty.state is ReservationState.EMPTY and empty.key == "none"
    reserver.close()
    with pytest.raises(RuntimeError, match="closed"):
        reserver.adopt(ids[:1], tenant="acme")


def test_expiry_leaves_blocks_another_reader_holds(cache, count_tokens, clock) -> None:
    reserver = GraphBlockReserver(cache, count_tokens, clock=clock)
    ids, keys = _keyed_blocks(cache, "acme", 3, tier=Tier.DEVICE)
    res = reserver.adopt(ids, tenant="acme", key="k")
    cache.acquire(ids[:1])  # a request reading the first block right now
    assert reserver.expire_now(res.reservation_id) == 1
    assert [b for b in ids if b in cache.metadata] == ids[:1]
    assert cache.metadata.get(ids[0]).ref_count == 1
    assert cache.lookup(keys, "acme") == ids[:1]
    cache.release(ids[:1])
    reserver.close()


def test_close_frees_adopted_blocks(cache, count_tokens, clock) -> None:
    free_host = cache.num_free(Tier.HOST)
    reserver = GraphBlockReserver(cache, count_tokens, clock=clock)
    ids, _ = _keyed_blocks(cache, "acme", 4)
    reserver.adopt(ids, tenant="acme")
    reserver.close()
    assert cache.num_free(Tier.HOST) == free_host
    assert reserver.stats().released == 1
