"""ContextKitLLM as a LlamaIndex user drives it: the context window LlamaIndex sizes its
prompts by, stop strings on every path, async that leaves the event loop free, complete()
calls in the handlers, a RAG query over the packaged MiniLM that fits the README's small
engine, settings honoured or refused (issue 34)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from llama_index.core.callbacks import CallbackManager
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.llms import ChatMessage

from contextkit.engine.engine import Engine
from integrations.llamaindex import (
    ContextKitEventHandler,
    ContextKitLlamaCallbackHandler,
    ContextKitLLM,
)

HI = "hi"
PERIOD = 0.010  # the ticker's period, seconds


@pytest.fixture
def native(fresh: Callable[..., Engine]) -> Engine:
    return fresh("native", device=64, host=0)


@pytest.fixture
def event_handler() -> Iterator[ContextKitEventHandler]:
    handler = ContextKitEventHandler()
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(handler)
    yield handler
    dispatcher.event_handlers.remove(handler)


def test_context_window_is_what_the_engine_holds(fresh: Callable[..., Engine]) -> None:
    small = fresh("native", device=96, host=0)  # the README's engine
    meta = ContextKitLLM(small, max_new_tokens=8).metadata
    assert meta.context_window == 96 * 16 == small.context_tokens
    assert meta.num_output == 8 and meta.model_name == "SmolLM2-135M-Instruct"
    short = fresh("native", device=512, host=0, max_positions=2048)
    assert ContextKitLLM(short).metadata.context_window == 2048
    # the memory buffer is sized from it too
    assert ContextKitLLM(small, max_new_tokens=8).memory().token_limit == 96 * 16 - 8


def test_stop_on_complete_and_stream_complete(native: Engine) -> None:
    llm = ContextKitLLM(native, max_new_tokens=16)
    full = llm.complete(HI).text
    assert "you" in full
    cut = full[:full.index("you")]
    assert llm.complete(HI, stop=["you"]).text == cut
    streamed = list(llm.stream_complete(HI, stop=["you"]))
    assert "".join(r.delta or "" for r in streamed) == cut == streamed[-1].text
    # set once on the LLM, for every path
    stopping = ContextKitLLM(native, max_new_tokens=16, stop=["you"])
    assert stopping.complete(HI).text == cut
    assert stopping.chat([ChatMessage(role="user", content=HI)]).message.content == cut


def test_settings_are_honoured_or_refused(native: Engine) -> None:
    with pytest.raises(ValueError, match=r"unknown setting 'max_tokens'.*max_new_tokens"):
        ContextKitLLM(native, max_tokens=3)
    with pytest.raises(ValueError, match="temperature must be a number >= 0"):
        ContextKitLLM(native, temperature=-1)
    hot = ContextKitLLM(native, max_new_tokens=8, temperature=1.5, seed=4)
    assert hot.complete(HI).text == hot.complete(HI).text  # seeded
    assert ContextKitLLM(native, max_new_tokens=8, temperature=1.5, top_k=1, seed=9).complete(
        HI).text == ContextKitLLM(native, max_new_tokens=8).complete(HI).text


async def _tick(ticks: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        await asyncio.sleep(PERIOD)
        ticks.append(time.perf_counter())


async def _ticks_during(work: Callable[[], Any]) -> int:
    """How many times a 10 ms ticker ran while ``work`` ran. A call that blocks the event
    loop lets it run at most once (at its own awaits); one that runs the engine off the
    loop lets it run all along."""
    ticks: list[float] = []
    stop = asyncio.Event()
    ticker = asyncio.create_task(_tick(ticks, stop))
    await asyncio.sleep(PERIOD)  # the ticker is running
    before = len(ticks)
    await work()
    during = len(ticks) - before
    stop.set()
    await ticker
    return during


def test_async_leaves_the_event_loop_free(native: Engine) -> None:
    llm = ContextKitLLM(native, max_new_tokens=24)
    messages = [ChatMessage(role="user", content="Tell me about the sea.")]
    expected_text = llm.chat(messages).message.content

    async def achat() -> None:
        reply = await llm.achat(messages)
        assert reply.message.content == expected_text

    async def astream() -> None:
        parts = [r async for r in await llm.astream_chat(messages)]
        assert "".join(p.delta or "" for p in parts) == expected_text

    async def acomplete() -> None:
        assert (await llm.acomplete("Tell me about the sea.")).text

    for work in (achat, astream, acomplete):
        ticks = asyncio.run(_ticks_during(work))
        assert ticks >= 3, (work.__name__, ticks)  # the loop ran while the engine did


def test_a_cancelled_achat_stops_the_engine(native: Engine) -> None:
    llm = ContextKitLLM(native, max_new_tokens=200)

    async def cancel_early() -> None:
        task = asyncio.create_task(llm.achat([ChatMessage(role="user", content=HI * 3)]))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_early())
    with native.locked():  # the worker let go of the engine
        pass


def test_complete_calls_are_recorded_by_both_handlers(
        native: Engine, event_handler: ContextKitEventHandler) -> None:
    llm = ContextKitLLM(native, max_new_tokens=4)
    legacy = ContextKitLlamaCallbackHandler()
    llm.callback_manager = CallbackManager([legacy])
    llm.complete("Say hi.")
    list(llm.stream_complete("Say hi."))
    for handler in (event_handler, legacy):
        records = [r for r in handler.records if r.model == "SmolLM2-135M-Instruct"]
        assert len(records) == 2, handler
        assert all(r.done and r.error is None and r.output_tokens for r in records)
        assert records[1].cache_read_tokens and records[1].cache_read_tokens > 0
        assert records[0].messages == 1


class MiniLMEmbedding:
    """Builds LlamaIndex's embedding over the packaged all-MiniLM-L6-v2 (no download)."""

    @staticmethod
    def make() -> Any:
        from llama_index.core.embeddings import BaseEmbedding

        from memory_graph._embedding import SentenceTransformerEmbedder

        embedder = SentenceTransformerEmbedder()

        class PackagedMiniLM(BaseEmbedding):
            def _get_text_embedding(self, text: str) -> list[float]:
                return [float(x) for x in embedder.encode([text])[0]]

            def _get_query_embedding(self, query: str) -> list[float]:
                return self._get_text_embedding(query)

            async def _aget_query_embedding(self, query: str) -> list[float]:
                return self._get_text_embedding(query)

        return PackagedMiniLM(model_name="all-MiniLM-L6-v2")


