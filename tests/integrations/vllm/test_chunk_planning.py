"""Chunk reuse on vLLM, scheduler side (no vLLM needed): which spans after a prefix hit
are found stored elsewhere, what the worker is told to place and compute, what is never
saved, and who may reuse what."""

from __future__ import annotations

import json

from contextkit.pipeline.served.wire import (
    CHUNKS_SALT_SUFFIX,
    PARAMS_KEY,
    chunk_salt,
    decode_spans,
    opted_into_chunks,
)
from gpu_cache import CacheIdentity, hash_token_blocks
from integrations.vllm.chunk_planning import ChunkPlanner, moved_key
from integrations.vllm.hints_middleware import rewrite_body
from integrations.vllm.planning import (
    RequestPlanner,
    StepRequest,
    WorkerReport,
    semantic_params,
)
from shadow.shared.objects import SpanRecord
from shadow.shared.tier import FoundSpan

BS = 4
IDENTITY = CacheIdentity(model_id="m", num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS)
TENANT = chunk_salt("acme")
HEAD = [1, 2, 3, 4]  # one block of system text, the same every turn
DOCS = {name: [base + i for i in range(8)] for name, base in
        (("a", 100), ("b", 200), ("c", 300), ("d", 400))}
QUESTION = [7, 7, 7, 7, 7]


def prompt(order: str, question: list[int] = QUESTION) -> tuple[list[int], dict]:
    ids, spans = list(HEAD), [(0, len(HEAD), "rules")]
    for name in order:
        spans.append((len(ids), len(ids) + len(DOCS[name]), "documents"))
        ids += DOCS[name]
    spans.append((len(ids), len(ids) + len(question), "user_turn"))
    ids += question
    return ids, semantic_params(spans, prompt_token_ids=ids)


def planner(**kwargs: object) -> RequestPlanner:
    chunks = ChunkPlanner(IDENTITY.digest(), BS, min_tokens=4, repair_first=1,
                          **kwargs)  # type: ignore[arg-type]
    p = RequestPlanner(IDENTITY.digest(), BS, chunks=chunks)
    p.apply(WorkerReport(chunk_status=""))  # the worker's model check passed
    return p


def plan_step(p: RequestPlanner, req: str, ids: list[int], params: dict) -> int:
    """Lookup (prefix, then chunks) and allocation of one request; its hit."""
    hit = p.matched_tokens(req, ids, len(ids), 0, tenant=TENANT, params=params)
    hit += p.chunk_tokens(req, ids, hit)
    p.on_alloc(req, hit)
    return hit


def serve(p: RequestPlanner, req: str, ids: list[int], params: dict, tenant: str = TENANT,
          stored: bool = True, blocks: int = 10) -> tuple[int, list]:
    """One request (of at most ``blocks`` blocks) through lookup, allocation, one step
    computing the rest, its saves stored and its finish; returns its hit and its loads."""
    hit = p.matched_tokens(req, ids, len(ids), 0, tenant=tenant, params=params)
    hit += p.chunk_tokens(req, ids, hit)
    p.on_alloc(req, hit)
    loads, saves = p.plan([StepRequest(req, ids, 0, len(ids), list(range(10, 10 + blocks)))])
    if stored:
        p.apply(WorkerReport(stored={k for s in saves for k in s.keys}))
    p.finish(req, ids)
    return hit, loads


def test_opting_in_is_a_cache_salt_suffix_the_middleware_sets() -> None:
    assert chunk_salt("acme") == "acme" + CHUNKS_SALT_SUFFIX == chunk_salt(chunk_salt("acme"))
    assert chunk_salt(None) == "default" + CHUNKS_SALT_SUFFIX
    assert opted_into_chunks(TENANT) and not opted_into_chunks("acme")
    assert not opted_into_chunks(None)
    body = {"model": "m", "prompt": "x", "cache_salt": "acme",
            "kv_transfer_params": {PARAMS_KEY: {"spans": [], "chunks": True}}}
    new, _ = rewrite_body(json.dumps(body).encode(), {}, priority_scheduling=False)
    assert json.loads(new)["cache_salt"] == TENANT
    body["kv_transfer_params"][PARAMS_KEY]["chunks"] = False  # type: ignore[index]
    new, _ = rewrite_body(json.dumps(body).encode(), {}, priority_scheduling=False)
    assert json.loads(new)["cache_salt"] == "acme"


