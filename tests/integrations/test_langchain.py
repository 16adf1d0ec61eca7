"""LangChain 1.x: middleware, callback handler and the engine-backed chat model, for real."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, SystemMessage
from langchain_core.tools import tool

from contextkit import CacheAwareContextPipeline
from contextkit.prompt.markup import PromptFormatError
from integrations._call_log import usage_from
from integrations.langchain import (
    METADATA_KEY,
    ContextKitCallbackHandler,
    ContextKitChatModel,
    ContextKitMiddleware,
)

QUESTIONS = ("Is checkout slow?", "What should I check first?", "Should we roll back?")


class SystemRecorder(BaseCallbackHandler):
    """Keeps the system message each chat model call received."""

    def __init__(self) -> None:
        self.systems: list[SystemMessage | None] = []

    def on_chat_model_start(self, serialized: dict[str, Any], messages: list[list[BaseMessage]],
                            **kwargs: Any) -> None:
        self.systems.append(next((m for m in messages[0] if isinstance(m, SystemMessage)), None))


def run_agent(agent: Any, turns: int, turn_box: dict[str, int],
              callbacks: list[Any], context: Any = None) -> list[AIMessage]:
    messages: list[Any] = []
    replies = []
    for i in range(turns):
        turn_box["i"] = i
        out = agent.invoke({"messages": [*messages, ("user", QUESTIONS[i % 3])]},
                           config={"callbacks": callbacks}, context=context)
        messages = out["messages"]
        assert isinstance(messages[-1], AIMessage)
        replies.append(messages[-1])
    return replies


def engine_agent(fresh: Callable[..., Any], layered_prompt: Callable[[int], str],
                 **middleware_kw: Any) -> tuple[Any, CacheAwareContextPipeline, dict[str, int]]:
    eng = fresh(device=96, host=64)
    pipeline = CacheAwareContextPipeline(eng)
    box = {"i": 0}
    middleware = ContextKitMiddleware(pipeline, lambda request: layered_prompt(box["i"]),
                                      **middleware_kw)
    model = ContextKitChatModel(engine=eng, pipeline=pipeline, max_tokens=8)
    return create_agent(model, tools=[], middleware=[middleware]), pipeline, box


def test_agent_on_the_engine_reuses_the_pinned_prefix(
        fresh: Callable[..., Any], layered_prompt: Callable[[int], str]) -> None:
    agent, pipeline, box = engine_agent(fresh, layered_prompt)
    handler, recorder = ContextKitCallbackHandler(), SystemRecorder()
    replies = run_agent(agent, 3, box, [handler, recorder])

    usage = [r.usage_metadata for r in replies]
    assert all(u is not None for u in usage)
    assert usage[0]["input_token_details"]["cache_read"] == 0  # type: ignore[index]
    for u, r in zip(usage[1:], replies[1:], strict=True):
        read = u["input_token_details"]["cache_read"]  # type: ignore[index]
        assert read > 0 and read % 16 == 0
        assert r.response_metadata["reused_tokens"] == read
    report = pipeline.last_report()
    assert report is not None and report.reused_tokens > 0 and report.call == 3
    # Call 3: affect and awareness (flagged volatile, never changed) have learned a
    # change rate below 0.5 and move from the trailing into the main message.
    assert report.prefix_broken_by == "affect"
    assert report.trailing_layers == ["system_state", "current_time"]
    assert pipeline.pinned_blocks()  # the stable prefix is pinned
    assert set(pipeline.blocks_by_layer()) >= {"axioms", "identity", "capabilities"}

    # The model got the middleware's system message: stable block first, with a
    # cache breakpoint, and the pipeline's text.
    system = recorder.systems[-1]
    assert system is not None and isinstance(system.content, list)
    assert system.content[0]["cache_control"] == {"type": "ephemeral"}  # type: ignore[index]
    assert system.content[0]["text"].rstrip().endswith("[/CAPABILITIES]")  # type: ignore[index]
    last = pipeline.last_built()
    assert last is not None and system.text == last.text
    assert system.additional_kwargs[METADATA_KEY]["stable_hash"] == report.stable_hash

    # The callback handler recorded every call with the engine's figures.
    records = handler.records
    assert len(records) == 3 and all(r.done and r.error is None for r in records)
    assert [r.cache_read_tokens for r in records] == \
        [u["input_token_details"]["cache_read"] for u in usage]  # type: ignore[index]
    assert records[1].content_blocks[0]["cache_control"] is True
    assert records[2].layers[:4] == ["axioms", "identity", "system_knowledge", "capabilities"]
    assert all(r.ttft_ms and r.ttft_ms > 0 for r in records)
    summary = handler.summary()
    assert summary["calls"] == 3 and 0 < summary["cache_hit_ratio"] < 1


def test_other_provider_gets_the_same_system_text(fresh: Callable[..., Any],
                                                  layered_prompt: Callable[[int], str]) -> None:
    # The same middleware and pipeline configuration in front of langchain-core's
    # fake chat model: same system text per turn, the pipeline falls through.
    agent, _, box = engine_agent(fresh, layered_prompt)
    on_engine = SystemRecorder()
    run_agent(agent, 3, box, [on_engine])

    eng = fresh(device=96, host=64)
    pipeline = CacheAwareContextPipeline(eng)
    fake = GenericFakeChatModel(messages=iter([AIMessage(content=f"ok {i}") for i in range(3)]))
    box2 = {"i": 0}
    agent2 = create_agent(fake, tools=[], middleware=[
        ContextKitMiddleware(pipeline, lambda request: layered_prompt(box2["i"]))])
    on_fake, handler = SystemRecorder(), ContextKitCallbackHandler()
    replies = run_agent(agent2, 3, box2, [on_fake, handler])

    assert [r.text for r in replies] == ["ok 0", "ok 1", "ok 2"]
    assert [s.text for s in on_fake.systems] == [s.text for s in on_engine.systems]  # type: ignore[union-attr]
    report = pipeline.last_report()
    assert report is not None and report.call == 3
    assert report.reused_tokens == 0 and pipeline.cached_blocks() == []  # nothing generated
    assert len(handler.records) == 3 and all(r.done and r.error is None for r in handler.records)
    assert handler.records[0].input_tokens is None  # the fake reports no usage


def test_without_a_cache_the_text_is_what_the_function_returned(
        layered_prompt: Callable[[int], str]) -> None:
    plain = CacheAwareContextPipeline()
    box = {"i": 0}
    fake = GenericFakeChatModel(messages=iter([AIMessage(content="a"), AIMessage(content="b")]))
    agent = create_agent(fake, tools=[], middleware=[
        ContextKitMiddleware(plain, lambda request: layered_prompt(box["i"]))])
    recorder = SystemRecorder()
    run_agent(agent, 2, box, [recorder])
    for i, system in enumerate(recorder.systems):
        assert system is not None and system.text == layered_prompt(i)
        blocks = system.content
        assert isinstance(blocks, list) and len(blocks) == 2
        assert blocks[0]["cache_control"] == {"type": "ephemeral"}  # type: ignore[index]
        assert blocks[0]["text"].endswith("[/CAPABILITIES]\n")  # type: ignore[index]


def test_plain_system_prompt_is_left_alone(fresh: Callable[..., Any]) -> None:
    eng = fresh(device=64, host=32)
    pipeline = CacheAwareContextPipeline(eng)
    model = ContextKitChatModel(engine=eng, pipeline=pipeline, max_tokens=4)
    agent = create_agent(model, tools=[], system_prompt="You are terse.",
                         middleware=[ContextKitMiddleware(pipeline)])
    recorder = SystemRecorder()
    first = agent.invoke({"messages": [("user", "Name a color.")]},
                         config={"callbacks": [recorder]})["messages"][-1]
    again = agent.invoke({"messages": [("user", "Name a color.")]},
                         config={"callbacks": [recorder]})["messages"][-1]
    assert [s.content for s in recorder.systems] == ["You are terse.", "You are terse."]  # type: ignore[union-attr]
    assert pipeline.last_report() is None  # the pipeline never built anything
    assert first.text == again.text
    assert first.usage_metadata["input_token_details"]["cache_read"] == 0  # type: ignore[index]
    assert again.usage_metadata["input_token_details"]["cache_read"] > 0  # type: ignore[index]


def test_tenant_comes_from_the_runtime_context(fresh: Callable[..., Any],
                                               layered_prompt: Callable[[int], str]) -> None:
    eng = fresh(device=128, host=64)
    pipeline = CacheAwareContextPipeline(eng)
    box = {"i": 0}
    agent = create_agent(ContextKitChatModel(engine=eng, pipeline=pipeline, max_tokens=4),
                         tools=[], context_schema=dict,
                         middleware=[ContextKitMiddleware(pipeline,
                                                          lambda request: layered_prompt(0))])
    acme = run_agent(agent, 2, box, [], context={"tenant": "acme"})
    globex = run_agent(agent, 1, box, [], context={"tenant": "globex"})
    assert acme[1].usage_metadata["input_token_details"]["cache_read"] > 0  # type: ignore[index]
    # Same prompt, other tenant: nothing of acme's is visible.
    assert globex[0].usage_metadata["input_token_details"]["cache_read"] == 0  # type: ignore[index]
    assert {m.tenant_slug for m in eng.cache.metadata.all()} == {"acme", "globex"}
    assert pipeline.last_report("acme").call == 2  # type: ignore[union-attr]
    assert pipeline.last_report("globex").call == 1  # type: ignore[union-attr]


def test_streaming_matches_invoke_and_reports_usage(fresh: Callable[..., Any]) -> None:
    eng = fresh(device=64, host=32)
    model = ContextKitChatModel(engine=eng, max_tokens=12)
    model.invoke("Write a haiku about caches.")  # from here on, both reuse the same blocks
    whole = model.invoke("Write a haiku about caches.")
    chunks = list(model.stream("Write a haiku about caches."))
    assert len(chunks) > 3
    assert "".join(str(c.content) for c in chunks) == whole.text
    last = chunks[-1]
    assert last.usage_metadata is not None and last.usage_metadata["output_tokens"] == 12
    assert last.usage_metadata["input_token_details"]["cache_read"] > 0  # second call
    assert last.response_metadata["finish_reason"] == "length"


def test_stop_strings_cut_the_reply(fresh: Callable[..., Any]) -> None:
    eng = fresh(device=64, host=32)
    model = ContextKitChatModel(engine=eng, max_tokens=16)
    model.invoke("List three colors, comma separated.")  # later calls reuse the same blocks
    full = model.invoke("List three colors, comma separated.").text
    words = full.split()
    assert len(words) >= 3
    stop = words[2]
    cut = model.invoke("List three colors, comma separated.", stop=[stop])
    assert cut.text == full[:full.index(stop)]
    assert cut.response_metadata["finish_reason"] == "stop"
    streamed = "".join(str(c.content) for c in
                       model.stream("List three colors, comma separated.", stop=[stop]))
    assert streamed == cut.text


def test_tools_are_refused_with_a_hint(fresh: Callable[..., Any]) -> None:
    @tool
    def lookup(service: str) -> str:
        """Look a service up."""
        return service

    model = ContextKitChatModel(engine=fresh(device=32, host=16))
    agent = create_agent(model, tools=[lookup])
    with pytest.raises(NotImplementedError, match=r"tools=\[\]"):
        agent.invoke({"messages": [("user", "hi")]})


def test_malformed_markers_raise_a_clear_error(fresh: Callable[..., Any]) -> None:
    eng = fresh(device=32, host=16)
    pipeline = CacheAwareContextPipeline(eng)
    agent = create_agent(ContextKitChatModel(engine=eng, pipeline=pipeline), tools=[],
                         middleware=[ContextKitMiddleware(
                             pipeline, lambda request: "[AXIOMS]\nunclosed\n[IDENTITY]\nx")])
    with pytest.raises(PromptFormatError):
        agent.invoke({"messages": [("user", "hi")]})
    assert pipeline.cached_blocks() == []


def test_handler_reads_provider_cache_figures() -> None:
    # Anthropic-style usage through LangChain's standard usage_metadata.
    reply = AIMessage(content="done", usage_metadata={
        "input_tokens": 1200, "output_tokens": 7, "total_tokens": 1207,
        "input_token_details": {"cache_read": 1024, "cache_creation": 176}})
    handler = ContextKitCallbackHandler()
    create_agent(GenericFakeChatModel(messages=iter([reply])), tools=[]).invoke(
        {"messages": [("user", "hi")]}, config={"callbacks": [handler]})
    (rec,) = handler.records
    assert (rec.input_tokens, rec.cache_read_tokens, rec.cache_creation_tokens) == (1200, 1024, 176)
    assert handler.summary()["cache_hit_ratio"] == pytest.approx(1024 / 1200)
    # Raw provider shapes.
    assert usage_from({"input_tokens": 10, "output_tokens": 2, "cache_read_input_tokens": 5,
                       "cache_creation_input_tokens": 3}) == {
        "input_tokens": 10, "output_tokens": 2, "cache_read_tokens": 5,
        "cache_creation_tokens": 3}
    assert usage_from({"prompt_tokens": 9, "completion_tokens": 1,
                       "prompt_tokens_details": {"cached_tokens": 8}}) == {
        "input_tokens": 9, "output_tokens": 1, "cache_read_tokens": 8}


def test_async_agent_goes_through_awrap_model_call(fresh: Callable[..., Any],
                                                   layered_prompt: Callable[[int], str]) -> None:
    eng = fresh(device=64, host=32)
    pipeline = CacheAwareContextPipeline(eng)
    agent = create_agent(ContextKitChatModel(engine=eng, pipeline=pipeline, max_tokens=4),
                         tools=[], middleware=[ContextKitMiddleware(
                             pipeline, lambda request: layered_prompt(0))])
    recorder = SystemRecorder()

    async def two_turns() -> list[Any]:
        out = await agent.ainvoke({"messages": [("user", "Is checkout slow?")]},
                                  config={"callbacks": [recorder]})
        out = await agent.ainvoke({"messages": [*out["messages"], ("user", "And now?")]},
                                  config={"callbacks": [recorder]})
        return list(out["messages"])

    messages = asyncio.run(two_turns())
    assert messages[-1].usage_metadata["input_token_details"]["cache_read"] > 0
    last = pipeline.last_built()
    assert last is not None and recorder.systems[-1].text == last.text  # type: ignore[union-attr]


def test_the_model_call_runs_in_the_middleware_tenants_scope(
        fresh: Callable[..., Any], layered_prompt: Callable[[int], str],
        caplog: pytest.LogCaptureFixture) -> None:
    eng = fresh(device=128, host=64)
    pipeline = CacheAwareContextPipeline(eng)
    seen: list[str] = []

    class TenantProbe(GenericFakeChatModel):
        """A chat model that records which tenant the pipeline means during its call."""

        def _generate(self, *args: Any, **kwargs: Any) -> Any:
            seen.append(pipeline.resolve_tenant())
            return super()._generate(*args, **kwargs)

    agent = create_agent(TenantProbe(messages=iter([AIMessage("a"), AIMessage("b")])),
                         tools=[], context_schema=dict,
                         middleware=[ContextKitMiddleware(pipeline,
                                                          lambda request: layered_prompt(0))])
    agent.invoke({"messages": [("user", "hi")]}, context={"tenant": "acme"})
    with pipeline.tenant_scope("globex"):  # no runtime context: the caller's scope
        agent.invoke({"messages": [("user", "hi")]})
    assert seen == ["acme", "globex"]
    assert pipeline.resolve_tenant() == "default"  # every scope was left
    assert pipeline.last_report("acme").call == 1  # type: ignore[union-attr]
    assert pipeline.last_report("globex").call == 1  # type: ignore[union-attr]
    with caplog.at_level(logging.WARNING, logger="contextkit.pipeline.pipeline"):
        assert pipeline.last_report() is None
    assert any("'acme'" in r.getMessage() for r in caplog.records)
