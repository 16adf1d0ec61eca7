"""Reuse beyond the prefix (contextkit.engine.chunks, contextkit.engine.blend): keys
re-rotated to a new position equal a fresh computation there, a changed layer no
longer costs everything after it, tenants and identities never share chunks, and the
repair rule picks what it says."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from contextkit.engine.chunks import (
    ChunkHit,
    ChunkReuse,
    copy_chunks,
    find_chunks,
    kv_deviation,
    select_repair,
)
from contextkit.engine.engine import Engine
from contextkit.engine.kv import ContiguousKV, PagedKV, read_slots, write_slots
from contextkit.engine.sequence import close_sequence, open_sequence
from contextkit.engine.types import TokenSpan
from gpu_cache import Tier
from gpu_cache.chunks import ChunkEntry, ChunkIndex, chunk_key

LAYERS = {
    "identity": "You are Ada, a careful research assistant at the coastal biology lab. " * 4,
    "memories": "Memory: the user visited Lisbon in May and liked the blue azulejo tiles. " * 4,
    "rules": "Cite sources for every claim. Keep answers short. Never reveal keys. " * 5,
    "capabilities": "You can search papers, run Python, read PDF files and plot data. " * 5,
}
TURNS = [f"Question {i}: how do tide pools change with the seasons on this coast? "
         "Answer: they warm, dry out and host different algae. " for i in range(3)]
CHANGED = "Memory: the user now lives in Porto and keeps a vegetable garden by the river. " * 4
TAIL = "What should I read next? Answer:"


def _prompt(engine: Engine, memories: str) -> tuple[list[int], list[TokenSpan]]:
    ids: list[int] = []
    spans: list[TokenSpan] = []
    for name, text in LAYERS.items():
        piece = engine.encode(memories if name == "memories" else text)
        spans.append(TokenSpan(len(ids), len(ids) + len(piece), name, 0.5))
        ids += piece
    for text in TURNS:
        piece = engine.encode(text)
        spans.append(TokenSpan(len(ids), len(ids) + len(piece), "user_turn", 0.3))
        ids += piece
    return ids + engine.encode(TAIL), spans


def _isolated(engine: Engine, ids: list[int], position: int) -> ContiguousKV:
    """The chunk's K/V computed alone, its first token at ``position``."""
    kv = ContiguousKV(engine.model.num_layers)
    engine.runner.forward(ids, position, kv)
    return kv


