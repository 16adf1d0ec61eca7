"""Agents over an OpenAI-compatible server: the fields contextkit attaches to every request
(layout, ``cache_salt``, ``kv_transfer_params`` spans and fingerprint), checked on what a
real HTTP server received, for LangChain ``ChatOpenAI``, LlamaIndex ``OpenAILike`` and
the plain ``openai`` client (no vLLM needed; ``make test-vllm`` runs the real server)."""

from __future__ import annotations

import hashlib
import itertools
import re
import struct
from collections.abc import Callable
from typing import Any

import pytest
from openai_server import SERVED_NAME, FakeOpenAIServer


# ---------------------------------------------------------------------- the server itself
def test_the_fake_server_speaks_the_openai_api(openai_server: FakeOpenAIServer) -> None:
    import openai

    client = openai.OpenAI(base_url=openai_server.base_url, api_key="x")
    assert [m.id for m in client.models.list()] == [SERVED_NAME]
    messages: Any = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Status of checkout?"}]
    first = client.chat.completions.create(model=SERVED_NAME, messages=messages,
                                           extra_body={"cache_salt": "acme"})
    assert first.choices[0].message.content == openai_server.reply
    _, ids, _ = openai_server.render(messages)
    assert first.usage is not None and first.usage.prompt_tokens == len(ids)
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # the same prompt again, streamed with usage: the shared prefix is cached (whole blocks)
    stream = client.chat.completions.create(model=SERVED_NAME, messages=messages,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"cache_salt": "acme"})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == openai_server.reply
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // 16 * 16 > 0
    # another salt shares nothing
    other = client.chat.completions.create(model=SERVED_NAME, messages=messages,
                                           extra_body={"cache_salt": "globex"})
    assert other.usage is not None and other.usage.prompt_tokens_details is not None
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    bodies = openai_server.chat_requests()
    assert [b["cache_salt"] for b in bodies] == ["acme", "acme", "globex"]
    assert bodies[1]["stream"] is True
    # vLLM's own checks
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=messages)
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.chat.completions.create(model=SERVED_NAME, messages=messages,
                                       extra_body={"cache_salt": "a/b"})


