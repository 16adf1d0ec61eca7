"""Served mode against any OpenAI-compatible server (issue 34): the stand-in server honours
the request's own settings, and a server that is not vLLM (it refuses fields outside
OpenAI's API, as ``transformers serve`` does) gets plain requests, the layout still
applied, with one line said once."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from openai_server import SERVED_NAME, FakeOpenAIServer

CONVERSATION = [{"role": "user", "content": "Is checkout slow?"},
                {"role": "assistant", "content": "All good."},
                {"role": "user", "content": "What changed since the deploy?"}]
FIELDS = {"kv_transfer_params", "cache_salt"}


@pytest.fixture
def plain_server(served_model_dir: Path) -> Iterator[FakeOpenAIServer]:
    """An OpenAI-compatible server that is not vLLM: unknown fields are a 422."""
    with FakeOpenAIServer(served_model_dir, model_name=SERVED_NAME, strict=True) as server:
        yield server


def served_pipeline(**served_kw: Any) -> Any:
    from contextkit import CacheAwareContextPipeline
    from contextkit.pipeline.served.model import ServedModel

    return CacheAwareContextPipeline(served=ServedModel.packaged(name=SERVED_NAME, **served_kw))


def refusal_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "refused contextkit's" in r.getMessage()]


# ---------------------------------------------------------------------- the stand-in server
def test_the_stand_in_server_honours_n_stop_and_token_limits(
        openai_server: FakeOpenAIServer) -> None:
    import openai

    client = openai.OpenAI(base_url=openai_server.base_url, api_key="x", max_retries=0)
    messages: Any = [{"role": "user", "content": "Status?"}]
    two = client.chat.completions.create(model=SERVED_NAME, messages=messages, n=2)
    assert [c.index for c in two.choices] == [0, 1]
    cut = client.chat.completions.create(model=SERVED_NAME, messages=messages, stop=["good"])
    assert cut.choices[0].message.content == "All "
    one = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=1)
    assert one.choices[0].finish_reason == "length"
    assert one.usage is not None and one.usage.completion_tokens == 1
    assert one.choices[0].message.content == "All"
    new = client.chat.completions.create(model=SERVED_NAME, messages=messages,
                                         max_completion_tokens=2)
    assert new.usage is not None and new.usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError, match="maximum context length is 8192"):
        client.chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": "word " * 100_000}])
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=9000)


def test_request_settings_reach_the_server_through_the_middleware(
        openai_server: FakeOpenAIServer, layered_prompt: Callable[[int], str]) -> None:
    from langchain.agents import create_agent
    from langchain_openai import ChatOpenAI
    from pydantic import SecretStr

    from integrations.langchain import ContextKitMiddleware

    agent: Any = create_agent(
        ChatOpenAI(model=SERVED_NAME, base_url=openai_server.base_url, api_key=SecretStr("x"),
                   max_retries=0, max_tokens=1, stop=["zzz"], temperature=0.3), tools=[],
        middleware=[ContextKitMiddleware(served_pipeline(), lambda r: layered_prompt(0),
                                         tenant="acme")])
    reply = agent.invoke({"messages": [("user", "Is checkout slow?")]})["messages"][-1]
    assert reply.text == "All" and reply.response_metadata["finish_reason"] == "length"
    (body,) = openai_server.chat_requests()
    assert body["max_completion_tokens"] == 1 or body.get("max_tokens") == 1
    assert body["stop"] == ["zzz"] and body["temperature"] == 0.3
    assert body["cache_salt"] == "acme"  # a vLLM server: contextkit's fields are sent


# ---------------------------------------------------------------------- a server that is not vLLM
def check_plain(body: dict[str, Any]) -> None:
    """A plain OpenAI request with contextkit's layout: main system message first, the
    volatile layers in a trailing system message before the last user turn."""
    assert not FIELDS & set(body), sorted(body)
    roles = [m["role"] for m in body["messages"]]
    assert roles[0] == "system" and roles[-2:] == ["system", "user"], roles
    assert "[AXIOMS]" in body["messages"][0]["content"]
    assert "[CURRENT_TIME]" in body["messages"][-2]["content"]


def test_langchain_middleware_falls_back_to_plain_requests(
        plain_server: FakeOpenAIServer, layered_prompt: Callable[[int], str],
        caplog: pytest.LogCaptureFixture) -> None:
    from langchain.agents import create_agent
    from langchain_openai import ChatOpenAI
    from pydantic import SecretStr

    from integrations.langchain import ContextKitMiddleware

    pipeline = served_pipeline()
    agent: Any = create_agent(
        ChatOpenAI(model=SERVED_NAME, base_url=plain_server.base_url, api_key=SecretStr("x"),
                   max_retries=0, stream_usage=True), tools=[],
        middleware=[ContextKitMiddleware(pipeline, lambda r: layered_prompt(1),
                                         tenant="acme")])
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            reply = agent.invoke({"messages": [(m["role"], m["content"])
                                               for m in CONVERSATION]})["messages"][-1]
            assert reply.text == plain_server.reply
    first, *plain = plain_server.chat_requests()
    assert set(first) >= FIELDS  # tried once, refused (422)
    assert plain_server.usage_for(0) is None
    assert len(plain) == 2
    for body in plain:
        check_plain(body)
    assert len(refusal_lines(caplog)) == 1  # said once, in one line
    (line,) = refusal_lines(caplog)
    assert "\n" not in line and "plain OpenAI requests" in line
    report = pipeline.last_report("acme")
    assert report.served_fields == "plain"
    assert report.prompt_tokens == len(plain_server.render(plain[-1]["messages"])[1])


def test_llamaindex_and_a_chat_engine_fall_back_too(
        plain_server: FakeOpenAIServer, layered_prompt: Callable[[int], str],
        caplog: pytest.LogCaptureFixture) -> None:
    from llama_index.core.base.llms.types import ChatMessage, MessageRole
    from llama_index.core.chat_engine import SimpleChatEngine
    from llama_index.llms.openai_like import OpenAILike

    from integrations.llamaindex import ContextKitOpenAILike

    pipeline = served_pipeline()
    llm = ContextKitOpenAILike(
        OpenAILike(model=SERVED_NAME, api_base=plain_server.base_url, api_key="x",
                   is_chat_model=True, max_retries=0), pipeline, tenant="acme")
    system = ChatMessage(role=MessageRole.SYSTEM, content=layered_prompt(2))
    with caplog.at_level(logging.INFO):
        reply = llm.chat([system, *(ChatMessage(role=m["role"], content=m["content"])
                                    for m in CONVERSATION)])
        assert reply.message.content == plain_server.reply
        chunks = list(llm.stream_chat([system, ChatMessage(role="user", content="And now?")]))
        assert chunks[-1].message.content == plain_server.reply
        chat = SimpleChatEngine.from_defaults(llm=llm, system_prompt=layered_prompt(3))
        assert str(chat.chat("Is checkout slow?")) == plain_server.reply
    bodies = plain_server.chat_requests()
    assert set(bodies[0]) >= FIELDS and plain_server.usage_for(0) is None
    for body in bodies[1:]:
        check_plain(body)
    assert len(refusal_lines(caplog)) == 1
    assert pipeline.last_report("acme").served_fields == "plain"


def test_the_openai_client_helper_falls_back(
        plain_server: FakeOpenAIServer, layered_prompt: Callable[[int], str],
        caplog: pytest.LogCaptureFixture) -> None:
    import openai

    from integrations.openai import chat_completion, request_kwargs

    pipeline = served_pipeline()
    client = openai.OpenAI(base_url=plain_server.base_url, api_key="x", max_retries=0)
    with caplog.at_level(logging.INFO):
        reply = chat_completion(client, pipeline, CONVERSATION, tenant="acme",
                                system=layered_prompt(1), max_tokens=2)
    assert reply.choices[0].message.content == "All good"
    refused, body = plain_server.chat_requests()
    assert set(refused) >= FIELDS
    check_plain(body)
    assert body["max_tokens"] == 2
    assert pipeline.last_report("acme").prompt_tokens == reply.usage.prompt_tokens
    # from now on the pipeline knows: request_kwargs itself is plain
    kwargs = request_kwargs(pipeline, CONVERSATION, tenant="acme")
    assert not FIELDS & set(kwargs.get("extra_body") or {})
    assert len(refusal_lines(caplog)) == 1


def test_extra_fields_can_be_forced_on_or_off(
        plain_server: FakeOpenAIServer, openai_server: FakeOpenAIServer,
        layered_prompt: Callable[[int], str]) -> None:
    import openai

    from integrations.openai import chat_completion

    never = served_pipeline(extra_fields=False)
    client = openai.OpenAI(base_url=openai_server.base_url, api_key="x", max_retries=0)
    chat_completion(client, never, CONVERSATION, tenant="acme", system=layered_prompt(1))
    (body,) = openai_server.chat_requests()
    check_plain(body)  # never sent, even to vLLM
    assert never.last_report("acme").served_fields == "plain"
    always = served_pipeline(extra_fields=True)
    strict = openai.OpenAI(base_url=plain_server.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.UnprocessableEntityError, match="Unexpected fields"):
        chat_completion(strict, always, CONVERSATION, tenant="acme", system=layered_prompt(1))
    assert len(plain_server.chat_requests()) == 1  # no silent fallback when forced
    vllm = served_pipeline()
    chat_completion(client, vllm, CONVERSATION, tenant="acme", system=layered_prompt(1))
    assert set(openai_server.chat_requests()[-1]) >= FIELDS
    assert vllm.last_report("acme").served_fields == "sent"