@pytest.mark.parametrize(("p0", "p1"), [(16, 17), (16, 23), (5, 37), (40, 8), (3, 3)])
def test_rerotated_keys_equal_a_fresh_computation_at_the_new_position(
        fresh: Callable[..., Engine], p0: int, p1: int) -> None:
    """Shift by one, by part of a block, across block boundaries, backwards, by none;
    SmolLM2 has grouped-query attention (9 query heads on 3 K/V heads)."""
    eng = fresh("native")
    m = eng.model
    assert m.num_heads > m.num_kv_heads
    cache, bs = eng.cache, eng.cache.block_size
    chunk = eng.encode(LAYERS["rules"])[:40]
    n = len(chunk)
    src = cache.allocate(-(-(p0 + n) // bs), Tier.DEVICE, tenant="t")
    dst = cache.allocate(-(-(p1 + n) // bs), Tier.DEVICE, tenant="t")
    assert src is not None and dst is not None
    src_table = cache.block_table(src).long()
    dst_table = cache.block_table(dst).long()

    def slots(table: torch.Tensor, start: int) -> torch.Tensor:
        pos = torch.arange(start, start + n)
        return table[pos // bs] * bs + pos % bs

    at_p0, at_p1 = _isolated(eng, chunk, p0), _isolated(eng, chunk, p1)
    for layer in range(m.num_layers):
        k, v = at_p0.k[layer], at_p0.v[layer]
        assert k is not None and v is not None
        write_slots(cache, layer, slots(src_table, p0), k, v)
    entry = ChunkEntry(tenant="t", label="rules", block_keys=(), offset=p0 % bs,
                       position=p0, length=n)
    hit = ChunkHit(start=p1, length=n, label="rules", entry=entry,
                   src_blocks=src[p0 // bs:])
    copy_chunks(cache, m, [hit], dst_table, range(m.num_layers))
    for layer in range(m.num_layers):
        k, v = read_slots(cache, layer, slots(dst_table, p1))
        ref_k, ref_v = at_p1.k[layer], at_p1.v[layer]
        assert ref_k is not None and ref_v is not None and v is not None
        torch.testing.assert_close(k, ref_k.float(), atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(v, ref_v.float(), atol=2e-5, rtol=1e-5)
    # the fresh keys really differ between the positions: the rotation did the work
    k0, k1 = at_p0.k[3], at_p1.k[3]
    assert k0 is not None and k1 is not None
    assert p0 == p1 or not torch.allclose(k0, k1, atol=1e-2)


def _moved_chunk(eng: Engine, text: str, p0: int, p1: int) -> tuple[
        list[int], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
        ContiguousKV, ContiguousKV]:
    """A 48-token chunk of ``text`` to move from ``p0`` to ``p1``: its source blocks,
    the source and destination block tables, the positions, and the chunk computed
    alone at each place."""
    cache, bs = eng.cache, eng.cache.block_size
    chunk = eng.encode(text)[:48]
    n = len(chunk)
    src = cache.allocate(-(-(p0 + n) // bs), Tier.DEVICE, tenant="t")
    dst = cache.allocate(-(-(p1 + n) // bs), Tier.DEVICE, tenant="t")
    assert src is not None and dst is not None
    return (src, cache.block_table(src).long(), cache.block_table(dst).long(),
            torch.arange(p0, p0 + n), torch.arange(p1, p1 + n),
            _isolated(eng, chunk, p0), _isolated(eng, chunk, p1))


def test_rerotated_tq4_keys_stay_within_the_codec_error(fresh: Callable[..., Engine]) -> None:
    eng = fresh("tq4")
    m, cache, bs = eng.model, eng.cache, eng.cache.block_size
    p0, p1 = 21, 70
    src, src_table, dst_table, pos0, pos1, at_p0, at_p1 = _moved_chunk(
        eng, LAYERS["capabilities"], p0, p1)
    n = len(pos0)
    layers = range(m.num_layers)
    for layer in layers:
        write_slots(cache, layer, src_table[pos0 // bs] * bs + pos0 % bs,
                    at_p0.k[layer], at_p0.v[layer])  # type: ignore[arg-type]
    entry = ChunkEntry("t", "capabilities", (), p0 % bs, p0, n)
    copy_chunks(cache, m, [ChunkHit(p1, n, "capabilities", entry, src[p0 // bs:])],
                dst_table, layers)
    for layer in (0, m.num_layers // 2, m.num_layers - 1):
        k, _ = read_slots(cache, layer, dst_table[pos1 // bs] * bs + pos1 % bs)
        ref = at_p1.k[layer]
        assert ref is not None
        offset = cache.key_offset(layer)
        ref = ref.float() - (offset if offset is not None else 0)
        cos = torch.nn.functional.cosine_similarity(k.flatten(0, 1), ref.flatten(0, 1), dim=-1)
        # one 4-bit encoding keeps ~0.99 cosine; a second (after the rotation) stays close
        assert float(cos.mean()) > 0.98


@pytest.mark.parametrize("kv_format", ["native", "tq4"])
def test_the_repair_signal_measures_against_the_source_not_the_move(
        fresh: Callable[..., Engine], kv_format: str) -> None:
    """A chunk computed in the same context deviates by nothing but the cache's one
    quantization when measured where it is cached (fresh keys rotated back); measured
    after the move, tq4 keys add a second quantization's noise to the signal."""
    eng = fresh(kv_format)
    m, cache, bs = eng.model, eng.cache, eng.cache.block_size
    p0, p1, layer = 13, 58, 1
    src, src_table, dst_table, pos0, pos1, at_p0, at_p1 = _moved_chunk(
        eng, LAYERS["identity"], p0, p1)
    n = len(pos0)
    k0, v0, k1, v1 = at_p0.k[layer], at_p0.v[layer], at_p1.k[layer], at_p1.v[layer]
    assert k0 is not None and v0 is not None and k1 is not None and v1 is not None
    write_slots(cache, layer, src_table[pos0 // bs] * bs + pos0 % bs, k0, v0)
    hit = ChunkHit(p1, n, "identity", ChunkEntry("t", "identity", (), p0 % bs, p0, n),
                   src[p0 // bs:])
    offset = cache.key_offset(layer)
    # the move of this layer, and its rows as the source holds them
    source = copy_chunks(cache, m, [hit], dst_table, range(layer, layer + 1), read_at=layer)
    assert source is not None
    at_source = source.deviation(k1, v1, offset)
    # what the cache's one encoding of the chunk lost, straight from the codec
    stored_k, stored_v = read_slots(cache, layer, src_table[pos0 // bs] * bs + pos0 % bs)
    assert stored_v is not None
    centered = k0.float() - (offset if offset is not None else 0)
    torch.testing.assert_close(at_source, kv_deviation(centered, v0, stored_k, stored_v),
                               atol=1e-4, rtol=1e-3)
    moved_k, moved_v = read_slots(cache, layer, dst_table[pos1 // bs] * bs + pos1 % bs)
    assert moved_v is not None
    fresh_k = k1.float() - (offset if offset is not None else 0)
    after_move = kv_deviation(fresh_k, v1, moved_k, moved_v)
    scale = float((k1.float() ** 2).sum(dim=(1, 2)).mean())
    if kv_format == "native":  # nothing lost either way
        assert float(at_source.max()) < 1e-6 * scale
        assert float(after_move.max()) < 1e-6 * scale
    else:  # a second encoding roughly doubles the keys' part of the noise
        assert float(at_source.mean()) > 0
        assert float(after_move.mean()) > 1.3 * float(at_source.mean())


def test_a_changed_layer_no_longer_recomputes_the_layers_after_it(
        fresh: Callable[..., Engine]) -> None:
    eng = fresh("native", device=256)
    before, spans = _prompt(eng, LAYERS["memories"])
    eng.generate(before, max_new_tokens=1, spans=spans)
    after, spans2 = _prompt(eng, CHANGED)
    res = eng.generate(after, max_new_tokens=1, spans=spans2)
    assert "rules" in res.reused_chunks and "capabilities" in res.reused_chunks
    assert res.reused_chunks.count("user_turn") == len(TURNS)
    assert res.chunk_reused_tokens > 0 and res.repaired_tokens > 0
    assert res.computed_tokens == res.prompt_tokens - res.reused_tokens - res.chunk_reused_tokens
    plain = eng.sibling(chunk_reuse=False, num_device_blocks=256)
    plain.generate(before, max_new_tokens=1, spans=spans)
    base = plain.generate(after, max_new_tokens=1, spans=spans2)
    assert res.reused_tokens == base.reused_tokens  # the same prefix...
    assert res.computed_tokens < base.computed_tokens / 2  # ...far less after it
    full = eng.generate(after, max_new_tokens=1, use_cache=False)
    assert res.first_logits is not None and full.first_logits is not None
    assert int(res.first_logits.argmax()) == int(full.first_logits.argmax())


def test_recomputing_every_reused_token_is_exactly_a_full_prefill(
        fresh: Callable[..., Engine]) -> None:
    """Repair ratio 1: the staged forward recomputes every chunk token at every layer,
    so it must give the plain forward's logits (native K/V): the blend machinery
    (scattered rows, masked attention, moved K/V) changes nothing by itself."""
    cfg = ChunkReuse(repair_ratio=1.0, repair_rule="deviation")
    eng = fresh("native", device=256, chunk_reuse=cfg)
    before, spans = _prompt(eng, LAYERS["memories"])
    eng.generate(before, max_new_tokens=1, spans=spans)
    after, spans2 = _prompt(eng, CHANGED)
    res = eng.generate(after, max_new_tokens=1, spans=spans2)
    assert res.reused_chunks and res.chunk_reused_tokens == 0 and res.repaired_tokens > 0
    full = eng.generate(after, max_new_tokens=1, use_cache=False)
    assert res.first_logits is not None and full.first_logits is not None
    torch.testing.assert_close(res.first_logits, full.first_logits, atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("kv_format", ["tq4", "native"])
def test_the_select_layer_attends_only_the_rows_that_go_on(
        fresh: Callable[..., Engine], kv_format: str) -> None:
    """At the select layer the blend writes every token's K/V but only the kept rows
    attend: ``attend_some`` gives ``attend(...)[rows]`` (grouped-query heads, a cached
    prefix read from the packed cache with its float sink, the float residual window
    starting among the new tokens) and leaves the same cache bytes and window."""
    eng = fresh(kv_format, device=64)
    bs = eng.cache.block_size
    start, num_new, sink = 3 * bs + 5, 2 * bs + 7, bs
    window = start + num_new - 9
    m = eng.model
    gen = torch.Generator().manual_seed(3)
    prefix_k = torch.randn(start, m.num_kv_heads, m.head_dim, generator=gen)
    prefix_v = torch.randn(start, m.num_kv_heads, m.head_dim, generator=gen)
    q = torch.randn(num_new, m.num_heads, m.head_dim, generator=gen)
    k = torch.randn(num_new, m.num_kv_heads, m.head_dim, generator=gen)
    v = torch.randn(num_new, m.num_kv_heads, m.head_dim, generator=gen)
    rows = torch.tensor([0, 1, 5, bs, bs + 1, num_new - 10, num_new - 9, num_new - 1])
    ids = list(range(start + num_new))
    outs, views = [], []
    seqs = [open_sequence(eng.cache, ids, 1, "default", None, reuse=False) for _ in range(2)]
    try:
        for seq in seqs:
            kv = PagedKV(eng.cache, seq.block_ids, 0, window_start=window, sink=sink)
            kv._write(0, prefix_k, prefix_v, 0)  # the cached prefix, and the sink's floats
            kv.cached = start
            views.append(kv)
        assert m.num_heads != m.num_kv_heads  # grouped-query heads
        outs.append(views[0].attend(0, q, k, v, start, eng.scale)[rows])
        outs.append(views[1].attend_some(0, q, k, v, start, rows, eng.scale))
        torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
        slots = [kv._slots(start, num_new) for kv in views]
        for a, b in zip(read_slots(eng.cache, 0, slots[0]), read_slots(eng.cache, 0, slots[1]),
                        strict=True):
            assert a is not None and b is not None and torch.equal(a, b)
        assert views[0].win_len[0] == views[1].win_len[0] == (
            0 if kv_format == "native" else start + num_new - window)
    finally:
        for seq in seqs:
            close_sequence(eng.cache, seq, ids, 0)


def test_chunks_are_never_served_to_another_tenant_or_identity(
        fresh: Callable[..., Engine]) -> None:
    eng = fresh("native", device=256)
    before, spans = _prompt(eng, LAYERS["memories"])
    eng.generate(before, max_new_tokens=1, spans=spans, tenant="acme")
    after, spans2 = _prompt(eng, CHANGED)
    other = eng.generate(after, max_new_tokens=1, spans=spans2, tenant="globex")
    assert other.reused_tokens == 0 and other.chunk_reused_tokens == 0
    assert other.reused_chunks == []
    # the index lists no other tenant's entries, and keys differ per tenant and identity
    assert all(e.tenant == "acme" for e in eng.cache.chunks.of_tenant("acme"))
    ids = eng.encode(LAYERS["rules"])
    index = eng.cache.chunks
    assert index.key("acme", "rules", ids) != index.key("globex", "rules", ids)
    assert chunk_key(b"a" * 32, "acme", "rules", ids) != chunk_key(b"b" * 32, "acme", "rules",
                                                                    ids)
    assert index.get(index.key("acme", "rules", ids), "globex") is None
    mine = eng.generate(after, max_new_tokens=1, spans=spans2, tenant="acme")
    assert mine.chunk_reused_tokens > 0


def test_stale_and_far_travelled_entries_are_not_reused(fresh: Callable[..., Engine]) -> None:
    eng = fresh("native", device=256)
    before, spans = _prompt(eng, LAYERS["memories"])
    eng.generate(before, max_new_tokens=1, spans=spans)
    after, spans2 = _prompt(eng, CHANGED)
    cache = eng.cache
    rules = next(s for s in spans2 if s.source_layer == "rules")
    key = cache.chunks.key("default", "rules", after[rules.start : rules.end])
    entry = cache.chunks.get(key, "default")
    assert entry is not None and entry.hops == 0
    cfg = ChunkReuse(max_hops=1)
    found = find_chunks(cache, after, [rules], "default", 0, len(after), cfg)
    assert [h.label for h in found] == ["rules"]
    for hit in found:
        cache.release(hit.src_blocks)
    far = ChunkEntry(entry.tenant, entry.label, entry.block_keys, entry.offset,
                     entry.position, entry.length, hops=1)
    cache.chunks.put(key, far)
    assert find_chunks(cache, after, [rules], "default", 0, len(after), cfg) == []
    # blocks gone: the entry is dropped on lookup
    cache.chunks.put(key, entry)
    cache.remove_blocks(cache.lookup(entry.block_keys[-1:], "default"))
    assert find_chunks(cache, after, [rules], "default", 0, len(after), cfg) == []
    assert cache.chunks.get(key, "default") is None


def test_repair_rules_pick_the_intended_tokens() -> None:
    deviation = torch.tensor([0.1, 0.2, 9.0, 0.3, 0.0, 0.5, 7.0, 0.1, 0.2, 0.3])
    rows = [(0, 4), (4, 10)]
    first = select_repair(deviation, rows, ChunkReuse(repair_rule="first", repair_first=1))
    assert first.nonzero()[:, 0].tolist() == [0, 4]
    dev = select_repair(deviation, rows, ChunkReuse(repair_rule="deviation", repair_ratio=0.2))
    assert dev.nonzero()[:, 0].tolist() == [2, 6]  # the two largest deviations
    both = select_repair(deviation, rows, ChunkReuse(repair_rule="both", repair_ratio=0.4,
                                                     repair_first=1))
    assert both.nonzero()[:, 0].tolist() == [0, 2, 4, 6]  # firsts, then the largest
    assert int(select_repair(deviation, rows, ChunkReuse(repair_ratio=1.0)).sum()) == 10
    with pytest.raises(ValueError, match="repair_rule"):
        ChunkReuse(repair_rule="random")
    with pytest.raises(ValueError, match="repair_ratio"):
        ChunkReuse(repair_ratio=1.5)


def test_index_is_bounded_and_keeps_the_entry_fewest_hops_away() -> None:
    index = ChunkIndex(b"d" * 32, max_entries=2)
    e0 = ChunkEntry("t", "a", (), 0, 0, 20, hops=0)
    e1 = ChunkEntry("t", "a", (), 0, 40, 20, hops=1)
    assert index.put(b"k1", e0)
    assert not index.put(b"k1", e1, keep=e0)  # the caller found e0 still valid
    assert index.get(b"k1", "t") == e0
    index.put(b"k2", e1)
    index.put(b"k3", e1)
    assert len(index) == 2 and index.get(b"k1", "t") is None  # least recently used went
    index.taint([b"x" * 32], 2)
    assert index.hops_of([b"x" * 32, b"y" * 32]) == 2
    assert index.drop_tenant("t") == 2 and len(index) == 0


def test_background_prefill_registers_chunks_by_content(fresh: Callable[..., Engine]) -> None:
    """What a reservation prefills in the background is found by content later, even
    when the turn's prefix differs from the reservation's."""
    eng = fresh("native", device=256)
    before, spans = _prompt(eng, LAYERS["memories"])
    out = eng.prefill_prefix(before, spans=spans)
    assert out.computed_tokens > 0 and len(eng.cache.chunks) > 0
    after, spans2 = _prompt(eng, CHANGED)
    res = eng.generate(after, max_new_tokens=1, spans=spans2)
    assert "rules" in res.reused_chunks and res.chunk_reused_tokens > 0
    off = eng.sibling(chunk_reuse=False, num_device_blocks=256)
    off.prefill_prefix(before, spans=spans)
    assert len(off.cache.chunks) == 0