def test_documents_in_a_new_order_are_found_and_placed_not_computed() -> None:
    p = planner()
    ids1, params1 = prompt("abc")
    assert serve(p, "t1", ids1, params1)[0] == 0
    ids2, params2 = prompt("cda", [8, 8, 8, 8, 8])
    hit, loads = serve(p, "t2", ids2, params2)
    # the head block is a prefix hit; c and a are moved in; d is new and computed;
    # everything up to a's end (block-aligned) is promised to vLLM
    assert hit == 28
    (load,) = loads
    chunk = load.chunk
    assert chunk is not None and (chunk.start, chunk.end) == (4, 28)
    assert len(load.keys) == 1  # the head block, loaded by prefix
    assert [(m.label, m.position, m.source_position, m.length) for m in chunk.chunks] == [
        ("documents", 4, 20, 8), ("documents", 20, 4, 8)]
    # computed: c's first token (its seam), all of d, a's first token
    assert chunk.compute == [4, *range(12, 21)]
    assert chunk.compute_ids == [ids2[i] for i in chunk.compute]
    assert chunk.reused_tokens == 24 - 10
    assert chunk.block_ids == list(range(10, 17))
    p.apply(WorkerReport(chunk_reused_tokens={"t2": chunk.reused_tokens},
                         chunk_computed_tokens={"t2": len(chunk.compute)}))


def test_blocks_holding_moved_kv_are_stored_where_no_prefix_lookup_finds_them() -> None:
    p = planner()
    serve(p, "t1", *prompt("abc"))
    ids2, params2 = prompt("cda", [8, 8, 8, 8, 8])
    plan_step(p, "t2", ids2, params2)
    _, saves = p.plan([StepRequest("t2", ids2, 0, len(ids2), list(range(10, 20)))])
    exact = hash_token_blocks(IDENTITY.digest(), TENANT, ids2, BS)
    by_block = {s.first_block + i: (k, s.moved) for s in saves for i, k in enumerate(s.keys)}
    for b in range(1, 7):  # blocks 1..6 hold moved K/V: under their moved key only
        assert by_block[b] == (moved_key(exact[b]), True)
    assert by_block[7] == (exact[7], False)  # computed by vLLM after them
    p.apply(WorkerReport(stored={k for s in saves for k in s.keys}))
    p.finish("t2", ids2)
    # the same prompt again, through vLLM's and the connector's prefix path: the chain
    # stops at the first moved block
    assert p.matched_tokens("again", ids2, len(ids2), 0, tenant=TENANT, params=params2) == 4
    # d, computed by the connector in t2 (over moved K/V: a computation, not a move), is
    # a chunk now, held under its moved key
    entries = {e.position: e for e in p.chunks.index.of_tenant(TENANT)}  # type: ignore[union-attr]
    assert entries[12].hops == 0 and entries[12].block_keys[0] == moved_key(exact[3])


def test_the_report_says_chunk_and_counts_reused_and_repaired_tokens() -> None:
    p = planner()
    serve(p, "t1", *prompt("abc"))
    ids2, params2 = prompt("cda", [8, 8, 8, 8, 8])
    plan_step(p, "t2", ids2, params2)
    (load,), _ = p.plan([StepRequest("t2", ids2, 0, len(ids2), list(range(10, 20)))])
    chunk = load.chunk
    assert chunk is not None
    p.apply(WorkerReport(loaded_tokens={"t2": 4},
                         chunk_reused_tokens={"t2": chunk.reused_tokens},
                         chunk_computed_tokens={"t2": len(chunk.compute)}))
    report = p.report("t2")
    assert report is not None
    assert report["reuse"] == "chunk"
    assert report["chunk_reused_tokens"] == chunk.reused_tokens
    assert report["repaired_tokens"] == len(chunk.compute)
    assert report["computed_tokens"] == len(ids2) - 4 - chunk.reused_tokens
    assert p.stats.take()["counters"]["chunk_reused_tokens"] == chunk.reused_tokens