def test_a_rag_query_fits_the_readme_engine(fresh: Callable[..., Engine]) -> None:
    from llama_index.core import Document, Settings, VectorStoreIndex

    small = fresh("native", device=96, host=0)  # the README's 96 device blocks
    llm = ContextKitLLM(small, max_new_tokens=4)
    services = ["checkout", "pricing", "search", "cart", "payments", "inventory", "shipping",
                "accounts"]
    docs = [Document(text=" ".join(
        f"The {s} service runbook, step {i}: check the {s} dashboard for p95 latency and "
        f"5xx errors, then compare with the last deploy of {s}." for i in range(12)))
        for s in services]
    index = VectorStoreIndex.from_documents(docs, embed_model=MiniLMEmbedding.make())
    engine = index.as_query_engine(llm=llm, similarity_top_k=6)
    saved = Settings.tokenizer
    try:
        try:  # LlamaIndex's default tokenizer (tiktoken) counts fewer tokens than SmolLM2's
            answer = engine.query("How do I check checkout latency?")
            assert str(answer)
        except ValueError as exc:
            assert "Settings.tokenizer = llm.tokenizer" in str(exc)
            assert "similarity_top_k" in str(exc) and "num_device_blocks" in str(exc)
        Settings.tokenizer = llm.tokenizer  # counts as the engine does: it fits
        answer = engine.query("How do I check checkout latency?")
        assert str(answer)
    finally:
        Settings.tokenizer = saved


def test_a_prompt_longer_than_the_engine_holds_says_what_to_change(
        fresh: Callable[..., Engine]) -> None:
    from integrations._engine_chat import ContextWindowError

    tiny = fresh("native", device=8, host=0)  # 128 tokens
    llm = ContextKitLLM(tiny, max_new_tokens=8)
    assert llm.metadata.context_window == 128
    with pytest.raises(ContextWindowError) as refused:
        llm.complete("Summarize the runbook. " * 40)
    message = str(refused.value)
    assert "more than the 128 tokens one request can hold" in message
    assert "Settings.tokenizer = llm.tokenizer" in message and "num_device_blocks" in message
    assert tiny.cache.metadata.all() == []  # nothing ran
