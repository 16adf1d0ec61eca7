"""Scheduler-side planning of the vLLM connector (no vLLM needed)."""

from __future__ import annotations

import json

import pytest

from contextkit.pipeline.served.wire import (
    PARAMS_KEY,
    WireSpan,
    encode_labels,
    prompt_fingerprint,
)
from gpu_cache import CacheIdentity, hash_token_blocks
from integrations.vllm import ConnectorConfig, ConnectorConfigError, kv_transfer_config, planning
from integrations.vllm.planning import (
    RequestPlanner,
    StepRequest,
    WorkerReport,
    label_mismatch,
    labels_from_params,
    semantic_params,
)
from integrations.vllm.precision import DEFAULT_POLICY

BS = 4
IDENTITY = CacheIdentity(model_id="m", num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS)
TOKENS = list(range(100, 118))  # 18 tokens: 4 full blocks + 2


def planner() -> RequestPlanner:
    return RequestPlanner(IDENTITY.digest(), BS)


def test_keys_are_contextkits_block_keys_salted_by_tenant() -> None:
    p = planner()
    keys = hash_token_blocks(IDENTITY.digest(), "acme", TOKENS, BS)
    p.seed(keys)
    assert p.matched_tokens("r", TOKENS, len(TOKENS), 0, tenant="acme") == 16
    # same tokens, another tenant (vLLM cache_salt): no match
    assert p.matched_tokens("s", TOKENS, len(TOKENS), 0, tenant="other") == 0


def test_match_is_a_prefix_leaves_a_token_and_counts_beyond_local_hits() -> None:
    keys = hash_token_blocks(IDENTITY.digest(), "default", TOKENS, BS)
    p = planner()
    p.seed([keys[0], keys[1], keys[3]])  # block 2 missing: the chain stops there
    assert p.matched_tokens("a", TOKENS, len(TOKENS), 0) == 8
    assert p.matched_tokens("b", TOKENS, len(TOKENS), 4) == 4  # vLLM had block 0 locally
    p.seed(keys)
    exact = TOKENS[:16]  # a prompt of exactly 4 blocks: the last token is recomputed
    assert p.matched_tokens("c", exact, 16, 0) == 12


def test_plan_loads_hits_and_saves_new_full_blocks_once() -> None:
    keys = hash_token_blocks(IDENTITY.digest(), "default", TOKENS, BS)
    p = planner()
    p.seed(keys[:2])
    assert p.matched_tokens("r", TOKENS, len(TOKENS), 0) == 8
    p.on_alloc("r", 8)
    loads, saves = p.plan([StepRequest("r", TOKENS, 8, 10, [7, 8, 9, 10, 11])])
    assert [(s.keys, s.block_ids) for s in loads] == [(keys[:2], [7, 8])]
    assert [(s.keys, s.block_ids, s.first_block) for s in saves] == [(keys[2:4], [9, 10], 2)]
    # in flight: not planned again, not matched yet
    loads, saves = p.plan([StepRequest("r", [*TOKENS, 5, 6], 18, 1, [7, 8, 9, 10, 11])])
    assert loads == [] and saves == []
    assert p.matched_tokens("q", TOKENS, len(TOKENS), 0) == 8
    p.apply(WorkerReport(stored=set(keys[2:4])))
    assert p.matched_tokens("q2", TOKENS, len(TOKENS), 0) == 16


def test_stats_wait_for_the_load_report_of_a_request_finished_in_that_step() -> None:
    keys = hash_token_blocks(IDENTITY.digest(), "default", TOKENS, BS)
    p = planner()
    p.seed(keys)
    p.matched_tokens("r", TOKENS, len(TOKENS), 0)
    p.on_alloc("r", 16)
    p.plan([StepRequest("r", TOKENS, 16, 2, [1, 2, 3, 4, 5])])
    assert p.finish("r") == []  # vLLM frees it before handing over the step's report
    (stats,) = p.apply(WorkerReport(loaded_tokens={"r": 12}, load_failed_tokens={"r": 4}))
    assert stats["planned_hit_tokens"] == 16
    assert stats["external_hit_tokens"] == 12 and stats["load_failed_tokens"] == 4
    assert p.finish("never-seen") == []