def test_another_tenant_or_a_request_that_did_not_opt_in_finds_no_chunk() -> None:
    p = planner()
    serve(p, "t1", *prompt("abc"))
    ids2, params2 = prompt("cda", [8, 8, 8, 8, 8])
    other = chunk_salt("globex")
    assert serve(p, "x", ids2, params2, tenant=other)[0] == 0
    hit, loads = serve(p, "y", ids2, params2, tenant="acme")  # same tenant, not opted in
    assert hit == 0 and not loads


def test_a_chunk_whose_blocks_were_evicted_is_not_promised() -> None:
    p = planner()
    ids1, params1 = prompt("abc")
    serve(p, "t1", ids1, params1)
    ids2, params2 = prompt("cda", [8, 8, 8, 8, 8])
    p.apply(WorkerReport(removed=set(p.index)))  # the DDR tier dropped everything
    assert serve(p, "t2", ids2, params2)[0] == 0


def test_chunk_reuse_waits_for_the_model_check_and_says_why_it_is_off() -> None:
    chunks = ChunkPlanner(IDENTITY.digest(), BS, min_tokens=4, repair_first=1)
    p = RequestPlanner(IDENTITY.digest(), BS, chunks=chunks)
    serve(p, "t1", *prompt("abc"))
    ids2, params2 = prompt("cda", [8, 8, 8, 8, 8])
    hit, loads = serve(p, "t2", ids2, params2)  # no report from the worker yet
    assert hit == 4 and all(load.chunk is None for load in loads)  # the head block only
    p.apply(WorkerReport(chunk_status="the model's chunk-reuse check failed: ..."))
    ids3, params3 = prompt("bda", [9, 9, 9, 9, 9])
    hit = p.matched_tokens("t3", ids3, len(ids3), 0, tenant=TENANT, params=params3)
    assert p.chunk_tokens("t3", ids3, hit) == 0
    report = p.report("t3")
    assert report is not None and "check failed" in report["fallback"]
    p.apply(WorkerReport(chunk_status=""))
    assert p.chunk_tokens("t3", ids3, hit) > 0


def test_a_label_can_turn_chunk_reuse_off() -> None:
    p = planner(layers=frozenset({"user_turn"}))  # documents are not reusable
    serve(p, "t1", *prompt("abc"))
    ids2, params2 = prompt("cda", [8, 8, 8, 8, 8])
    hit, loads = serve(p, "t2", ids2, params2)
    assert hit == 4 and all(load.chunk is None for load in loads)


def test_moved_kv_is_reused_at_most_max_hops_times() -> None:
    for max_hops, expected in ((1, []), (2, ["documents"])):
        p = planner(max_hops=max_hops)
        ids1, params1 = prompt("ab")
        serve(p, "t1", ids1, params1)
        # t2 moves b and a; t1's blocks are evicted before t2 finishes, so t2's copies
        # (one move from a full computation) become the entries
        ids2, params2 = prompt("ba", [8] * 8)
        plan_step(p, "t2", ids2, params2)
        _, saves = p.plan([StepRequest("t2", ids2, 0, len(ids2), list(range(10, 20)))])
        p.apply(WorkerReport(stored={k for s in saves for k in s.keys},
                             removed=set(hash_token_blocks(IDENTITY.digest(), TENANT, ids1,
                                                           BS))))
        p.finish("t2", ids2)
        entries = {e.position: e.hops for e in p.chunks.index.of_tenant(TENANT)}  # type: ignore[union-attr]
        assert entries[4] == entries[12] == 1  # b and a, each moved once
        # t3: a new document, then b: reused only below max_hops
        ids3, params3 = prompt("db", [9] * 8)
        _, loads = serve(p, "t3", ids3, params3)
        moved = [m.label for load in loads if load.chunk for m in load.chunk.chunks]
        assert moved == expected, max_hops


def test_a_conversation_does_not_drift_a_hop_further_every_turn() -> None:
    """Each turn's new message is computed over the moved ones before it: a
    computation, so its entry stays 0 hops however long the conversation."""
    p = planner(max_hops=1)
    messages: list[list[int]] = []
    for turn in range(5):
        messages.append([500 + 10 * turn + i for i in range(8)])
        # the documents change every turn, so the conversation moves every turn
        ids, spans = list(HEAD), [(0, len(HEAD), "rules")]
        for part, label in [(DOCS[d], "documents") for d in ("abc" if turn % 2 else "ba")] + [
                (m, "user_turn") for m in messages]:
            spans.append((len(ids), len(ids) + len(part), label))
            ids += part
        ids += QUESTION  # the prompt's unlabelled end
        _, loads = serve(p, f"t{turn}", ids, semantic_params(spans, prompt_token_ids=ids),
                         blocks=20)
        moved = [m.label for load in loads if load.chunk for m in load.chunk.chunks]
        if turn >= 2:  # earlier messages moved in, however many turns ago
            assert "user_turn" in moved, (turn, moved)
    hops = [e.hops for e in p.chunks.index.of_tenant(TENANT) if e.label == "user_turn"]
    assert len(hops) == 5 and max(hops) == 0


