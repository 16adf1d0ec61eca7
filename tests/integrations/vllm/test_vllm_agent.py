"""An agent on vLLM's OpenAI server: what contextkit's connector stored, block by block.

One lifetime of vLLM's OpenAI server (vLLM's CPU build, the packaged SmolLM2,
``ContextKitConnector`` via ``--kv-transfer-config``) on 127.0.0.1 serves every test of
this module:

1. a plain ``openai`` client request with hand-made ``kv_transfer_params`` spans: the
   connector stores its blocks under exactly the labels sent; a request whose
   fingerprint is not its prompt's gets the default labels;
2. a LangChain ``create_agent`` agent (``ChatOpenAI(base_url=...)`` +
   ``ContextKitMiddleware`` over a pipeline attached to the served model) for two
   tenants, five and four turns in which the time and a state line change. Checked on
   the connector's store (its shadow manifest, :func:`integrations.vllm.store.
   shadow_manifest`, read after every call) against the requests the middleware sent
   (recorded on the wire): every stored block carries the layer that owns its first
   token, stable pinnable layers are pinned, the second tenant's identical prompt
   gets no external hit (acme's own replay is served from the store), and when the
   store is too small for both agents blocks leave by layer priority (volatile
   layers, then user turns, then memories) while the pinned stable layers never do.

On CPU the connector saves into its DDR tier (``host_blocks``; the device tier holds
the pinned prefixes), so that is the tier sized too small for two agents here.
Run by ``make test-vllm`` inside ``.venv-vllm``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

BLOCK = 32
SERVED = "contextkit-agent"
MAX_TOKENS = 16
#: Store sizes. Device tier: pins only on CPU; each agent's stable prefix (12 blocks)
#: is within a tenant's quota (a quarter of it). DDR tier (a byte budget, in tq4
#: blocks, shared by the format pools): room for a first turn's save (24 blocks, the
#: stable ones before they move to the device tier; 29-30 tq4 blocks of bytes under
#: the default precision policy: an fp16 sink, k5v4, the latest blocks int8, within
#: 0.35 of fp16) and little more; the two agents'
#: unpinned blocks are ~75, so the volatile layers' blocks, then the user turns' are
#: evicted (gpu_cache's layer priorities), and once it is full the requests' volatile
#: tails are no longer stored (``store_volatile`` = ``room``).
DEVICE_BLOCKS = 64
HOST_BLOCKS = 31
ROOT = Path(__file__).resolve().parents[3]

QUESTIONS = [
    "We just got paged: checkout-api p95 is up. Where do I start?",
    "Is it the database again? Check payments-db connections.",
    "Most of the time is spent calling pricing-service. Did it change?",
    "Show me today's checkout-api deploys.",
    "Should we roll back checkout-api now?",
]


def agent_prompt(turn: int) -> str:
    """The agent's ten-layer system prompt, ~900 tokens: every layer spans a few blocks;
    the state and the time change every turn, the rest is fixed."""
    state = "\n".join(
        f"{svc} p95 {base + step * turn} ms, 5xx {0.1 * turn * (k + 1):.1f}%, "
        f"pods {3 + (turn + k) % 3}/5 ready"
        for k, (svc, base, step) in enumerate([("checkout-api", 180, 9), ("payments-db", 12, 1),
                                               ("pricing-service", 38, 4)]))
    return (
        "[AXIOMS]\nNever invent facts, metrics or log lines; say when you are unsure.\n"
        "Never run a destructive action without a human's explicit approval.\n"
        "Prefer reversible changes; state the rollback before any change.\n"
        "Quote numbers with their source and the time they were read.\n[/AXIOMS]\n"
        "[IDENTITY]\nYou are Atlas, the site reliability assistant of a small online "
        "retailer. You work with the on-call engineer during incidents: you read "
        "dashboards, traces and deploy logs, you propose next steps, and you keep a "
        "short timeline of what was found. You answer in a few short sentences.\n"
        "[/IDENTITY]\n"
        "[SYSTEM_KNOWLEDGE]\nCheckout runs on Kubernetes in two regions; deploys go "
        "through Argo CD with a canary step of ten minutes.\nDashboards live in "
        "Grafana; alerts page the on-call engineer through PagerDuty.\npayments-db is "
        "PostgreSQL 15 behind PgBouncer (pool size 200).\npricing-service caches price "
        "lists in Redis for five minutes.\n[/SYSTEM_KNOWLEDGE]\n"
        "[CAPABILITIES]\nmetrics_query(service, window): p95 latency, 5xx rate, "
        "saturation.\ntraces(service, window, limit): the slowest traces with their "
        "spans.\ndeploys(service, since): deploy history with revisions and authors.\n"
        "rollback(service, revision): propose a rollback for a human to approve.\n"
        "runbook(name): the team's runbook for an alert.\n[/CAPABILITIES]\n"
        f"[SYSTEM_STATE]\n{state}\n[/SYSTEM_STATE]\n"
        f"[CURRENT_TIME]\n2025-03-11 17:{2 + 3 * turn:02d} CET\n[/CURRENT_TIME]\n"
        "[NEURONS]\nLatency incidents usually follow deploys by minutes.\nConnection "
        "pool exhaustion shows as p95 jumps with flat CPU.\nA slow dependency shows as "
        "long client spans and short server spans.\n[/NEURONS]\n"
        "[MEMORIES]\n2025-03-04: pricing-service v3.2 doubled its Redis TTL misses; "
        "rolled back in 4 minutes.\n2025-02-26: payments-db hit max connections after a "
        "PgBouncer restart; fixed by raising the pool.\n2025-02-19: a checkout-api "
        "canary with a new HTTP client leaked sockets; caught at the canary step.\n"
        "2025-02-11: the on-call engineer asked for shorter answers during incidents.\n"
        "[/MEMORIES]\n"
        "[AFFECT]\nCalm, focused, brief.\n[/AFFECT]\n"
        "[AWARENESS]\nThe on-call engineer is new to the team; explain acronyms once.\n"
        "[/AWARENESS]"
    )


# ---------------------------------------------------------------------- the server
@dataclass
class Connector:
    """The connector as the test process sees it: its config, the per-request stats
    it appends to ``stats_path`` and the manifest of its shadow."""

    config: Any
    stats_path: Path
    offset: int = 0
    seen: list[dict[str, Any]] = field(default_factory=list)

    def records(self, n: int, timeout: float = 60.0) -> list[dict[str, Any]]:
        """The next ``n`` per-request records (written as requests finish)."""
        from integrations.vllm.bench.harness import read_stats

        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while len(got) < n:
            new, self.offset = read_stats(self.stats_path, self.offset)
            got += new
            if len(got) < n:
                assert time.monotonic() < deadline, f"{len(got)} of {n} request records"
                time.sleep(0.2)
        self.seen += got
        return got

    def skip(self) -> None:
        """Skip the records written so far (other tests' requests, pumps)."""
        if self.stats_path.is_file():
            self.offset = self.stats_path.stat().st_size

    def snapshot(self, expect: set[bytes] | frozenset[bytes] = frozenset(), after: int = 0,
                 quiet: float = 2.0, timeout: float = 90.0) -> tuple[int, dict[bytes, Any]]:
        """The stored blocks by key once the store has settled: a shadow newer than
        generation ``after`` (written after every save) that holds ``expect`` and has
        not changed for ``quiet`` seconds. Returns its generation and blocks."""
        from integrations.vllm.store import shadow_manifest

        deadline = time.monotonic() + timeout
        last: Any = None
        since = time.monotonic()
        while True:
            manifest = shadow_manifest(self.config)
            generation = 0 if manifest is None else manifest.generation
            if generation != last:
                last, since = generation, time.monotonic()
            held = {} if manifest is None else {bytes.fromhex(r.key): r
                                                for r in manifest.blocks if r.key}
            if (generation > after and expect <= held.keys()
                    and time.monotonic() - since >= quiet):
                return generation, held
            assert time.monotonic() < deadline, (
                f"the store did not settle (generation {generation}, after {after}; "
                f"{len(expect - held.keys())} expected blocks missing)")
            time.sleep(0.25)

    def blocks(self, expect: set[bytes] | frozenset[bytes] = frozenset()) -> dict[bytes, Any]:
        return self.snapshot(expect)[1]


@pytest.fixture(scope="module")
def model_dir() -> str:
    from integrations.vllm.model import packaged_model_dir

    return str(packaged_model_dir())


@pytest.fixture(scope="module")
def identity_digest(model_dir: str) -> bytes:
    from integrations.vllm.identity import vllm_cache_identity

    return vllm_cache_identity(model_dir, BLOCK, "tq4").digest()


@pytest.fixture(scope="module")
def server(model_dir: str, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Any, Connector]]:
    from integrations.vllm.bench.harness import OpenAIServer
    from integrations.vllm.config import ConnectorConfig

    work = tmp_path_factory.mktemp("agent")
    config = ConnectorConfig(
        block_size=BLOCK, shadow_url=f"file://{work / 'shadow'}",
        local_store=f"file://{work / 'local'}", stats_path=str(work / "stats.jsonl"),
        device_blocks=DEVICE_BLOCKS, host_blocks=HOST_BLOCKS)
    env = {"HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))}
    srv = OpenAIServer(model_dir, config, work / "server.log", served_name=SERVED,
                       block_size=BLOCK, extra_args=["--enable-prompt-tokens-details"], env=env)
    with srv:
        print(f"\nvLLM OpenAI server up in {srv.startup_s:.0f} s ({srv.url}); log {srv.log_path}")
        yield srv, Connector(config, work / "stats.jsonl")


def _keys(identity_digest: bytes, tenant: str, token_ids: list[int]) -> list[bytes]:
    from gpu_cache import hash_token_blocks

    return list(hash_token_blocks(identity_digest, tenant, token_ids, BLOCK))


def _metric(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


# ---------------------------------------------------------------------- 1. hand-made spans
def test_handmade_spans_reach_the_connector_through_the_openai_server(
        server: tuple[Any, Connector], identity_digest: bytes) -> None:
    import openai

    from contextkit.pipeline.served.model import ServedModel
    from integrations.vllm.planning import semantic_params

    srv, connector = server
    served = ServedModel.packaged(name=SERVED)
    client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
    messages: Any = [{"role": "system", "content": agent_prompt(0)[:900]},
                     {"role": "user", "content": QUESTIONS[0]}]
    ids = served.render(messages).token_ids
    assert len(ids) > 6 * BLOCK
    spans = [(0, 40, "axioms", 1.0, True), (40, 100, "memories", 0.4, False),
             (100, len(ids), "user_turn", 0.3, False)]
    expect_layers = ["axioms", "axioms", "memories", "memories"]  # by block's first token

    def send(salt: str, params: dict[str, Any]) -> Any:
        return client.chat.completions.create(
            model=SERVED, messages=messages, max_tokens=4, temperature=0.0,
            extra_body={"kv_transfer_params": params, "cache_salt": salt,
                        "return_token_ids": True})

    reply = send("probe", semantic_params(spans, prompt_token_ids=ids))
    extra = reply.model_extra or {}
    assert extra["prompt_token_ids"] == ids  # the recipe is the server's tokenization
    (record,) = connector.records(1)
    assert record["tenant"] == "probe" and record["prompt_tokens"] == len(ids)
    assert record["external_hit_tokens"] == 0
    full = (len(ids) - 1) // BLOCK  # prompt blocks computed whole
    keys = _keys(identity_digest, "probe", ids)[:full]
    held = connector.blocks(set(keys))
    got = [(held[k].source_layer, held[k].importance, held[k].pinned, held[k].tenant)
           for k in keys]
    want = [(layer, {"axioms": 1.0, "memories": 0.4}[layer], layer == "axioms", "probe")
            for layer in expect_layers]
    want += [("user_turn", 0.3, False, "probe")] * (full - len(expect_layers))
    assert got == want

    # labels computed for another prompt: not used (default layer, no pin), counted
    wrong = semantic_params(spans, prompt_token_ids=[*ids, 0])
    send("probe-mismatch", wrong)
    connector.records(1)
    keys = _keys(identity_digest, "probe-mismatch", ids)[:full]
    held = connector.blocks(set(keys))
    assert {(held[k].source_layer, held[k].pinned) for k in keys} == {("user_turn", False)}
    metrics = srv.get("/metrics")
    deadline = time.monotonic() + 60
    while _metric(metrics, "vllm:contextkit_label_mismatches_total") < 1:
        assert time.monotonic() < deadline, "label mismatch never reached /metrics"
        client.completions.create(model=SERVED, prompt=[0], max_tokens=1)  # one engine step
        metrics = srv.get("/metrics")
    assert _metric(metrics, "vllm:contextkit_label_mismatches_total") == 1


# ---------------------------------------------------------------------- 2. the agent
class Wire(httpx.BaseTransport):
    """An httpx transport that records each chat request's body and the server's reply
    (what the middleware sent, exactly, and what vLLM answered)."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.calls: list[tuple[dict[str, Any], dict[str, Any]]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        if request.url.path.endswith("/chat/completions"):
            response.read()
            self.calls.append((json.loads(request.content), json.loads(response.content)))
        return response

    def close(self) -> None:
        self.inner.close()


def owners(text: str, messages: list[dict[str, Any]], config: Any) -> list[tuple[int, str]]:
    """The labelled texts of a rendered prompt, in order, as ``(end char, source layer)``.

    Found in the text the server tokenized, independently of the pipeline: each
    ``[LAYER]...[/LAYER]`` section (with its newline) owns the chat markup before it
    (the contract's tiling rule); so does the content of each message that holds no
    section (``user_turn``). A token belongs to the first labelled text ending after
    its first character; past the last one, to no span (the connector's default).
    """
    import re

    out: list[tuple[int, int, str]] = []
    at = 0
    for message in messages:
        content = message.get("content") or ""
        if not content:
            continue
        start = text.index(content, at)
        sections = list(re.finditer(r"\[([A-Z_]+)\]\n.*?\n\[/\1\]\n?", content, flags=re.S))
        if sections:
            for m in sections:
                out.append((start + m.start(), start + m.end(),
                            config.get(m.group(1).lower()).source))
        else:
            out.append((start, start + len(content), "user_turn"))
        at = start + len(content)
    return [(end, layer) for _, end, layer in out]


def owner_of(labelled: list[tuple[int, str]], char: int, default: str = "user_turn") -> str:
    return next((layer for end, layer in labelled if char < end), default)


@dataclass
class Call:
    tenant: str
    turn: int
    body: dict[str, Any]
    reply: dict[str, Any]
    record: dict[str, Any]
    generation: int
    held: dict[bytes, Any]

    @property
    def prompt_ids(self) -> list[int]:
        return list(self.reply["prompt_token_ids"])

    @property
    def cached(self) -> int:
        return int(self.reply["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_langchain_agent_drives_the_connector_by_layer(
        server: tuple[Any, Connector], identity_digest: bytes) -> None:
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage
    from langchain_openai import ChatOpenAI
    from pydantic import SecretStr

    from contextkit import CacheAwareContextPipeline
    from contextkit.pipeline.served.model import ServedModel
    from gpu_cache import DEFAULT_SOURCE_PRIORITY, PINNABLE_SOURCES
    from integrations.langchain import ContextKitMiddleware

    srv, connector = server
    connector.skip()
    served = ServedModel.packaged(name=SERVED)
    pipeline = CacheAwareContextPipeline(served=served)
    wire = Wire()
    model = ChatOpenAI(model=SERVED, base_url=srv.base_url, api_key=SecretStr("x"),
                       use_responses_api=False, temperature=0, max_completion_tokens=MAX_TOKENS,
                       max_retries=0, extra_body={"return_token_ids": True},
                       http_client=httpx.Client(transport=wire, timeout=600))
    box = {"turn": 0}
    agent: Any = create_agent(model, tools=[], context_schema=dict, middleware=[
        ContextKitMiddleware(pipeline, lambda request: agent_prompt(box["turn"]))])
    calls: list[Call] = []
    generation = shadow_manifest_generation(connector)
    timings: list[float] = []

    def run(tenant: str, turns: int) -> None:
        nonlocal generation
        history: list[Any] = []
        for turn in range(turns):
            box["turn"] = turn
            t0 = time.perf_counter()
            out = agent.invoke({"messages": [*history, ("user", QUESTIONS[turn])]},
                               context={"tenant": tenant})
            timings.append(time.perf_counter() - t0)
            history = out["messages"]
            assert isinstance(history[-1], AIMessage)
            body, reply = wire.calls[-1]
            (record,) = connector.records(1)
            # a request that saved blocks shadows them: wait for a newer manifest
            saved = record["planned_save_blocks"] > 0
            generation, held = connector.snapshot(after=generation if saved else 0)
            calls.append(Call(tenant, turn, body, reply, record, generation, held))
            report = pipeline.last_report(tenant)  # the server's usage, recorded
            assert report is not None
            assert report.prompt_tokens == reply["usage"]["prompt_tokens"]
            assert report.reused_tokens == calls[-1].cached

    run("acme", 5)

    # vLLM's own prefix cache emptied: acme's first prompt again is served by the
    # connector from its store; globex's identical prompt gets nothing of it
    assert srv.post("/reset_prefix_cache", {})["success"] is True
    first = calls[0]
    again = srv.post("/v1/chat/completions", first.body)
    (record,) = connector.records(1)
    assert again["prompt_token_ids"] == first.prompt_ids
    pinned_prefix = sum(1 for r in first.held.values() if r.tenant == "acme" and r.pinned)
    assert pinned_prefix >= 10
    assert record["tenant"] == "acme"
    assert record["external_hit_tokens"] >= pinned_prefix * BLOCK, record
    assert record["external_hit_tokens"] == record["planned_hit_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        record["external_hit_tokens"]
    generation = connector.snapshot(after=0)[0]

    run("globex", 4)
    dump = Path(connector.stats_path).with_name("calls.json")  # for a failure's post-mortem
    dump.write_text(json.dumps([{
        "tenant": c.tenant, "turn": c.turn, "body": c.body, "reply": c.reply,
        "record": c.record, "generation": c.generation,
        "held": {k.hex(): [r.tenant, r.source_layer, r.importance, r.pinned]
                 for k, r in c.held.items()}} for c in calls]))
    print(f"\nrequests, replies and store snapshots: {dump}")
    globex = calls[5]
    assert globex.body["messages"] == first.body["messages"]  # the identical prompt
    assert globex.prompt_ids == first.prompt_ids
    assert globex.body["cache_salt"] == "globex" and first.body["cache_salt"] == "acme"
    assert globex.record["external_hit_tokens"] == 0 and globex.cached == 0
    assert globex.record["planned_hit_tokens"] == 0

    # ---- what was sent: layout, exact ids, the time and a state line changing
    layers = pipeline.config
    reused = 0
    for call in calls:
        messages = call.body["messages"]
        roles = [m["role"] for m in messages]
        assert roles[0] == "system" and roles[-1] == "user" and roles[-2] == "system", roles
        assert roles.count("system") == 2 and len(roles) == 3 + 2 * call.turn
        trailing = messages[-2]["content"]
        assert "[CURRENT_TIME]" in trailing and "[SYSTEM_STATE]" in trailing
        assert "[AXIOMS]" in messages[0]["content"]
        assert call.body["cache_salt"] == call.tenant
        rendered = served.render(messages)
        assert rendered.token_ids == call.prompt_ids  # the server's own tokenization
        ours = call.body["kv_transfer_params"]["contextkit"]
        assert ours["prompt_tokens"] == len(call.prompt_ids)
        assert call.record["prompt_tokens"] == len(call.prompt_ids)
        if call.turn:
            before = calls[calls.index(call) - 1].body["messages"][-2]["content"]
            time_now = trailing.split("[CURRENT_TIME]")[1]
            assert time_now != before.split("[CURRENT_TIME]")[1]
            assert trailing.split("[SYSTEM_STATE]")[1].split("[/SYSTEM_STATE]")[0] != \
                before.split("[SYSTEM_STATE]")[1].split("[/SYSTEM_STATE]")[0]
            # the server's prefix cache reuses the system prompt and the history (the
            # main message changes only while the pipeline learns the volatility order)
            assert call.cached > 0
            if messages[0] == calls[calls.index(call) - 1].body["messages"][0]:
                main = len(served.render(messages[:1]).token_ids) - 3  # minus gen. prompt
                assert call.cached >= main // BLOCK * BLOCK > 0, (call.cached, main)
                reused += 1
    assert reused >= 5

    # ---- every stored block carries the layer owning its first token
    expected: dict[bytes, tuple[str, str]] = {}  # key -> (tenant, source layer)
    for call in calls:
        rendered = served.render(call.body["messages"])
        labelled = owners(rendered.text, call.body["messages"], layers)
        tokens = call.prompt_ids + list(call.reply["choices"][0]["token_ids"])
        for b, key in enumerate(_keys(identity_digest, call.tenant, tokens)):
            pos = b * BLOCK
            char = rendered.offsets[pos][0] if pos < len(rendered.offsets) else len(rendered.text)
            expected.setdefault(key, (call.tenant, owner_of(labelled, char)))
    seen: dict[bytes, Any] = {}
    for call in calls:
        for key, rec in call.held.items():
            if rec.tenant in ("acme", "globex"):
                seen[key] = rec
    assert seen and seen.keys() <= expected.keys()
    wrong = [(expected[k], r.source_layer, r.pinned) for k, r in seen.items()
             if (r.tenant, r.source_layer) != expected[k]
             or r.pinned != (r.source_layer in PINNABLE_SOURCES)]
    assert not wrong, wrong[:10]
    stored_layers = {r.source_layer for r in seen.values()}
    assert {"axioms", "identity", "rules", "capabilities", "memories", "system_state",
            "current_time", "user_turn"} <= stored_layers, stored_layers
    # pinnable layers: all of both tenants' blocks stored and pinned at the end
    final = calls[-1].held
    for tenant in ("acme", "globex"):
        stable = {k for k, (t, layer) in expected.items()
                  if t == tenant and layer in PINNABLE_SOURCES}
        assert len(stable) >= 10
        assert all(k in final and final[k].pinned for k in stable), tenant

    # ---- the DDR tier is too small for both agents: evictions by layer priority
    left: list[tuple[str, int]] = []  # (layer, interval) of every block that left
    for k in range(1, len(calls)):
        before, after = calls[k - 1].held, calls[k].held
        gone = [before[key] for key in before.keys() - after.keys()]
        stayed = [after[key] for key in before.keys() & after.keys() if not after[key].pinned]
        assert not [r for r in gone if r.pinned], "a pinned block was evicted"
        if gone and stayed:
            # every block that left ranked at most as high as every unpinned one kept
            worst = max(DEFAULT_SOURCE_PRIORITY.get(r.source_layer, 50) for r in gone)
            best = min(DEFAULT_SOURCE_PRIORITY.get(r.source_layer, 50) for r in stayed)
            assert worst <= best, (k, sorted({r.source_layer for r in gone}),
                                   sorted({r.source_layer for r in stayed}))
        left += [(r.source_layer, k) for r in gone]
    gone_layers = {layer for layer, _ in left}
    assert {"user_turn", "system_state"} <= gone_layers, left
    assert not gone_layers & {"axioms", "identity", "rules", "capabilities"}, left
    if "memories" in gone_layers:  # (the skipped tails leave them room: rarely reached)
        first_memory = min(k for layer, k in left if layer == "memories")
        assert min(k for layer, k in left if layer == "user_turn") <= first_memory
    by_layer = {layer: sum(1 for x, _ in left if x == layer) for layer in gone_layers}

    # ---- the volatile tail (from the trailing message on): the request names its first
    # token; its blocks are stored while the DDR tier has room, skipped once it is full
    tails = {"stored": 0, "skipped": 0}
    for call in calls:
        ours = call.body["kv_transfer_params"]["contextkit"]
        rendered = served.render(call.body["messages"])
        trailing_at = rendered.text.index(call.body["messages"][-2]["content"])
        assert ours["volatile_from"] == rendered.first_token_at(trailing_at)
        tokens = call.prompt_ids + list(call.reply["choices"][0]["token_ids"])
        tail_keys = _keys(identity_digest, call.tenant, tokens)[ours["volatile_from"] // BLOCK:]
        held_tail = sum(key in call.held for key in tail_keys)
        if tail_keys and held_tail == len(tail_keys):
            tails["stored"] += 1
        elif tail_keys and held_tail == 0:
            tails["skipped"] += 1
    assert tails["stored"] >= 1 and tails["skipped"] >= 1, tails

    # the same story on the server's /metrics (worker stats arrive with engine steps)
    def evicted(layer: str) -> float:
        return _metric(metrics, "vllm:contextkit_evicted_blocks_total", layer=layer)

    metrics = srv.get("/metrics")
    deadline = time.monotonic() + 60
    while evicted("user_turn") < by_layer["user_turn"]:
        assert time.monotonic() < deadline, "evictions never reached /metrics"
        srv.post("/v1/completions", {"model": SERVED, "prompt": [0], "max_tokens": 1})
        metrics = srv.get("/metrics")
    assert evicted("memories") >= by_layer.get("memories", 0)
    assert _metric(metrics, "vllm:contextkit_skipped_blocks_total") > 0
    assert sum(evicted(layer) for layer in ("axioms", "identity", "rules", "capabilities")) == 0
    assert _metric(metrics, "vllm:contextkit_saved_blocks_total", layer="axioms") >= 6
    assert _metric(metrics, "vllm:contextkit_hit_tokens_total") >= record["external_hit_tokens"]
    print(f"\nagent calls: {[round(t, 1) for t in timings]} s; prompt tokens "
          f"{[len(c.prompt_ids) for c in calls]}; cached {[c.cached for c in calls]}; "
          f"blocks left by layer {by_layer}; volatile tails {tails}; acme replay hit "
          f"{record['external_hit_tokens']} tokens")
    wire.close()


def shadow_manifest_generation(connector: Connector) -> int:
    from integrations.vllm.store import shadow_manifest

    manifest = shadow_manifest(connector.config)
    return 0 if manifest is None else manifest.generation