def test_the_cache_report_splits_a_prompt_by_where_its_tokens_came_from() -> None:
    keys = hash_token_blocks(IDENTITY.digest(), "default", TOKENS, BS)
    p = planner()
    p.seed(keys[:3])
    # vLLM held block 0; the connector supplies blocks 1 and 2
    assert p.matched_tokens("r", TOKENS, len(TOKENS), 4) == 8
    p.on_alloc("r", 8)
    p.plan([StepRequest("r", TOKENS, 12, 6, [1, 2, 3, 4, 5])])
    p.apply(WorkerReport(loaded_tokens={"r": 8}))
    report = p.report("r")
    assert report == {"reuse": "prefix", "prompt_tokens": 18, "vllm_cached_tokens": 4,
                      "contextkit_loaded_tokens": 8, "shared_tier_tokens": 0,
                      "chunk_reused_tokens": 0, "repaired_tokens": 0,
                      "computed_tokens": 6, "fallback": None, "complete": True}
    assert p.report("never-seen") is None


def test_the_cache_report_says_why_contextkit_fell_back() -> None:
    keys = hash_token_blocks(IDENTITY.digest(), "default", TOKENS, BS)
    p = planner()
    p.seed(keys)
    bad = {PARAMS_KEY: {"spans": "not a list"}}
    p.matched_tokens("r", TOKENS, len(TOKENS), 0, params=bad)
    p.on_alloc("r", 16)
    p.plan([StepRequest("r", TOKENS, 16, 2, [1, 2, 3, 4, 5])])
    p.apply(WorkerReport(loaded_tokens={"r": 8}, load_failed_tokens={"r": 8}))
    report = p.report("r")
    assert report is not None and report["reuse"] == "recomputed"
    assert report["fallback"].startswith("labels ignored: ")
    assert "8 tokens failed to load and were computed" in report["fallback"]
    assert report["computed_tokens"] == 10
    cold = planner()
    cold.matched_tokens("c", TOKENS, len(TOKENS), 0)
    assert (cold.report("c") or {})["reuse"] == "none"


def test_evicted_keys_leave_the_index() -> None:
    keys = hash_token_blocks(IDENTITY.digest(), "default", TOKENS, BS)
    p = planner()
    p.seed(keys)
    p.apply(WorkerReport(removed={keys[1]}))
    assert p.matched_tokens("r", TOKENS, len(TOKENS), 0) == 4


def test_worker_reports_aggregate_conservatively() -> None:
    a = WorkerReport(stored={b"x"}, loaded_tokens={"r": 16})
    b = WorkerReport(stored={b"y"}, loaded_tokens={"r": 8}, load_failed_tokens={"r": 8})
    merged = a.merge(b)
    assert merged.stored == {b"x", b"y"}
    assert merged.loaded_tokens == {"r": 8} and merged.load_failed_tokens == {"r": 8}
    assert not WorkerReport()


def test_semantic_labels_from_request_params() -> None:
    params = semantic_params([(0, 8, "axioms", 1.0), (8, 12, "memories")], pin=True)
    labels = labels_from_params(params, 0, 4, BS, "user_turn")
    assert [lab.source_layer for lab in labels] == ["axioms", "axioms", "memories", "user_turn"]
    assert [lab.pinned for lab in labels] == [True, True, False, False]
    assert labels_from_params({"contextkit": {"spans": "junk"}}, 0, 1, BS, "x")[0].source_layer \
        == "x"
    with pytest.raises(ValueError):
        semantic_params([(5, 2, "axioms")])