def test_the_selection_share_is_planned_so_the_report_counts_it() -> None:
    p = planner(repair_ratio=0.5)
    serve(p, "t1", *prompt("abc"))
    ids2, params2 = prompt("cda", [8, 8, 8, 8, 8])
    plan_step(p, "t2", ids2, params2)
    (load,), _ = p.plan([StepRequest("t2", ids2, 0, len(ids2), list(range(10, 20)))])
    chunk = load.chunk
    assert chunk is not None and chunk.selected == 7  # half of the 14 moved tokens
    assert chunk.reused_tokens == 24 - 10 - 7 and chunk.computed_tokens == 10 + 7
    report = p.report("t2")  # the worker has not reported: the planned figures
    assert report is not None and not report["complete"]
    assert (report["chunk_reused_tokens"], report["repaired_tokens"]) == (7, 17)


def test_with_a_shared_tier_new_spans_are_published_once() -> None:
    chunks = ChunkPlanner(IDENTITY.digest(), BS, min_tokens=4, repair_first=1)
    p = RequestPlanner(IDENTITY.digest(), BS, chunks=chunks, chunk_blocks=4)
    p.apply(WorkerReport(chunk_status=""))
    ids, params = prompt("ab")
    serve(p, "t1", ids, params)
    shares = p.take_shares()
    # the rules, both documents and the question, where they were computed, with the
    # blocks holding them (the question's last is the prompt's partial block)
    assert [(s.span.label, s.span.position, s.span.length, s.span.hops, len(s.block_keys))
            for s in shares] == [
        ("rules", 0, 4, 0, 1), ("documents", 4, 8, 0, 2), ("documents", 12, 8, 0, 2),
        ("user_turn", 20, 5, 0, 2)]
    assert all(s.tenant == TENANT for s in shares)
    serve(p, "t2", ids, params)  # the same spans again: nothing new to publish
    assert p.take_shares() == []
    # without a shared tier nothing is queued
    q = planner()
    serve(q, "t1", ids, params)
    assert q.take_shares() == []


def test_a_span_found_in_the_shared_tier_is_planned_unless_it_is_not_this_span() -> None:
    ids, params = prompt("ab")
    spans = decode_spans(params[PARAMS_KEY])[1]
    doc_b = next(s for s in spans if s.start == 12)
    chunks = ChunkPlanner(IDENTITY.digest(), BS, min_tokens=4, repair_first=1, max_hops=2)
    key = chunks.index.key(TENANT, "documents", ids[12:20])
    blocks = [bytes([i]) * 32 for i in range(3)]  # the span at 33 lies in 3 blocks

    def plan(record: SpanRecord) -> object:
        found = {key: FoundSpan("p", record, blocks)}
        return chunks.plan("r", TENANT, ids, len(ids), [doc_b], 4, lambda k: False, found)

    load = plan(SpanRecord(key, "documents", 33, 8, 1))
    assert load is not None and load.chunks[0].shared == key  # type: ignore[attr-defined]
    assert load.chunks[0].source_position == 33  # type: ignore[attr-defined]
    assert plan(SpanRecord(key, "memories", 33, 8, 1)) is None  # another label
    assert plan(SpanRecord(key, "documents", 33, 7, 1)) is None  # another length
    assert plan(SpanRecord(key, "documents", 33, 8, 2)) is None  # max_hops away


def layered(*parts: tuple[list[int], str | None]) -> tuple[list[int], dict]:
    """A prompt of labelled (or unlabelled: None) parts, and its params."""
    ids: list[int] = []
    spans = []
    for part, label in parts:
        if label is not None:
            spans.append((len(ids), len(ids) + len(part), label))
        ids += part
    return ids, semantic_params(spans, prompt_token_ids=ids)


