"""The chunk-reuse oracle of ``bench agents-vllm``: a LangChain agent's model call,
labelled by ContextKitMiddleware, answered with the tenant's known spans first and the
new ones after (no vLLM: the server is a class with the harness's ``post``)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("langchain_openai")

from langchain.agents import create_agent

from contextkit import CacheAwareContextPipeline
from contextkit.pipeline.served.model import ServedModel
from contextkit.workloads.agents import MultiAgentWorkload
from integrations.langchain import ContextKitMiddleware
from integrations.vllm.bench.agent_bench import SERVED, chat_model
from integrations.vllm.bench.oracle import BLOCK, KnownSpans, oracle_middleware


class RecordingServer:
    """The bench harness's ``OpenAIServer.post``: records each body, answers one token
    with the usage a prefix cache holding every warmed prompt would report."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.warmed: dict[str, list[list[int]]] = {}

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        assert path == "/v1/completions"
        self.bodies.append(body)
        prompt, salt = list(body["prompt"]), body["cache_salt"]
        cached = max((_common(prompt, w) for w in self.warmed.get(salt, [])), default=0)
        self.warmed.setdefault(salt, []).append(prompt)
        return {"choices": [{"text": " ok"}],
                "usage": {"prompt_tokens": len(prompt),
                          "prompt_tokens_details": {"cached_tokens": cached // BLOCK * BLOCK}}}


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_changed_span_keeps_the_blocks_an_earlier_prompt_began_with() -> None:
    known = KnownSpans()
    axioms, memories = list(range(1000, 1000 + BLOCK)), list(range(2000, 2072))
    spans = [(0, 32, "axioms"), (32, 104, "memories"), (104, 106, "user_turn")]
    first = axioms + memories + [5, 6]
    known.add("acme", first, spans)
    # the memories change 40 tokens in: the prompts share 72 tokens, two whole blocks
    second = axioms + memories[:40] + [8] * 32 + [5, 6]
    assert known.prefix("acme", second) == 2 * BLOCK
    held, new = known.split("acme", second, spans)
    assert held == [*second[:2 * BLOCK], 5, 6]  # the question was sent before
    assert new == second[2 * BLOCK:104]  # the changed span past the prefix
    # another tenant holds none of it
    assert known.split("other", second, spans) == ([], second)


@pytest.fixture(scope="module")
def served() -> ServedModel:
    return ServedModel.packaged(name=SERVED)


def test_the_oracle_computes_only_what_the_tenant_never_sent(served: ServedModel) -> None:
    workload = MultiAgentWorkload(2, num_tenants=2, steps=8, seed=0, scale=0.1)
    srv, known = RecordingServer(), KnownSpans()
    agents: dict[str, Any] = {}
    boxes: dict[str, dict[str, int]] = {}
    for spec in workload.agents:
        pipeline = CacheAwareContextPipeline(served=served, tenant=spec.tenant,
                                             agent=spec.name)
        box = boxes[spec.name] = {"turn": 0}
        middleware = ContextKitMiddleware(
            pipeline, lambda request, box=box: workload.system_prompt(box["turn"]))
        oracle = oracle_middleware(served, srv, known, SERVED)
        model = chat_model("http://127.0.0.1:9/v1", 4)  # never called: the oracle answers
        agents[spec.name] = (create_agent(model, tools=[], context_schema=dict,
                                          middleware=[middleware, oracle]), oracle, [])
    seen: set[str] = set()
    for i, step in enumerate(workload.steps()):
        agent, oracle, history = agents[step.agent]
        boxes[step.agent]["turn"] = i
        before = len(srv.bodies)
        state = agent.invoke({"messages": [*history, ("user", step.user_message)]},
                             context={"tenant": step.tenant})
        history[:] = state["messages"]
        # what the server tokenizes for this call, rendered apart from the agent
        ref = CacheAwareContextPipeline(served=served, tenant=step.tenant, agent=step.agent)
        ref.build(workload.system_prompt(i))
        conversation = [{"role": "user" if m.type == "human" else "assistant",
                         "content": m.content} for m in history[:-1]]
        ids = list(served.render(ref.openai_messages(conversation)).token_ids)
        timed = srv.bodies[-1]["prompt"]
        call = oracle.last
        assert call is not None and call.prompt_tokens == len(ids)
        assert sorted(timed) == sorted(ids)  # the same tokens, the known spans first
        if step.tenant not in seen:
            # a tenant's first call holds nothing but the template's opening tokens
            assert call.held_tokens < 8 and timed == ids
        elif step.agent_turn >= 1:
            # the agent's stable layers were sent before: held, warmed, then reused
            assert call.held_tokens > len(ids) // 2
            warm = srv.bodies[before]["prompt"]
            assert len(srv.bodies) == before + 2 and len(warm) % BLOCK == 0
            assert timed[:len(warm)] == warm and call.cached_tokens == len(warm)
        assert {b["cache_salt"] for b in srv.bodies[before:]} == {
            ref.request_fields(ref.openai_messages(conversation))["cache_salt"]}
        seen.add(step.tenant)
    assert len(seen) == 2
