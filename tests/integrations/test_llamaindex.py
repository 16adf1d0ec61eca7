"""LlamaIndex: the engine-backed LLM in a real chat engine, event and callback handlers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from llama_index.core.callbacks import CallbackManager
from llama_index.core.chat_engine import SimpleChatEngine
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.llms import ChatMessage, MockLLM

from contextkit import CacheAwareContextPipeline
from integrations.llamaindex import (
    ContextKitEventHandler,
    ContextKitLlamaCallbackHandler,
    ContextKitLLM,
)

QUESTIONS = ("Is checkout slow?", "What should I check first?", "Should we roll back?")


@pytest.fixture
def event_handler() -> Iterator[ContextKitEventHandler]:
    handler = ContextKitEventHandler()
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(handler)
    yield handler
    dispatcher.event_handlers.remove(handler)


def test_chat_engine_reuses_the_pinned_prefix(fresh: Callable[..., Any],
                                              layered_prompt: Callable[[int], str],
                                              event_handler: ContextKitEventHandler) -> None:
    eng = fresh(device=96, host=64)
    pipeline = CacheAwareContextPipeline(eng)
    box = {"i": 0}
    llm = ContextKitLLM(eng, pipeline=pipeline, max_new_tokens=8,
                        build_system_message=lambda messages: layered_prompt(box["i"]))
    legacy = ContextKitLlamaCallbackHandler()
    llm.callback_manager = CallbackManager([legacy])
    chat = SimpleChatEngine.from_defaults(llm=llm, memory=llm.memory())
    reads = []
    for i, question in enumerate(QUESTIONS):
        box["i"] = i
        response = chat.chat(question)
        assert isinstance(response.response, str) and response.response
        report = pipeline.last_report()
        assert report is not None and report.call == i + 1
        reads.append(report.reused_tokens)
    assert reads[0] == 0 and all(r > 0 for r in reads[1:])
    assert pipeline.pinned_blocks()
    assert len(chat.chat_history) == 6  # the chat engine kept the conversation

    for handler in (event_handler, legacy):
        records = [r for r in handler.records if r.model == "SmolLM2-135M-Instruct"]
        assert len(records) == 3 and all(r.done and r.error is None for r in records)
        assert [r.cache_read_tokens for r in records] == reads
        assert all(r.input_tokens and r.input_tokens > (r.cache_read_tokens or 0)
                   for r in records)
        assert all(r.ttft_ms and r.ttft_ms > 0 for r in records)
    rec = event_handler.records[-1]
    assert rec.stable_hash == pipeline.last_report().stable_hash  # type: ignore[union-attr]
    assert rec.layers[:4] == ["axioms", "identity", "system_knowledge", "capabilities"]
    assert rec.prefix_broken_by == "affect"  # moved into the main message on call 3


def test_the_readme_engine_serves_a_long_stable_prompt_unpinned(
        fresh: Callable[..., Any], caplog: pytest.LogCaptureFixture) -> None:
    """Issue 35: the README's 96-block engine and a 24-line stable layer raised
    ``PinCapacityError``; the prefix is over the pin quota, so it is served unpinned."""
    eng = fresh(device=96, host=64)
    pipeline = CacheAwareContextPipeline(eng)
    llm = ContextKitLLM(eng, pipeline=pipeline, max_new_tokens=4)
    system = ("[AXIOMS]\nBe brief.\n[/AXIOMS]\n[CAPABILITIES]\n"
              + "".join(f"Read dashboard {i} of the checkout service and its p95.\n"
                        for i in range(24)) + "[/CAPABILITIES]")
    chat = SimpleChatEngine.from_defaults(llm=llm, memory=llm.memory(), system_prompt=system)
    with caplog.at_level("WARNING", logger="contextkit.pipeline.pipeline"):
        chat.chat("Is checkout slow?")
        chat.chat("And now?")
    report = pipeline.last_report()
    assert report is not None and report.reused_tokens > 0
    assert report.pin_state == "unpinned" and "over its pin quota" in report.pin_reason
    assert sum("served unpinned" in r.getMessage() for r in caplog.records) == 1


def test_marked_system_prompt_goes_through_the_pipeline(
        fresh: Callable[..., Any], layered_prompt: Callable[[int], str]) -> None:
    eng = fresh(device=64, host=32)
    pipeline = CacheAwareContextPipeline(eng, tenant="acme")
    llm = ContextKitLLM(eng, pipeline=pipeline, max_new_tokens=4)
    chat = SimpleChatEngine.from_defaults(llm=llm, memory=llm.memory(),
                                          system_prompt=layered_prompt(0))
    chat.chat("Is checkout slow?")
    chat.chat("And now?")
    report = pipeline.last_report("acme")
    assert report is not None and report.call == 2 and report.reused_tokens > 0
    assert {m.tenant_slug for m in eng.cache.metadata.all()} == {"acme"}


def test_stream_chat_deltas_add_up(fresh: Callable[..., Any],
                                   event_handler: ContextKitEventHandler) -> None:
    eng = fresh(device=64, host=32)
    llm = ContextKitLLM(eng, max_new_tokens=10)
    messages = [ChatMessage(role="user", content="Write a haiku about caches.")]
    llm.chat(messages)  # both calls below reuse the same cached blocks
    whole = llm.chat(messages).message.content
    parts = list(llm.stream_chat(messages))
    assert len(parts) > 3
    assert "".join(p.delta or "" for p in parts) == whole == parts[-1].message.content
    assert parts[-1].raw["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    ends = [r for r in event_handler.records if r.done]
    assert len(ends) == 3 and ends[-1].output_tokens == 10
    completion = llm.complete("Say hi.")
    assert completion.text and completion.raw["usage"]["completion_tokens"] > 0


def test_handlers_observe_any_llm(event_handler: ContextKitEventHandler) -> None:
    llm = MockLLM(max_tokens=5)
    legacy = ContextKitLlamaCallbackHandler()
    llm.callback_manager = CallbackManager([legacy])
    chat = SimpleChatEngine.from_defaults(llm=llm, system_prompt="You are terse.")
    chat.chat("hello")
    for handler in (event_handler, legacy):
        (rec,) = handler.records
        assert rec.done and rec.error is None and rec.messages == 2
        assert rec.system_chars == len("You are terse.") and rec.layers == []
        assert rec.cache_read_tokens is None  # MockLLM reports no usage


def test_engine_must_be_a_contextkit_engine() -> None:
    with pytest.raises(TypeError, match=r"Engine\.from_pretrained"):
        ContextKitLLM(object())  # type: ignore[arg-type]