# blocks of 4: lengths 6 and 7 put span boundaries inside blocks
RULES6 = [1, 2, 3, 4, 5, 6]
DOC7 = {name: [base + i for i in range(7)] for name, base in
        (("a", 100), ("b", 200), ("c", 300), ("d", 400))}


def rag(order: str, question: list[int], *, rules: list[int] = RULES6,
        head: list[int] | None = None) -> tuple[list[int], dict]:
    """Rules, the documents ``order`` names and a question (after an unlabelled
    ``head``), and its params."""
    return layered(*([(head, None)] if head else []), (rules, "rules"),
                   *((DOC7[d], "documents") for d in order), (question, "user_turn"))


def test_chunks_that_sat_together_where_computed_need_one_seam() -> None:
    p = planner()  # repair_first=1
    serve(p, "t1", *rag("abc", [7] * 5))
    # rules [0,6) d [6,13) a [13,20) b [20,27): a and b sat together in t1 too (a's
    # last block there, [12,16), holds b's first token); d is new
    ids2, params2 = rag("dab", [8] * 9)
    _, loads = serve(p, "t2", ids2, params2)
    (load,) = loads
    chunk = load.chunk
    # to the block boundary after b: b is reused to its end, the question's first token
    # (in b's last block) computed by the connector
    assert chunk is not None and (chunk.start, chunk.end) == (4, 28)
    by_position = {m.position: m for m in chunk.chunks}
    assert by_position[13].repair == 1  # a follows d here, not what it followed in t1
    assert by_position[20].repair == 0 and by_position[20].length == 7  # b follows a
    # d is computed, and a's seam; b's first token and the rules' rest are not
    assert chunk.compute == [*range(6, 13), 13, 27]


def test_a_chunk_that_moved_without_its_neighbour_keeps_its_seam() -> None:
    p = planner()
    serve(p, "t1", *rag("abc", [7] * 5))
    # b and a adjacent here, but b came after a in t1, not before: both need seams
    ids2, params2 = rag("dba", [8] * 9)
    _, loads = serve(p, "t2", ids2, params2)
    (load,) = loads
    assert load.chunk is not None
    assert [(m.position, m.repair) for m in load.chunk.chunks if not m.exact] == [
        (13, 1), (20, 1)]
    assert 20 in load.chunk.compute


def test_a_span_the_prefix_hit_ends_inside_continues_it_exactly() -> None:
    p = planner()
    serve(p, "t1", *rag("abc", [7] * 5))
    ids2, params2 = rag("dab", [8] * 9)
    hit = plan_step(p, "t2", ids2, params2)
    (load,), _ = p.plan([StepRequest("t2", ids2, 0, len(ids2), list(range(10, 20)))])
    chunk = load.chunk
    assert hit == 28 and chunk is not None and chunk.start == 4  # block 0 by prefix
    rest = chunk.chunks[0]
    # the rules' last 2 tokens, from t1's block 1 (computed after the same block 0 at
    # the same position): no seam, no hop
    t1_keys = hash_token_blocks(IDENTITY.digest(), TENANT, rag("abc", [7] * 5)[0], BS)
    assert (rest.position, rest.length, rest.repair, rest.exact) == (4, 2, 0, True)
    assert rest.source_keys == [t1_keys[1]] and rest.offset == 0
    assert 4 not in chunk.compute and 5 not in chunk.compute
    assert chunk.taints(BS)[0] == (1, 2, 0)
    # another rules text of the same length after the same first block is not this span
    ids3, params3 = rag("dab", [8] * 9, rules=[1, 2, 3, 4, 9, 9])
    _, loads3 = serve(p, "t3", ids3, params3)
    assert all(not m.exact for load in loads3 if load.chunk for m in load.chunk.chunks)


