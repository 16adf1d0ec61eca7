"""Agent hints in the serving stacks' dialects: parsed, checked, carried into
``kv_transfer_params`` by the API server's middleware, turned into labels, and pins
that last their TTL within the tenant's quota (no vLLM needed)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_cache import Tier, hash_token_blocks
from integrations.vllm.config import ConnectorConfig
from integrations.vllm.hints import HINTS_KEY, Hints, Retention, from_request, from_wire
from integrations.vllm.hints_middleware import (
    AgentHintsMiddleware,
    rewrite_body,
    schedules_by_priority,
)
from integrations.vllm.identity import vllm_cache_identity
from integrations.vllm.planning import (
    RequestPlanner,
    StepRequest,
    hinted_labels,
)
from integrations.vllm.precision import BlockLabel
from integrations.vllm.store import ConnectorStore, tenant_slug


def _hints(body: dict[str, Any], headers: dict[str, str] | None = None,
           **kw: Any) -> tuple[Hints | None, list[str], list[str]]:
    return from_request(body, headers or {}, **kw)


# ---------------------------------------------------------------------- dialects
def test_dynamo_agent_hints_priority_and_cache_control() -> None:
    hints, warnings, consumed = _hints({"nvext": {
        "agent_hints": {"priority": 80, "osl": 512, "speculative_prefill": True},
        "cache_control": {"type": "ephemeral", "ttl": "10m"}}},
        {"x-dynamo-session-id": "s-1"})
    assert warnings == [] and consumed == ["nvext"]
    assert hints == Hints(0.8, 600.0, (), "s-1", ("dynamo",))
    # Dynamo clamps the TTL to [300, 3600] s; its priority header wins over the body
    hints, _, _ = _hints({"nvext": {"agent_hints": {"priority": 10},
                                    "cache_control": {"ttl": "30"}}},
                         {"x-dynamo-request-priority": "250"})
    assert hints is not None and hints.importance == 1.0 and hints.keep_s == 300.0


def test_sglang_priority_is_a_hint_unless_vllm_schedules_by_priority() -> None:
    hints, _, consumed = _hints({"priority": 40})
    assert hints is not None and hints.importance == 0.4 and hints.sources == ("sglang",)
    assert consumed == ["priority"]  # vLLM documents it as an error under FCFS
    hints, _, consumed = _hints({"priority": 40}, priority_scheduling=True)
    assert hints is None and consumed == []  # vLLM's own: lower is earlier
    hints, _, _ = _hints({}, {"x-override-priority": "-3"})
    assert hints is not None and hints.importance == 0.0


def test_vllm_retention_directives_per_token_range() -> None:
    hints, warnings, consumed = _hints({
        "retention_directives": [{"start": 0, "end": 64, "priority": 90, "duration": 30.5},
                                 {"start": 64, "end": None, "priority": 20}],
        "retention_scope": "agent-7"})
    assert warnings == [] and sorted(consumed) == ["retention_directives", "retention_scope"]
    assert hints is not None and hints.session == "agent-7"
    assert hints.ranges == (Retention(0, 64, 0.9, 30.5), Retention(64, None, 0.2, None))
    assert hints.at(32) == (0.9, 30.5) and hints.at(64) == (0.2, None)


def test_the_agent_hint_of_vllm_rfc_52113() -> None:
    hints, warnings, _ = _hints({"agent_hint": {"session_id": "worker-7",
                                                "cache_control": {"type": "ephemeral",
                                                                  "ttl": 120}}})
    assert warnings == [] and hints == Hints(None, 120.0, (), "worker-7", ("vllm-agent-hint",))


@pytest.mark.parametrize(("body", "says"), [
    ({"nvext": {"agent_hints": {"priority": "high"}}}, "must be an integer"),
    ({"nvext": {"cache_control": {"type": "ephemeral", "ttl": -5}}}, "in [0, inf]"),
    ({"nvext": {"cache_control": {"type": "ephemeral", "ttl": "soon"}}}, "like '5m'"),
    ({"nvext": {"cache_control": {"type": "persistent", "ttl": "5m"}}}, "ephemeral"),
    ({"nvext": "fast"}, "nvext must be an object"),
    ({"priority": 1.5}, "must be an integer"),
    ({"retention_directives": [{"start": 0, "priority": 150}]}, "in [0, 100]"),
    ({"retention_directives": [{"start": 0, "duration": -1}]}, "in [0, inf]"),
    ({"retention_directives": {"start": 0}}, "must be a list"),
    ({"agent_hint": {"cache_control": {"ttl": 99999}}}, "in [0, 3600]"),
])
def test_a_bad_hint_is_dropped_with_one_line_and_the_rest_kept(body: dict[str, Any],
                                                               says: str) -> None:
    # beside a good hint of another dialect, which stays
    sent = body if "nvext" in body else {**body, "nvext": {"agent_hints": {"priority": 50}}}
    hints, warnings, consumed = _hints(sent)
    assert len(warnings) == 1 and says in warnings[0], warnings
    assert "\n" not in warnings[0]
    assert consumed  # the field never reaches vLLM, which does not read it as a hint
    if "nvext" not in body:
        assert hints is not None and hints.importance == 0.5


def test_hints_on_the_wire_are_checked_again() -> None:
    good = Hints(0.5, 60.0, (Retention(0, 32, 1.0, 5.0),), "s", ("dynamo",))
    assert from_wire({HINTS_KEY: good.to_wire()}) == (good, None)
    assert from_wire({}) == (None, None)
    hints, why = from_wire({HINTS_KEY: {"importance": 7}})
    assert hints is None and why is not None and "importance" in why
    hints, why = from_wire({HINTS_KEY: {"keep_s": 1e9}})
    assert hints is None and why is not None


# ---------------------------------------------------------------------- middleware
def test_the_middleware_moves_hints_into_kv_transfer_params() -> None:
    body = {"model": "m", "messages": [], "priority": 70,
            "nvext": {"cache_control": {"type": "ephemeral", "ttl": "5m"}},
            "kv_transfer_params": {"contextkit": {"spans": []}}}
    new, warnings = rewrite_body(json.dumps(body).encode(), {"x-session-id": "a1"},
                                 priority_scheduling=False)
    doc = json.loads(new)
    assert warnings == [] and "nvext" not in doc and "priority" not in doc
    assert doc["kv_transfer_params"]["contextkit"] == {"spans": []}  # labels kept
    assert doc["kv_transfer_params"][HINTS_KEY]["keep_s"] == 300.0
    assert doc["kv_transfer_params"][HINTS_KEY]["session"] == "a1"
    plain = json.dumps({"model": "m", "messages": []}).encode()
    assert rewrite_body(plain, {}, priority_scheduling=False)[0] is plain
    assert rewrite_body(b"not json", {}, priority_scheduling=False)[0] == b"not json"


def test_the_asgi_middleware_rewrites_the_body_and_its_length() -> None:
    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        seen["body"] = message["body"]
        seen["headers"] = dict(scope["headers"])

    body = json.dumps({"model": "m", "nvext": {"agent_hints": {"priority": 90}}}).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"content-length", str(len(body)).encode()),
                         (b"x-dynamo-session-id", b"s9")]}
    parts = [{"type": "http.request", "body": body[:10], "more_body": True},
             {"type": "http.request", "body": body[10:], "more_body": False}]

    async def receive() -> dict[str, Any]:
        return parts.pop(0)

    async def send(message: Any) -> None:
        return None

    asyncio.run(AgentHintsMiddleware(app)(scope, receive, send))
    doc = json.loads(seen["body"])
    assert doc["kv_transfer_params"][HINTS_KEY]["importance"] == 0.9
    assert doc["kv_transfer_params"][HINTS_KEY]["session"] == "s9"
    assert seen["headers"][b"content-length"] == str(len(seen["body"])).encode()


def test_priority_scheduling_is_read_from_the_servers_arguments() -> None:
    assert schedules_by_priority(["vllm", "--scheduling-policy", "priority"])
    assert schedules_by_priority(["vllm", "--scheduling-policy=priority"])
    assert not schedules_by_priority(["vllm", "--scheduling-policy", "fcfs"])
    assert not schedules_by_priority(["vllm"])


# ---------------------------------------------------------------------- labels
def test_hints_raise_importance_and_pin_for_their_time_only() -> None:
    labels = [BlockLabel("axioms", 0.9, pinned=True), BlockLabel("user_turn", 0.3),
              BlockLabel("user_turn", 0.3)]
    hints = Hints(0.5, None, (Retention(32, None, None, 60.0),))
    out = hinted_labels(labels, hints, 0, 32)
    assert out[0] == labels[0]  # pinned for good, already more important
    assert (out[1].importance, out[1].pinned, out[1].keep_s) == (0.5, True, 60.0)
    assert (out[2].importance, out[2].pinned, out[2].keep_s) == (0.5, True, 60.0)


def test_the_planner_labels_a_hinted_requests_saves() -> None:
    tokens = list(range(100, 112))
    planner = RequestPlanner(b"m" * 8, 4)
    params = {HINTS_KEY: Hints(None, 45.0).to_wire()}
    planner.matched_tokens("r", tokens, len(tokens), 0, params=params)
    _, saves = planner.plan([StepRequest("r", tokens, 0, len(tokens), [1, 2, 3])])
    assert [(label.pinned, label.keep_s) for s in saves for label in s.labels] == [
        (True, 45.0)] * 3
    bad = {HINTS_KEY: {"keep_s": "forever"}}
    planner.matched_tokens("q", tokens, len(tokens), 0, params=bad)
    _, saves = planner.plan([StepRequest("q", tokens, 0, len(tokens), [4, 5, 6])])
    assert all(not label.pinned for s in saves for label in s.labels)
    assert (planner.stats.take() or {})["counters"]["hints_ignored"] == 1


# ---------------------------------------------------------------------- the store
BS, LAYERS, HEADS, DIM = 16, 2, 2, 64


def _store(model: Path, tmp: Path) -> ConnectorStore:
    ident = vllm_cache_identity(str(model), BS)
    return ConnectorStore(ident, ConnectorConfig(
        block_size=BS, shadow_url="", host_blocks=64, device_blocks=16, pin_share=0.25))


def _save(store: ConnectorStore, tenant: str, n: int, keep: float, seed: int = 0) -> Any:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, n, BS, HEADS, DIM)
    keys = hash_token_blocks(store.identity.digest(), tenant,
                             list(range(seed, seed + n * BS)), BS)
    label = BlockLabel("user_turn", 0.3, pinned=True, keep_s=keep)
    return keys, store.save(torch.randn(shape, generator=g), torch.randn(shape, generator=g),
                            keys, tenant, [label] * n)


def _pinned(store: ConnectorStore, tenant: str | None = None) -> int:
    return sum(len(pool.cache.metadata.pinned(tenant)) for pool in store.pools.values())


def test_a_hints_pin_holds_any_layer_until_its_time_runs_out(model: Path,
                                                              tmp_path: Path) -> None:
    store = _store(model, tmp_path)
    keys, result = _save(store, "acme", 3, keep=0.2)
    assert result.unpinned is None and _pinned(store) == 3  # conversation blocks too
    assert store.pinned_until(keys[0]) is not None
    time.sleep(0.25)
    store.expire_pins()
    assert _pinned(store) == 0 and store.pinned_until(keys[0]) is None
    assert set(store.missing(keys)) == set()  # unpinned, not dropped


def test_a_hint_cannot_pin_past_its_tenants_quota_or_touch_anothers_pins(
        model: Path, tmp_path: Path) -> None:
    store = _store(model, tmp_path)  # quota: 0.25 of 16 device blocks = 4 per tenant
    _save(store, "globex", 4, keep=600.0, seed=1)
    assert _pinned(store) == 4
    keys, _ = _save(store, "acme", 6, keep=600.0, seed=2)
    # globex's pins stand; acme pins its own quota's worth, its first blocks first
    assert _pinned(store) == 8
    assert [store.pinned_until(k) is not None for k in keys] == [True] * 4 + [False] * 2
    counters = (store.stats.take() or {})["counters"]
    assert counters["hint_pinned_blocks"] == 8 and counters["hint_pins_refused"] == 2


def test_a_hint_takes_free_pin_room_only_never_another_tenants_idle_pins(
        model: Path, tmp_path: Path) -> None:
    store = _store(model, tmp_path)
    _save(store, "globex", 4, keep=3600.0, seed=1)
    globex = tenant_slug("globex")
    for pool in store.pools.values():  # globex's pins went idle (past the pin TTL)
        for meta in pool.cache.metadata.pinned(globex):
            meta.pinned_at = meta.last_attended = time.time() - 3600.0
    keys, _ = _save(store, "acme", 2, keep=600.0, seed=2)
    assert _pinned(store, globex) == 4  # a rule's pin may demote them; a hint may not
    assert all(store.pinned_until(k) is not None for k in keys)
    counters = (store.stats.take() or {})["counters"]
    assert counters.get("hint_other_pins_lost", 0) == 0 and counters["hint_pinned_blocks"] == 6


# ---------------------------------------------------------------------- pauses
def test_a_sessions_pause_is_learned_and_its_blocks_kept_then_released() -> None:
    from integrations.vllm.pauses import KeepSpec, SessionPauses

    pauses = SessionPauses(margin=1.5)
    keys = [b"k1", b"k2"]
    assert pauses.arrived("acme", "s1", now=0.0) is None  # first request: nothing yet
    assert pauses.finished("acme", "s1", keys, now=1.0) is None  # no pause learned yet
    assert pauses.arrived("acme", "s1", now=11.0) is None  # a 10 s pause, learned
    keep = pauses.finished("acme", "s1", keys, now=12.0)
    assert keep == KeepSpec("acme", keys, 15.0, "s1")  # 1.5 x the longest recent pause
    assert pauses.due(now=19.0) == []  # the look-ahead: at 0.75 of its shortest pause
    assert pauses.due(now=19.5) == [KeepSpec("acme", keys, 0.0, "s1", warm=True)]
    assert pauses.due(now=20.0) == []  # once per pause
    assert pauses.arrived("acme", "s1", now=21.0) == KeepSpec("acme", keys, 0.0, "s1")
    pauses.finished("acme", "s1", keys, now=22.0)
    assert pauses.arrived("acme", "s1", now=23.0) is not None  # back early: no warm due
    assert pauses.due(now=100.0) == []
    # sessions are per tenant: another tenant's session of the same name is its own
    assert pauses.expected("globex", "s1") is None
    assert pauses.expected("acme", "s1") == 15.0  # 1.5 x 10 s, its longest recent pause


def _tier(store: ConnectorStore, key: bytes) -> Tier:
    entry = store.entry(key)
    assert entry is not None
    return entry[0].cache.metadata.get(entry[1]).tier


def test_kept_blocks_stay_pinned_through_the_pause_within_the_quota(
        model: Path, tmp_path: Path) -> None:
    store = _store(model, tmp_path)  # quota: 4 blocks per tenant
    g = torch.Generator().manual_seed(3)
    shape = (LAYERS, 6, BS, HEADS, DIM)
    keys = hash_token_blocks(store.identity.digest(), "acme", list(range(6 * BS)), BS)
    store.save(torch.randn(shape, generator=g), torch.randn(shape, generator=g), keys,
               "acme", [BlockLabel("user_turn", 0.3)] * 6)
    assert _pinned(store) == 0
    assert store.keep(keys, "acme", 60.0) == 4  # the chain's first 4: the quota
    assert _pinned(store) == 4
    # device first: the 2 the quota left unpinned are moved to the device tier too
    assert [_tier(store, k) for k in keys] == [Tier.DEVICE] * 6
    rest = [e for e in map(store.entry, keys[4:]) if e is not None]
    assert len(rest) == 2
    rest[0][0].cache.spill_blocks([bid for _, bid in rest])  # others' traffic
    assert store.warm(keys, "globex") == 0  # another tenant's look-ahead moves nothing
    assert store.warm(keys, "acme") == 2  # the look-ahead brings them back
    assert [_tier(store, k) for k in keys] == [Tier.DEVICE] * 6
    assert store.keep(keys, "acme", 0.0) == 4  # the session came back: released
    assert _pinned(store) == 0 and not store.missing(keys)
    assert store.keep([b"not-held", *keys], "acme", 60.0) == 0  # a chain starts held
