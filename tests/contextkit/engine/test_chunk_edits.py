"""Edited chunks (contextkit.engine.chunks): a span whose text changed a little since it
was cached is aligned against its earlier version; the runs they share are moved in,
the changed tokens computed, the token after each change repaired; versions are kept
per tenant, and a request's path replays exactly."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from contextkit.engine.chunks import ChunkReuse, select_repair, shared_runs
from contextkit.engine.engine import Engine
from contextkit.engine.types import TokenSpan
from gpu_cache.chunks import VERSIONS_PER_SIGNATURE, ChunkIndex

IDENTITY = "You are Atlas, the on-call assistant of the platform team at a small shop. " * 3
# long enough that the state line lies before tq4's float residual window (128 tokens)
RULES = "Say which figure you read and when it was scraped. Keep answers short. " * 10
STATE = ("checkout-api@prod-eu: {ready}/6 ready, {rps} rps, p95 {p95} ms, p99 412 ms, "
         "5xx 0.12%, CPU 44%, queue depth 18, cache hit ratio 97.1%.\n")
TAIL = "User: is checkout healthy right now?\nAssistant:"


def _prompt(engine: Engine, memory: str, ready: int, rps: int,
            p95: int) -> tuple[list[int], list[TokenSpan]]:
    """identity, a memory that changes (breaking the prefix), the state line, rules."""
    ids: list[int] = []
    spans: list[TokenSpan] = []
    parts = [("identity", IDENTITY), ("memories", memory),
             ("system_state", STATE.format(ready=ready, rps=rps, p95=p95)), ("rules", RULES)]
    for label, text in parts:
        piece = engine.encode(text)
        spans.append(TokenSpan(len(ids), len(ids) + len(piece), label, 0.5))
        ids += piece
    return ids + engine.encode(TAIL), spans


MEMORY_A = "Memory: last week the payments database ran out of connections twice. "
MEMORY_B = "Memory: the search team rolled back a bad index build on Tuesday evening. "


def test_shared_runs_are_the_longest_common_stretches() -> None:
    old = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    new = [1, 2, 3, 0, 0, 5, 6, 7, 8, 9]
    assert shared_runs(old, new, 3) == [(0, 0, 3), (4, 5, 5)]
    assert shared_runs(old, new, 4) == [(4, 5, 5)]
    assert shared_runs(old, [7, 7, 7], 1) == [(6, 0, 1)]


def test_the_token_after_each_change_is_a_seam() -> None:
    deviation = torch.zeros(10)
    rows = [(0, 4), (4, 7), (7, 10)]  # a span's first run, then two runs after changes
    pick = select_repair(deviation, rows, ChunkReuse(repair_rule="first"), [4, 1, 1])
    assert pick.nonzero()[:, 0].tolist() == [0, 1, 2, 3, 4, 7]


def test_versions_are_per_tenant_most_recent_first_and_bounded() -> None:
    index = ChunkIndex(b"d" * 32)
    sig = index.signature("acme", "system_state", [1, 2, 3, 4])
    assert sig != index.signature("globex", "system_state", [1, 2, 3, 4])
    assert sig != index.signature("acme", "rules", [1, 2, 3, 4])
    assert sig != ChunkIndex(b"e" * 32).signature("acme", "system_state", [1, 2, 3, 4])
    for n in range(VERSIONS_PER_SIGNATURE + 2):
        index.note_version(sig, "acme", [1, 2, 3, 4, n], bytes([n]) * 32)
    index.note_version(sig, "acme", [1, 2, 3, 4, 3], b"x" * 32)  # seen again: moves up
    got = index.versions(sig, "acme")
    assert len(got) == VERSIONS_PER_SIGNATURE
    assert got[0] == ((1, 2, 3, 4, 3), b"x" * 32)
    assert [ids[-1] for ids, _ in got] == [3, 5, 4, 2]
    assert index.versions(sig, "globex") == []  # even under the same signature bytes
    index.note_version(sig, "globex", [1, 2, 3, 4, 9], b"g" * 32)
    assert [ids[-1] for ids, _ in index.versions(sig, "globex")] == [9]
    index.drop_tenant("acme")
    assert index.versions(sig, "acme") == []
    assert index.versions(sig, "globex") != []


def test_an_edited_line_moves_in_what_it_shares_with_its_version(
        fresh: Callable[..., Engine]) -> None:
    eng = fresh("native", device=256)
    before, spans = _prompt(eng, MEMORY_A, 6, 1840, 180)
    eng.generate(before, max_new_tokens=1, spans=spans)
    after, spans2 = _prompt(eng, MEMORY_B, 5, 2215, 176)
    state = next(s for s in spans2 if s.source_layer == "system_state")
    res = eng.generate(after, max_new_tokens=1, spans=spans2)
    assert res.reused_chunk_edits == [state.start]
    n = state.end - state.start
    moved = dict(zip(res.reused_chunk_starts, res.reused_chunk_tokens, strict=True))
    # the changed figures are computed; of the rest, what the repair does not pick
    # (the seams after each change deviate most) is moved in
    assert 0 < res.edited_tokens < n // 4
    assert 0 < moved[state.start] < n - res.edited_tokens
    assert res.computed_tokens == res.prompt_tokens - res.reused_tokens - res.chunk_reused_tokens
    full = eng.generate(after, max_new_tokens=1, use_cache=False)
    assert res.first_logits is not None and full.first_logits is not None
    # the next token is a near tie here (" " and " no" 0.2 apart in a full prefill):
    # the distribution, not the argmax, is what the edit must keep (measured KL 0.004)
    p, q = full.first_logits.log_softmax(-1), res.first_logits.log_softmax(-1)
    assert float((p.exp() * (p - q)).sum()) < 0.01
    assert set(torch.topk(res.first_logits, 3).indices.tolist()) == \
        set(torch.topk(full.first_logits, 3).indices.tolist())
    # without edits the line is computed whole
    plain = eng.sibling(chunk_reuse=ChunkReuse(edits=False), num_device_blocks=256)
    plain.generate(before, max_new_tokens=1, spans=spans)
    base = plain.generate(after, max_new_tokens=1, spans=spans2)
    assert state.start not in base.reused_chunk_starts and base.reused_chunk_edits == []
    assert base.computed_tokens - res.computed_tokens >= moved[state.start]


def test_another_tenants_version_is_never_aligned_against(
        fresh: Callable[..., Engine]) -> None:
    eng = fresh("native", device=256)
    before, spans = _prompt(eng, MEMORY_A, 6, 1840, 180)
    eng.generate(before, max_new_tokens=1, spans=spans, tenant="acme")
    after, spans2 = _prompt(eng, MEMORY_B, 5, 2215, 176)
    other = eng.generate(after, max_new_tokens=1, spans=spans2, tenant="globex")
    assert other.reused_chunk_edits == [] and other.chunk_reused_tokens == 0
    mine = eng.generate(after, max_new_tokens=1, spans=spans2, tenant="acme")
    assert mine.reused_chunk_edits != []


def test_an_edited_path_replays_exactly(fresh: Callable[..., Engine]) -> None:
    """Engine.score with the request's chunk starts and edits takes the same path (the
    line is aligned against the same version, though its new text is now cached as
    it is too) and gives the request's logits."""
    eng = fresh("tq4", device=256)
    before, spans = _prompt(eng, MEMORY_A, 6, 1840, 180)
    eng.generate(before, max_new_tokens=1, spans=spans)
    after, spans2 = _prompt(eng, MEMORY_B, 5, 2215, 176)
    res = eng.generate(after, max_new_tokens=1, spans=spans2)
    assert res.reused_chunk_edits and res.first_logits is not None
    path = {"max_reuse_tokens": res.reused_tokens, "spans": spans2,
            "chunk_starts": res.reused_chunk_starts, "chunk_edits": res.reused_chunk_edits}
    replay = eng.score(after, res.token_ids, **path)
    torch.testing.assert_close(replay[0], res.first_logits, atol=1e-4, rtol=1e-4)


def test_the_configuration_switches_edits_off() -> None:
    from contextkit.config.settings import EngineSettings

    on, off = EngineSettings().chunk_reuse_kwargs(), EngineSettings(chunk_edits=False)
    assert isinstance(on, dict) and ChunkReuse(**on).edits
    kwargs = off.chunk_reuse_kwargs()
    assert isinstance(kwargs, dict) and not ChunkReuse(**kwargs).edits
    # the hop limit travels from the configuration to the engine, and is checked
    hops = EngineSettings(chunk_max_hops=7).chunk_reuse_kwargs()
    assert isinstance(hops, dict) and ChunkReuse(**hops).max_hops == 7
    assert ChunkReuse(**on).max_hops == ChunkReuse().max_hops
    with pytest.raises(ValueError, match="chunk_max_hops"):
        EngineSettings(chunk_max_hops=-1)