def test_a_span_the_hit_ends_inside_computed_after_other_tokens_is_not_exact() -> None:
    """The same rules at the same position, but last computed after another first
    block: their K/V saw other tokens, so they do not continue this prefix exactly."""
    p = planner()
    ids1, params1 = rag("ab", [7] * 9, head=[9])
    serve(p, "t1", ids1, params1)  # block 0 [9, 1, 2, 3] is stored
    # t1's block 1 is evicted: its rules' entry goes, block 0 stays
    p.apply(WorkerReport(removed={hash_token_blocks(IDENTITY.digest(), TENANT, ids1, BS)[1]}))
    serve(p, "t2", *rag("ab", [7] * 9, head=[8]))  # the rules' entry now starts in [8, 1, 2, 3]
    (rules,) = [e for e in p.chunks.index.of_tenant(TENANT) if e.label == "rules"]  # type: ignore[union-attr]
    assert rules.position == 1 and rules.hops == 0
    _, loads = serve(p, "t3", *rag("ba", [8] * 9, head=[9]))
    (load,) = loads
    assert load.chunk is not None and load.chunk.start == 4  # block 0: a prefix hit
    assert all(not m.exact for m in load.chunk.chunks)
    assert load.chunk.compute[:4] == [4, 5, 6, 7]  # the rules' rest and b's seam


def test_a_chunk_next_to_one_from_another_prompt_keeps_its_seam() -> None:
    """Adjacent here and at the same distance where computed, but in two prompts: b
    followed d there, not a, so b's first token is recomputed."""
    p = planner()
    serve(p, "t1", *rag("ac", [7] * 9))  # a at [6, 13)
    serve(p, "t2", *rag("db", [7] * 9))  # b at [13, 20), after d
    _, loads = serve(p, "t3", *rag("ab", [8] * 9))  # a at [6, 13), b at [13, 20)
    (load,) = loads
    assert load.chunk is not None
    b = [m for m in load.chunk.chunks if m.position == 13]
    assert b and b[0].repair == 1 and 13 in load.chunk.compute


def test_a_chunk_placed_after_the_text_it_was_computed_after_needs_no_seam() -> None:
    """b was computed right after a (in t2), a comes from another prompt (t1): not one
    stored run, but b's first tokens see here the text they saw there."""
    p = planner(seam_lead=4)
    serve(p, "t1", *rag("da", [7] * 9))  # a at [13, 20), after d
    serve(p, "t2", *rag("ab", [7] * 9))  # a moved in; b new at [13, 20), after a
    _, loads = serve(p, "t3", *rag("cab", [8] * 9))  # c new, a at [13, 20), b at [20, 27)
    (load,) = loads
    assert load.chunk is not None
    by_position = {m.position: m for m in load.chunk.chunks}
    assert by_position[13].source_position == 13 and by_position[13].repair == 1
    assert by_position[20].source_position == 13 and by_position[20].repair == 0
    assert 13 in load.chunk.compute and 20 not in load.chunk.compute


def test_without_a_lead_window_a_chunk_from_another_prompt_keeps_its_seam() -> None:
    p = planner(seam_lead=0)
    serve(p, "t1", *rag("da", [7] * 9))
    serve(p, "t2", *rag("ab", [7] * 9))
    _, loads = serve(p, "t3", *rag("cab", [8] * 9))
    (load,) = loads
    assert load.chunk is not None
    assert {m.position: m.repair for m in load.chunk.chunks}[20] == 1


def test_a_message_computed_in_the_block_a_moved_one_ends_in_stays_0_hops() -> None:
    """Messages of 7 tokens in blocks of 4: each new one starts in the block where the
    moved one before it ends. Its own K/V there were computed, not moved."""
    p = planner(max_hops=1)
    messages: list[list[int]] = []
    for turn in range(5):
        messages.append([500 + 10 * turn + i for i in range(7)])
        ids, params = layered((RULES6, "rules"),
                              *((DOC7[d], "documents") for d in ("abc" if turn % 2 else "ba")),
                              *((m, "user_turn") for m in messages), ([7] * 5, None))
        _, loads = serve(p, f"t{turn}", ids, params, blocks=20)
        moved = [m.label for load in loads if load.chunk for m in load.chunk.chunks]
        if turn >= 2:
            assert moved.count("user_turn") == turn, (turn, moved)
    hops = [e.hops for e in p.chunks.index.of_tenant(TENANT) if e.label == "user_turn"]
    assert len(hops) == 5 and max(hops) == 0