def test_the_fake_server_tokenizes_like_chat_completions(openai_server: FakeOpenAIServer
                                                         ) -> None:
    import httpx

    messages: list[dict[str, Any]] = [
        {"role": "system", "content": [{"type": "text", "text": "Rules."},
                                       {"type": "text", "text": "More rules."}]},
        {"role": "user", "content": "Grüße 👋"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "metrics_query", "arguments": '{"service": "x"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "p95 180 ms"},
        {"role": "system", "content": "[CURRENT_TIME]\n17:02\n[/CURRENT_TIME]"},
    ]
    text, ids, _ = openai_server.render(messages)
    assert "Rules.\nMore rules." in text  # list-of-parts content joined with "\n"
    assert text.endswith("<|im_start|>system\n[CURRENT_TIME]\n17:02\n[/CURRENT_TIME]<|im_end|>\n"
                         "<|im_start|>assistant\n")
    got = httpx.post(openai_server.url + "/tokenize",
                     json={"model": SERVED_NAME, "messages": messages}).json()
    assert got["tokens"] == ids and got["count"] == len(ids)
    # contextkit's renderer agrees with this independent one, checked over HTTP
    from contextkit.pipeline.served.model import ServedModel

    served = ServedModel.packaged(name=SERVED_NAME, base_url=openai_server.base_url)
    assert served.render(messages).token_ids == ids
    served.verify(messages)


# ---------------------------------------------------------------------- helpers
def served_pipeline() -> Any:
    from contextkit import CacheAwareContextPipeline
    from contextkit.pipeline.served.model import ServedModel

    return CacheAwareContextPipeline(served=ServedModel.packaged(name=SERVED_NAME))


def fingerprint(ids: list[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(ids)}i", *ids)).hexdigest()


def prompt_layers(body: dict[str, Any], pipeline: Any) -> tuple[list[str], set[str]]:
    """The layers in a request's system messages (in order) and its stable prefix: the
    leading stable layers of the first system message."""
    layers: list[str] = []
    stable: set[str] = set()
    for k, message in enumerate(body["messages"]):
        if message["role"] != "system":
            continue
        names = re.findall(r"^\[([A-Z_]+)\]$", message["content"], flags=re.M)
        layers += [name.lower() for name in names]
        if k == 0:
            for name in names:
                if not pipeline.config.get(name.lower()).stable:
                    break
                stable.add(name.lower())
    return layers, stable


def check_labels(server: FakeOpenAIServer, body: dict[str, Any], pipeline: Any
                 ) -> dict[str, Any]:
    """Re-render what the server RECEIVED and check every span against it: the spans
    tile the prompt, each layer's section lies inside the one span labelled with its
    source layer (and no other section does), every conversation message's content is
    in a user_turn span, only stable pinnable layers are pinned, and the fingerprint
    is the received prompt's. Returns {source layer: pinned} seen."""
    from gpu_cache import PINNABLE_SOURCES

    text, ids, offsets = server.render(body["messages"], body.get("tools"))
    ours = body["kv_transfer_params"]["contextkit"]
    assert ours["prompt_tokens"] == len(ids)
    assert ours["prompt_sha256"] == fingerprint(ids)
    spans = ours["spans"]
    assert spans[0][0] == 0
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), spans  # contiguous
    assert spans[-1][1] <= len(ids)

    def chars(span: list[Any]) -> tuple[int, int]:
        return offsets[span[0]][0], offsets[span[1] - 1][1]

    def span_at(char: int) -> list[Any]:
        (span,) = [s for s in spans if chars(s)[0] <= char < chars(s)[1]]
        return span

    layers, stable = prompt_layers(body, pipeline)
    assert layers
    seen: dict[str, bool] = {}
    for layer in layers:
        spec = pipeline.config.get(layer)
        opening, closing = f"[{layer.upper()}]", f"[/{layer.upper()}]"
        assert text.count(opening) == 1, layer
        a, b = text.index(opening), text.index(closing) + len(closing)
        span = span_at(a)
        lo, hi = chars(span)
        assert lo <= a and b <= hi, (layer, span, text[lo:hi])  # the whole section
        inside = text[lo:hi]
        assert [other for other in layers if f"[{other.upper()}]" in inside] == [layer]
        assert span[2] == spec.source, (layer, span)
        expect_pin = layer in stable and spec.source in PINNABLE_SOURCES
        assert span[4] is expect_pin, (layer, span)
        seen[spec.source] = span[4]
    for message in body["messages"]:
        content = message.get("content")
        if message["role"] == "system" or not content:
            continue
        at = text.index(content)
        span = span_at(at)
        assert span[2] == "user_turn" and span[4] is False, (message, span)
        assert at + len(content) <= chars(span)[1]
        seen["user_turn"] = False
    assert {s[2] for s in spans if s[4]} <= {pipeline.config.get(x).source for x in stable}
    return seen


# ---------------------------------------------------------------------- LangChain
def test_langchain_agent_over_an_openai_server_sends_exact_labels(
        openai_server: FakeOpenAIServer, layered_prompt: Callable[[int], str]) -> None:
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import SecretStr

    from integrations.langchain import ContextKitCallbackHandler, ContextKitMiddleware

    @tool
    def metrics_query(service: str) -> str:
        """p95 latency and 5xx rate of a service."""
        return f"{service}: p95 201 ms, 5xx 0.4%"

    pipeline = served_pipeline()
    box = {"turn": 0}
    model = ChatOpenAI(model=SERVED_NAME, base_url=openai_server.base_url, api_key=SecretStr("x"),
                       streaming=True, stream_usage=True, max_retries=0,
                       extra_body={"top_k": 5, "kv_transfer_params": {"other": 1}})
    agent: Any = create_agent(model, tools=[metrics_query], context_schema=dict, middleware=[
        ContextKitMiddleware(pipeline, lambda request: layered_prompt(box["turn"]))])
    handler = ContextKitCallbackHandler()
    questions = ["Is checkout slow?", "What changed?", "Check pricing-service.", "Roll back?"]
    history: list[Any] = []
    for turn, question in enumerate(questions):
        box["turn"] = turn
        if turn == 2:
            openai_server.queue_tool_call("metrics_query", {"service": "pricing-service"})
        out = agent.invoke({"messages": [*history, ("user", question)]},
                           config={"callbacks": [handler]}, context={"tenant": "acme"})
        history = out["messages"]
        assert isinstance(history[-1], AIMessage) and history[-1].text == openai_server.reply
    assert any(isinstance(m, ToolMessage) for m in history)

    bodies = openai_server.chat_requests()
    assert len(bodies) == 5  # turn 3 is a tool round: two model calls
    assert openai_server.label_mismatches == []  # the connector's check accepts every one
    reused_calls = 0
    for i, body in enumerate(bodies):
        assert body["cache_salt"] == "acme"
        assert body["stream"] is True and body["top_k"] == 5  # the model's own extra_body
        assert body["kv_transfer_params"]["other"] == 1
        messages = body["messages"]
        roles = [m["role"] for m in messages]
        # layout: main system message first, then the history, the trailing system
        # message, the current user turn and its tool round
        assert roles[0] == "system" and roles.count("system") == 2, roles
        last_user = max(k for k, r in enumerate(roles) if r == "user")
        assert roles[last_user - 1] == "system", roles
        trailing = messages[last_user - 1]["content"]
        assert "[CURRENT_TIME]" in trailing and "[AXIOMS]" in messages[0]["content"]
        assert "[CURRENT_TIME]" not in messages[0]["content"]
        assert all(set(m) <= {"role", "content", "tool_calls", "tool_call_id", "name"}
                   for m in messages)
        seen = check_labels(openai_server, body, pipeline)
        assert seen["axioms"] is True and seen["identity"] is True
        assert seen["memories"] is False and seen["user_turn"] is False
        # the server's prefix cache reuses the system prompt and the history: what
        # precedes the previous request's trailing message, whole blocks
        cached = openai_server.cached_for(i)
        if i and messages[0] == bodies[i - 1]["messages"][0]:
            before = bodies[i - 1]["messages"]
            at = max(k for k, m in enumerate(before) if m["role"] == "user") - 1
            assert messages[:at] == before[:at]
            shared = len(openai_server.render(before[:at])[1]) - 3  # minus the gen. prompt
            assert cached >= shared // 16 * 16 > 0, (i, cached, shared)
            reused_calls += 1
    assert reused_calls >= 3  # the main message changes only while volatility is learned
    # every call's report has the server's usage
    report = pipeline.last_report("acme")
    _, ids, _ = openai_server.render(bodies[-1]["messages"], bodies[-1].get("tools"))
    assert report.prompt_tokens == len(ids)
    assert report.reused_tokens == openai_server.cached_for(len(bodies) - 1) > 0
    assert report.computed_tokens == len(ids) - report.reused_tokens
    done = [r for r in handler.records if r.done]
    assert len(done) == 5 and done[-1].cache_read_tokens == report.reused_tokens
    assert "current_time" in done[-1].layers  # the trailing system message is seen too

    # a second tenant: its own salt, so nothing of acme's prefix is reused
    box["turn"] = 0
    agent.invoke({"messages": [("user", questions[0])]}, context={"tenant": "globex"})
    other = openai_server.chat_requests()[-1]
    assert other["cache_salt"] == "globex"
    assert openai_server.cached_for(len(bodies)) == 0
    check_labels(openai_server, other, pipeline)


# ---------------------------------------------------------------------- three clients
CONVERSATION = [{"role": "user", "content": "Is checkout slow?"},
                {"role": "assistant", "content": "All good."},
                {"role": "user", "content": "What changed since the deploy?"}]


def test_langchain_llamaindex_and_openai_send_identical_fields(
        openai_server: FakeOpenAIServer, layered_prompt: Callable[[int], str]) -> None:
    import openai
    from langchain.agents import create_agent
    from langchain_openai import ChatOpenAI
    from llama_index.core.base.llms.types import ChatMessage, MessageRole, TextBlock
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.llms.openai_like import OpenAILike
    from pydantic import SecretStr

    from integrations.langchain import ContextKitMiddleware
    from integrations.llamaindex import ContextKitEventHandler, ContextKitOpenAILike
    from integrations.openai import record_usage, request_kwargs

    system = layered_prompt(3)
    # the plain openai client
    plain = served_pipeline()
    client = openai.OpenAI(base_url=openai_server.base_url, api_key="x", max_retries=0)
    kwargs = request_kwargs(plain, CONVERSATION, tenant="acme", system=system)
    reply = client.chat.completions.create(model=SERVED_NAME, **kwargs)
    assert record_usage(plain, reply, tenant="acme")
    # LlamaIndex: OpenAILike(is_chat_model=True) wrapped
    llama = served_pipeline()
    llm = ContextKitOpenAILike(
        OpenAILike(model=SERVED_NAME, api_base=openai_server.base_url, api_key="x",
                   is_chat_model=True, max_retries=0,
                   additional_kwargs={"extra_body": {"top_k": 3}}), llama, tenant="acme")
    messages = [ChatMessage(role=MessageRole.SYSTEM, content=system),
                *(ChatMessage(role=m["role"], content=m["content"]) for m in CONVERSATION)]
    handler = ContextKitEventHandler()
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(handler)
    try:
        response = llm.chat(messages)
    finally:
        dispatcher.event_handlers.remove(handler)
    assert response.message.content == openai_server.reply
    done = [r for r in handler.records if r.done]
    assert len(done) == 1  # one model call, one record (the wrapper adds no event of its own)
    assert done[0].cache_read_tokens == openai_server.cached_for(1) > 0
    assert {"axioms", "current_time"} <= set(done[0].layers)  # both system messages
    # LangChain: create_agent + ChatOpenAI
    chain = served_pipeline()
    agent: Any = create_agent(
        ChatOpenAI(model=SERVED_NAME, base_url=openai_server.base_url, api_key=SecretStr("x"),
                   max_retries=0), tools=[],
        middleware=[ContextKitMiddleware(chain, lambda request: system, tenant="acme")])
    agent.invoke({"messages": [(m["role"], m["content"]) for m in CONVERSATION]})

    bodies = openai_server.chat_requests()
    assert len(bodies) == 3 and openai_server.label_mismatches == []
    sent = [(b["messages"], b["kv_transfer_params"], b["cache_salt"]) for b in bodies]
    assert sent[0] == sent[1] == sent[2]
    assert bodies[1]["top_k"] == 3  # the LlamaIndex model's own extra_body is kept
    assert [m["role"] for m in bodies[0]["messages"]] == [
        "system", "user", "assistant", "system", "user"]
    check_labels(openai_server, bodies[0], plain)
    for pipeline, i in ((plain, 0), (llama, 1), (chain, 2)):
        report = pipeline.last_report("acme")
        assert report.prompt_tokens == kwargs["extra_body"]["kv_transfer_params"][
            "contextkit"]["prompt_tokens"]
        assert report.reused_tokens == openai_server.cached_for(i)
    assert openai_server.cached_for(1) > 0  # same salt, same prompt: the server reused it

    # LlamaIndex joins a message's text blocks with "": labels follow what it sends
    split = ChatMessage(role=MessageRole.USER,
                        blocks=[TextBlock(text="Is checkout "), TextBlock(text="slow?")])
    llm.chat([messages[0], split])
    body = openai_server.chat_requests()[-1]
    assert body["messages"][-1]["content"] == "Is checkout slow?"
    check_labels(openai_server, body, llama)
    # streamed, with the final usage chunk: the report gets the server's figures
    chunks = list(llm.stream_chat(messages, stream_options={"include_usage": True}))
    assert chunks[-1].message.content == openai_server.reply
    last = len(openai_server.chat_requests()) - 1
    assert openai_server.chat_requests()[last]["stream"] is True
    assert llama.last_report("acme").reused_tokens == openai_server.cached_for(last) > 0


def test_a_prompt_of_volatile_layers_only_keeps_an_empty_main_system_message(
        openai_server: FakeOpenAIServer) -> None:
    """Without a leading system message the template would inject its default one
    ("You are a helpful AI assistant named SmolLM..."), which no layer owns."""
    from langchain.agents import create_agent
    from langchain_openai import ChatOpenAI
    from llama_index.core.base.llms.types import ChatMessage, MessageRole
    from llama_index.llms.openai_like import OpenAILike
    from pydantic import SecretStr

    from integrations.langchain import ContextKitMiddleware
    from integrations.llamaindex import ContextKitOpenAILike
    from integrations.openai import request_kwargs

    system = "[CURRENT_TIME]\n2025-03-11 17:02 CET\n[/CURRENT_TIME]"
    plain = served_pipeline()
    expected = request_kwargs(plain, CONVERSATION, tenant="acme", system=system)["messages"]
    assert expected[0] == {"role": "system", "content": ""}
    chain = served_pipeline()
    agent: Any = create_agent(
        ChatOpenAI(model=SERVED_NAME, base_url=openai_server.base_url, api_key=SecretStr("x"),
                   max_retries=0), tools=[],
        middleware=[ContextKitMiddleware(chain, lambda request: system, tenant="acme")])
    agent.invoke({"messages": [(m["role"], m["content"]) for m in CONVERSATION]})
    llama = served_pipeline()
    ContextKitOpenAILike(OpenAILike(model=SERVED_NAME, api_base=openai_server.base_url,
                                    api_key="x", is_chat_model=True, max_retries=0),
                         llama, tenant="acme").chat(
        [ChatMessage(role=MessageRole.SYSTEM, content=system),
         *(ChatMessage(role=m["role"], content=m["content"]) for m in CONVERSATION)])
    for body, pipeline in zip(openai_server.chat_requests(), (chain, llama), strict=True):
        assert body["messages"] == expected
        text, _, _ = openai_server.render(body["messages"])
        assert "SmolLM" not in text  # no default system prompt
        check_labels(openai_server, body, pipeline)


def test_one_system_message_for_providers_that_reject_a_second(
        openai_server: FakeOpenAIServer, layered_prompt: Callable[[int], str]) -> None:
    from langchain.agents import create_agent
    from langchain_openai import ChatOpenAI
    from pydantic import SecretStr

    from integrations.langchain import ContextKitMiddleware

    pipeline = served_pipeline()
    agent: Any = create_agent(
        ChatOpenAI(model=SERVED_NAME, base_url=openai_server.base_url, api_key=SecretStr("x"),
                   max_retries=0), tools=[],
        middleware=[ContextKitMiddleware(pipeline, lambda request: layered_prompt(1),
                                         tenant="acme", trailing_system=False)])
    agent.invoke({"messages": [(m["role"], m["content"]) for m in CONVERSATION]})
    (body,) = openai_server.chat_requests()
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user"]
    assert "[CURRENT_TIME]" in body["messages"][0]["content"]
    check_labels(openai_server, body, pipeline)


def test_a_server_with_another_chat_template_ignores_the_labels(
        served_model_dir: Any, layered_prompt: Callable[[int], str]) -> None:
    """vLLM started with its own --chat-template: /tokenize shows ids that differ (verify
    refuses), and the connector's check (the fingerprint) refuses the labels."""
    from langchain.agents import create_agent
    from langchain_openai import ChatOpenAI
    from pydantic import SecretStr

    from contextkit.pipeline.served.model import LabelRangeError, ServedModel
    from integrations.langchain import ContextKitMiddleware

    other = ServedModel.packaged(name=SERVED_NAME).chat_template.replace(
        "'<|im_end|>' + '\n'", "'<|im_end|>' + '\n\n'")
    assert other != ServedModel.packaged(name=SERVED_NAME).chat_template
    with FakeOpenAIServer(served_model_dir, model_name=SERVED_NAME,
                          chat_template=other) as server:
        pipeline = served_pipeline()
        agent: Any = create_agent(
            ChatOpenAI(model=SERVED_NAME, base_url=server.base_url, api_key=SecretStr("x"),
                       max_retries=0), tools=[],
            middleware=[ContextKitMiddleware(pipeline, lambda request: layered_prompt(1),
                                             tenant="acme")])
        agent.invoke({"messages": [("user", "Is checkout slow?")]})
        (body,) = server.chat_requests()
        (reason,) = server.label_mismatches  # the connector would store default labels
        assert "differs from the server's prompt ids" in reason
        with pytest.raises(LabelRangeError, match="differ"):
            ServedModel.packaged(name=SERVED_NAME, base_url=server.url).verify(
                body["messages"])


def test_labels_for_another_model_are_refused_before_sending(
        openai_server: FakeOpenAIServer, layered_prompt: Callable[[int], str]) -> None:
    from langchain.agents import create_agent
    from langchain_openai import ChatOpenAI
    from llama_index.llms.openai_like import OpenAILike
    from pydantic import SecretStr

    from contextkit.pipeline.served.model import LabelRangeError
    from integrations.langchain import ContextKitMiddleware
    from integrations.llamaindex import ContextKitOpenAILike

    pipeline = served_pipeline()
    agent: Any = create_agent(
        ChatOpenAI(model="qwen", base_url=openai_server.base_url, api_key=SecretStr("x"),
                   max_retries=0), tools=[],
        middleware=[ContextKitMiddleware(pipeline, lambda request: layered_prompt(1))])
    with pytest.raises(LabelRangeError, match=r"'qwen'.*'smollm2'"):
        agent.invoke({"messages": [("user", "hi")]})
    assert openai_server.chat_requests() == []  # nothing was sent
    with pytest.raises(ValueError, match="is_chat_model=True"):
        ContextKitOpenAILike(OpenAILike(model=SERVED_NAME, api_base=openai_server.base_url,
                                        api_key="x"), pipeline)


def test_async_agent_sends_the_same_fields_and_records_usage(
        openai_server: FakeOpenAIServer, layered_prompt: Callable[[int], str]) -> None:
    import asyncio

    from langchain.agents import create_agent
    from langchain_openai import ChatOpenAI
    from pydantic import SecretStr

    from integrations.langchain import ContextKitMiddleware

    pipeline = served_pipeline()
    agent: Any = create_agent(
        ChatOpenAI(model=SERVED_NAME, base_url=openai_server.base_url, api_key=SecretStr("x"),
                   max_retries=0), tools=[], context_schema=dict,
        middleware=[ContextKitMiddleware(pipeline, lambda request: layered_prompt(1))])
    async def twice() -> None:  # one event loop: the client's connections live in it
        for _ in range(2):
            await agent.ainvoke({"messages": [(m["role"], m["content"]) for m in CONVERSATION]},
                                context={"tenant": "globex"})

    asyncio.run(twice())
    first, second = openai_server.chat_requests()
    assert first["cache_salt"] == second["cache_salt"] == "globex"
    check_labels(openai_server, second, pipeline)
    report = pipeline.last_report("globex")
    assert report.reused_tokens == openai_server.cached_for(1) > 0


def test_langchain_and_llamaindex_send_the_runs_agent_hints(
        openai_server: FakeOpenAIServer, layered_prompt: Callable[[int], str]) -> None:
    from langchain.agents import create_agent
    from langchain_openai import ChatOpenAI
    from llama_index.core.base.llms.types import ChatMessage, MessageRole
    from llama_index.llms.openai_like import OpenAILike
    from pydantic import SecretStr

    from contextkit.pipeline.served.wire import HINTS_KEY
    from integrations.langchain import ContextKitMiddleware
    from integrations.llamaindex import ContextKitOpenAILike

    system = layered_prompt(1)
    agent: Any = create_agent(
        ChatOpenAI(model=SERVED_NAME, base_url=openai_server.base_url, api_key=SecretStr("x"),
                   max_retries=0), tools=[], context_schema=dict,
        middleware=[ContextKitMiddleware(served_pipeline(), lambda request: system)])
    question = [("user", CONVERSATION[0]["content"])]
    # the runtime context's hints, and the LangGraph thread as the session
    agent.invoke({"messages": question}, context={"tenant": "acme", "session_id": "agent-7",
                                                  "kv_keep_s": 90, "kv_priority": 80})
    agent.invoke({"messages": question}, context={"tenant": "acme"},
                 config={"configurable": {"thread_id": "thread-3"}})
    agent.invoke({"messages": question}, context={"tenant": "acme", "kv_keep_s": -1})
    agent.invoke({"messages": question}, context={"tenant": "acme"})
    hints = [b["kv_transfer_params"].get(HINTS_KEY) for b in openai_server.chat_requests()]
    assert hints == [{"session": "agent-7", "keep_s": 90, "importance": 0.8},
                     {"session": "thread-3"}, None, None]  # a bad keep_s is dropped

    llm = ContextKitOpenAILike(
        OpenAILike(model=SERVED_NAME, api_base=openai_server.base_url, api_key="x",
                   is_chat_model=True, max_retries=0), served_pipeline(), tenant="acme",
        session_id="agent-9")
    messages = [ChatMessage(role=MessageRole.SYSTEM, content=system),
                ChatMessage(role=MessageRole.USER, content=CONVERSATION[0]["content"])]
    llm.chat(messages, kv_keep_s=30)
    llm.chat(messages, session_id="agent-10")
    sent = [b["kv_transfer_params"].get(HINTS_KEY) for b in openai_server.chat_requests()[4:]]
    assert sent == [{"session": "agent-9", "keep_s": 30}, {"session": "agent-10"}]
    assert all("kv_keep_s" not in b and "session_id" not in b
               for b in openai_server.chat_requests())  # consumed, not sent as fields