def test_config_refuses_unknown_keys_and_builds_the_kv_transfer_config() -> None:
    with pytest.raises(ConnectorConfigError, match="shadow_ulr"):
        ConnectorConfig.from_extra_config({"shadow_ulr": "file:///x"})
    with pytest.raises(ConnectorConfigError, match="codec must be one of tq4, k5v4, int8, fp16, "
                                                   "native, got 'tq3'"):
        ConnectorConfig(codec="tq3")
    for codec in ("tq4", "int8", "fp16", "native"):  # every block format is a codec
        assert ConnectorConfig(codec=codec).codec == codec
    config = ConnectorConfig.from_json('{"kv_connector": "ContextKitConnector", '
                                       '"kv_connector_extra_config": {"block_size": 16}}')
    doc = kv_transfer_config(config)
    assert doc["kv_connector_module_path"] == "integrations.vllm.connector"
    assert doc["kv_load_failure_policy"] == "recompute"
    assert doc["kv_connector_extra_config"]["block_size"] == 16


def test_importing_the_package_imports_neither_vllm_nor_numba() -> None:
    import subprocess
    import sys

    code = ("import sys, integrations.vllm; "
            "print(any(m in sys.modules for m in ('vllm', 'numba', 'gpu_cache')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def _fingerprinted(spans: list[list[object]], ids: list[int]) -> dict[str, object]:
    """What the pipeline sends: spans with a pinned flag, and the prompt's fingerprint
    (sha256 of the ids as little-endian int32)."""
    import hashlib
    import struct

    return {"contextkit": {"spans": spans, "pin": True, "prompt_tokens": len(ids),
                           "prompt_sha256": hashlib.sha256(
                               struct.pack(f"<{len(ids)}i", *ids)).hexdigest()}}


def test_both_sides_speak_one_wire_format() -> None:
    """The connector reads what the pipeline's wire module writes, and semantic_params
    writes the same bytes (the literal form above is what travels)."""
    sent = [[0, 8, "axioms", 1.0, True], [8, 18, "memories", 0.4, False]]
    literal = _fingerprinted(sent, TOKENS)
    spans = [WireSpan.decode(s) for s in sent]
    assert encode_labels(spans, pin=True, prompt_token_ids=TOKENS) == literal
    assert json.dumps(semantic_params([tuple(s) for s in sent], pin=True,
                                      prompt_token_ids=TOKENS)) == json.dumps(literal)
    assert planning.PARAMS_KEY is PARAMS_KEY and planning.prompt_fingerprint is \
        prompt_fingerprint
    assert label_mismatch(literal, TOKENS) is None
    assert [(lab.source_layer, lab.pinned) for lab in labels_from_params(
        literal, 0, 4, BS, "user_turn")] == [("axioms", True), ("axioms", True),
                                              ("memories", False), ("memories", False)]


def test_span_pinned_flag_pins_per_span() -> None:
    # the 5th element decides: a pinnable layer the client did not pin stays unpinned
    params = {"contextkit": {"spans": [[0, 4, "axioms", 1.0, True], [4, 8, "rules", 0.9, False],
                                       [8, 12, "memories", 0.4, False]], "pin": True}}
    labels = labels_from_params(params, 0, 4, BS, "user_turn")
    assert [(lab.source_layer, lab.pinned) for lab in labels] == [
        ("axioms", True), ("rules", False), ("memories", False), ("user_turn", False)]
    # the old 4-element form keeps the request-level pin
    old = {"contextkit": {"spans": [[0, 4, "rules", 0.9]], "pin": True}}
    assert labels_from_params(old, 0, 1, BS, "user_turn")[0].pinned is True


def _saved_labels(p: RequestPlanner, req_id: str, tokens: list[int],
                  params: dict[str, object]) -> list[tuple[str, bool]]:
    p.matched_tokens(req_id, tokens, len(tokens), 0, params=params)
    _, saves = p.plan([StepRequest(req_id, tokens, 0, len(tokens), list(range(5)))])
    return [(lab.source_layer, lab.pinned) for s in saves for lab in s.labels]


def test_labels_with_a_matching_fingerprint_are_used() -> None:
    p = planner()
    params = _fingerprinted([[0, 8, "axioms", 1.0, True], [8, 18, "memories", 0.4, False]],
                            TOKENS)
    assert _saved_labels(p, "r", TOKENS, params) == [
        ("axioms", True), ("axioms", True), ("memories", False), ("memories", False)]
    # each saved label carries the format the planner's policy gives its block
    assert p.policy is DEFAULT_POLICY
    p2 = planner()
    p2.matched_tokens("r", TOKENS, len(TOKENS), 0, params=params)
    _, saves = p2.plan([StepRequest("r", TOKENS, 0, len(TOKENS), list(range(5)))])
    labels = [lab for s in saves for lab in s.labels]
    # (the prompt's blocks are decided together: the default policy has a byte budget)
    assert [lab.fmt for lab in labels] == DEFAULT_POLICY.formats_for(labels, p2.head_dim)
    # and the format to keep while the store has room: int8 above k5v4, none above int8
    assert [lab.room_fmt for lab in labels] == [
        "int8" if lab.fmt == "k5v4" else None for lab in labels]
    assert {lab.fmt for lab in labels} >= {"fp16", "k5v4"}
    assert p.stats.take() == {"counters": {"lookups": 1}, "by_layer": {}, "gauges": {}}


@pytest.mark.parametrize("client_ids, reason", [
    (TOKENS[:-1], "17 prompt tokens"),           # another template: another length
    ([*TOKENS[:-1], 999], "prompt_sha256"),      # same length, other ids
])
def test_labels_for_another_prompt_are_refused(client_ids: list[int], reason: str,
                                               caplog: pytest.LogCaptureFixture) -> None:
    p = planner()
    params = _fingerprinted([[0, 8, "axioms", 1.0, True], [8, 18, "memories", 0.4, False]],
                            client_ids)
    with caplog.at_level("WARNING", logger="integrations.vllm.planning"):
        labels = _saved_labels(p, "req-7", TOKENS, params)
        p.matched_tokens("req-7", TOKENS, len(TOKENS), 0, params=params)  # once per request
    assert labels == [("user_turn", False)] * 4  # default labels, nothing pinned
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "req-7" in warnings[0] and reason in warnings[0]
    stats = p.stats.take()
    assert stats is not None and stats["counters"]["label_mismatches"] == 1


@pytest.mark.parametrize("ours, reason", [
    ("junk", "must be an object"),
    ({"spans": "junk"}, "malformed spans"),
    ({"spans": [[0, 8, "axioms"]]}, "malformed spans"),
    ({"spans": [[8, 4, "axioms", 1.0]]}, "0 <= start <= end"),
    ({"spans": [[0, 8, "axioms", 2.0]], "pin": True}, "importance in [0, 1]"),
    ({"spans": [[0, 8, "axioms", 1.0], [8, 30, "memories", 0.4]], "pin": True},
     "ends past the end of the prompt (18 tokens)"),
], ids=["not-an-object", "spans-not-a-list", "short-span", "start-after-end",
        "importance-over-1", "span-past-the-prompt"])
def test_bad_labels_are_served_without_them_and_named_with_the_request(
        ours: object, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    # Served, not refused: the scheduler cannot answer one request with an error, so the
    # request keeps its blocks with the default layer, one warning names it, and the
    # label counter moves.
    p = planner()
    with caplog.at_level("WARNING", logger="integrations.vllm.planning"):
        labels = _saved_labels(p, "req-9", TOKENS, {PARAMS_KEY: ours})
    assert labels == [("user_turn", False)] * 4
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("request req-9: ignoring its contextkit labels")
    assert reason in warnings[0]
    stats = p.stats.take()
    assert stats is not None and stats["counters"]["label_mismatches"] == 1


def test_a_span_ending_at_the_prompt_end_is_fine(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="integrations.vllm.planning"):
        labels = _saved_labels(planner(), "r", TOKENS, {PARAMS_KEY: {
            "spans": [[0, 8, "axioms", 1.0], [8, 18, "memories", 0.4]], "pin": True}})
    assert labels == [("axioms", True)] * 2 + [("memories", False)] * 2
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
