"""Agents over an OpenAI-compatible server: the fields contextkit attaches to every request
(layout, ``cache_salt``, ``kv_transfer_params`` spans and fingerprint), checked on what a
real HTTP server received, for LangChain ``ChatOpenAI``, LlamaIndex ``OpenAILike`` and
the plain ``openai`` client (no vLLM needed; ``make test-vllm`` runs the real server)."""

from __future__ import annotations

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