def test_the_last_message_in_a_prompts_partial_block_is_a_chunk_next_turn() -> None:
    """A prompt's last message ends in its last, partial block (the chat template's
    generation prompt follows it). That block is saved under a key no prefix lookup
    computes, so the message is reused where the next turn repeats it."""
    p = planner()
    memory1, memory2 = [600 + i for i in range(7)], [700 + i for i in range(7)]
    question, reply, question2 = ([800 + i for i in range(8)], [900 + i for i in range(7)],
                                  [950 + i for i in range(7)])
    generation = [9, 9]  # unlabelled: the template's "assistant" header
    ids1, params1 = layered((RULES6, "rules"), (memory1, "memories"), (question, "user_turn"),
                            (generation, None))
    assert len(ids1) == 23  # blocks 0-4 full, block 5 holds tokens 20-22
    p.matched_tokens("t1", ids1, len(ids1), 0, tenant=TENANT, params=params1)
    _, saves = p.plan([StepRequest("t1", ids1, 0, len(ids1), list(range(10, 16)))])
    tail = [s for s in saves if s.first_block == 5]
    assert len(tail) == 1 and tail[0].moved and tail[0].block_ids == [15]
    p.apply(WorkerReport(stored={k for s in saves for k in s.keys}))
    p.finish("t1", ids1)
    exact = hash_token_blocks(IDENTITY.digest(), TENANT, ids1, BS)
    assert tail[0].keys[0] not in exact
    # the same prompt again finds its full blocks only by prefix
    assert p.matched_tokens("again", ids1, len(ids1), 0, tenant=TENANT, params=params1) == 20
    # next turn: the memories changed; the question is repeated, then the reply and a
    # new question
    ids2, params2 = layered((RULES6, "rules"), (memory2, "memories"), (question, "user_turn"),
                            (reply, "user_turn"), (question2, "user_turn"), (generation, None))
    _, loads = serve(p, "t2", ids2, params2)
    (chunk,) = [load.chunk for load in loads if load.chunk is not None]
    (moved,) = [m for m in chunk.chunks if m.label == "user_turn"]
    assert (moved.position, moved.source_position, moved.length) == (13, 13, 8)
    assert moved.source_keys == [exact[3], exact[4], tail[0].keys[0]]
    assert all(p not in chunk.compute for p in range(14, 21))  # its seam is token 13


def test_a_request_that_did_not_opt_in_saves_no_partial_block() -> None:
    p = planner()
    ids, params = layered((RULES6, "rules"), ([800 + i for i in range(8)], "user_turn"),
                          ([9, 9], None))
    p.matched_tokens("t1", ids, len(ids), 0, tenant="acme", params=params)
    _, saves = p.plan([StepRequest("t1", ids, 0, len(ids), list(range(10, 14)))])
    assert saves and all(s.first_block + len(s.keys) <= len(ids) // BS for s in saves)


def test_the_last_user_message_after_a_volatile_trailing_message_is_not_volatile() -> None:
    """The served layout: history, a trailing system message of volatile layers (the
    next call changes it: ``volatile_from``), then the user's message, which the next
    call repeats as history. For a request that opted into chunk reuse only the blocks
    of the trailing message are its volatile tail (stored only when there is room);
    the message's blocks are kept like any other, so it is a chunk next turn."""
    rules, trailing, message = RULES6, [600 + i for i in range(6)], [800 + i for i in range(9)]
    spans = [(0, 6, "rules"), (6, 12, "system_state"), (12, 21, "user_turn")]
    ids = rules + trailing + message + [9, 9]  # 23 tokens: blocks 0-4 and a partial 5

    def tails(tenant: str) -> dict[int, bool]:
        p = planner()
        params = semantic_params(spans, prompt_token_ids=ids, volatile_from=6)
        p.matched_tokens("t1", ids, len(ids), 0, tenant=tenant, params=params)
        _, saves = p.plan([StepRequest("t1", ids, 0, len(ids), list(range(10, 16)))])
        return {s.first_block + i: label.tail for s in saves for i, label in enumerate(s.labels)}

    # block 1 holds the rules' end and the trailing message's start, block 2 the rest
    # of it; blocks 3-5 hold the message (5: the partial block, saved for chunk reuse)
    assert tails(TENANT) == {0: False, 1: True, 2: True, 3: False, 4: False, 5: False}
    # a request that did not opt in: the whole tail is volatile, no partial block
    assert tails("acme") == {0: False, 1: True, 2: True, 3: True, 4: True}
