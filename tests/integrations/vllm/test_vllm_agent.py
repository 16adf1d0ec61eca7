"""An agent on vLLM's OpenAI server: what contextkit's connector stored, block by block.

One lifetime of ``python -m vllm.entrypoints.openai.api_server`` (vLLM's CPU build,
the packaged SmolLM2, ``ContextKitConnector`` via ``--kv-transfer-config``) on
127.0.0.1 serves every test of this module:

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
   gets no external hit, and when the store is too small for both agents the
   user-turn and memory blocks leave first while pinned blocks never do.

On CPU the connector saves into its DDR tier (``host_blocks``; the device tier holds
the pinned prefixes), so that is the tier sized too small for two agents here.
Run by ``make test-vllm`` inside ``.venv-vllm``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

BLOCK = 32
SERVED = "contextkit-agent"
MAX_TOKENS = 16
#: Store sizes. Device tier: pins only on CPU; each agent's stable prefix (~14 blocks)
#: is within a tenant's quota (a quarter of it). DDR tier: one agent's five turns fit,
#: the two agents' do not.
DEVICE_BLOCKS = 64
HOST_BLOCKS = 56
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
        from integrations.vllm.harness import read_stats

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

    def blocks(self, expect: set[bytes] = frozenset(), quiet: float = 2.0,  # type: ignore[assignment]
               timeout: float = 60.0) -> dict[bytes, Any]:
        """The stored blocks by key once the store has settled: the shadow (written after
        every save) holds ``expect`` and has not changed for ``quiet`` seconds."""
        from integrations.vllm.store import shadow_manifest

        deadline = time.monotonic() + timeout
        last: Any = None
        since = time.monotonic()
        while True:
            manifest = shadow_manifest(self.config)
            generation = None if manifest is None else manifest.generation
            if generation != last:
                last, since = generation, time.monotonic()
            held = {} if manifest is None else {bytes.fromhex(r.key): r
                                                for r in manifest.blocks if r.key}
            if expect <= held.keys() and time.monotonic() - since >= quiet:
                return held
            assert time.monotonic() < deadline, (
                f"the store did not settle: {len(expect - held.keys())} expected blocks "
                "missing")
            time.sleep(0.25)


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
    from integrations.vllm.config import ConnectorConfig
    from integrations.vllm.harness import OpenAIServer

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

    from contextkit.remote import ServedModel
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
