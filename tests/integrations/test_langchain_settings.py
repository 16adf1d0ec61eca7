"""ContextKitChatModel as a LangChain user configures it: model name and profile for
traces and middleware, every constructor setting honoured or refused, token counting with
the engine's own tokenizer, content it cannot read refused (issue 34)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from langchain.agents.middleware import SummarizationMiddleware
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, trim_messages
from pydantic import ValidationError

from contextkit.engine.engine import Engine
from integrations.langchain import ContextKitChatModel

HI = "hi"


@pytest.fixture
def native(fresh: Callable[..., Engine]) -> Engine:
    """A small native-KV engine (the fastest decode on CPU) of the packaged SmolLM2."""
    return fresh("native", device=64, host=0)


def test_traces_carry_the_model_name(native: Engine) -> None:
    model = ContextKitChatModel(engine=native, max_tokens=10, stop=["x"], temperature=0.5)
    assert model.model_name == native.model_id == "SmolLM2-135M-Instruct"
    params = model._get_ls_params()
    assert params["ls_provider"] == "contextkit"
    assert params["ls_model_name"] == "SmolLM2-135M-Instruct"
    assert params["ls_max_tokens"] == 10 and params["ls_stop"] == ["x"]
    assert params["ls_temperature"] == 0.5
    assert ContextKitChatModel(engine=native, model="SmolLM2-135M-Instruct").model_name == \
        native.model_id
    with pytest.raises(ValidationError, match="the engine runs 'SmolLM2-135M-Instruct'"):
        ContextKitChatModel(engine=native, model="gpt-4o")


def test_profile_is_the_engines_real_capacity(fresh: Callable[..., Engine]) -> None:
    small = fresh("native", device=96, host=0)  # the README's engine: 96 blocks of 16
    profile = ContextKitChatModel(engine=small).profile
    assert profile is not None
    assert profile["max_input_tokens"] == 96 * 16 == small.context_tokens
    assert profile["max_output_tokens"] == 96 * 16 - 1
    assert profile["tool_calling"] is False and profile["structured_output"] is False
    assert profile["image_inputs"] is False and profile["text_inputs"] is True
    short = fresh("native", device=512, host=0, max_positions=2048)
    assert ContextKitChatModel(engine=short).profile["max_input_tokens"] == 2048  # type: ignore[index]
    # what LangChain's summarization middleware needs to size its trigger
    middleware = SummarizationMiddleware(model=ContextKitChatModel(engine=small),
                                         trigger=("fraction", 0.8))
    assert middleware._get_profile_limits() == 96 * 16


def test_constructor_max_tokens_and_stop_are_honoured(native: Engine) -> None:
    full = ContextKitChatModel(engine=native, max_tokens=16).invoke(HI)
    assert "you" in full.text  # greedy: "Hello! How can I help you today?"-like
    cut = ContextKitChatModel(engine=native, max_tokens=16, stop=["you"]).invoke(HI)
    assert cut.text == full.text[:full.text.index("you")]
    assert cut.response_metadata["finish_reason"] == "stop"
    short = ContextKitChatModel(engine=native, max_tokens=3).invoke(HI)
    assert short.usage_metadata is not None and short.usage_metadata["output_tokens"] == 3
    assert short.response_metadata["finish_reason"] == "length"
    # a call's own setting wins over the constructor's
    assert ContextKitChatModel(engine=native, max_tokens=3).invoke(
        HI, max_tokens=16).text == full.text
    assert ContextKitChatModel(engine=native, max_tokens=16, stop=["you"]).invoke(
        HI, stop=["zzz"]).text == full.text


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_token": 3}, r"unknown setting 'max_token' \(did you mean 'max_tokens'\?\)"),
    ({"temprature": 0.2}, r"did you mean 'temperature'"),
    ({"max_retries": -1}, "max_retries"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1.0}, "temperature must be a number >= 0"),
    ({"top_p": 2.0}, r"top_p must be a number in \(0, 1\]"),
], ids=["typo", "typo2", "negative-retries", "zero-tokens", "temperature", "top_p"])
def test_settings_it_cannot_honour_are_refused(native: Engine, kwargs: dict[str, Any],
                                               message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ContextKitChatModel(engine=native, **kwargs)


def test_max_retries_is_accepted_as_every_chat_model_takes_it(native: Engine) -> None:
    """LangChain's standard parameters include max_retries; code written for another
    chat model passes it. Nothing goes over a network here, so nothing is retried."""
    model = ContextKitChatModel(engine=native, max_retries=5, max_tokens=2)
    assert model.max_retries == 5
    assert model.invoke(HI).content is not None


def test_unknown_call_settings_are_refused(native: Engine) -> None:
    model = ContextKitChatModel(engine=native, max_tokens=2)
    with pytest.raises(ValueError, match=r"unknown setting 'frequency_penalty'"):
        model.invoke(HI, frequency_penalty=0.5)
    with pytest.raises(ValueError, match="runs 'SmolLM2-135M-Instruct'"):
        model.invoke(HI, model="gpt-4o")


def test_temperature_samples_and_a_seed_repeats(native: Engine) -> None:
    greedy = ContextKitChatModel(engine=native, max_tokens=8).invoke(HI).text
    hot = ContextKitChatModel(engine=native, max_tokens=8, temperature=1.5, top_p=0.95,
                              seed=11)
    first = hot.invoke(HI).text
    assert hot.invoke(HI).text == first  # seeded: reproducible
    draws = {first, *(hot.invoke(HI, seed=s).text for s in (1, 2, 3))}
    assert len(draws | {greedy}) > 1  # the setting does something
    assert ContextKitChatModel(engine=native, max_tokens=8, top_k=1, temperature=1.5,
                               seed=5).invoke(HI).text == greedy


def test_token_counting_uses_the_engines_tokenizer(native: Engine) -> None:
    model = ContextKitChatModel(engine=native)
    assert model.get_num_tokens("Is checkout slow?") == len(native.encode("Is checkout slow?"))
    assert model.get_num_tokens("Is checkout slow?") > 0
    assert model.get_token_ids("Is checkout slow?") == native.encode("Is checkout slow?")
    messages = [SystemMessage("You are terse."), HumanMessage("Is checkout slow?"),
                AIMessage("No, p95 is 180 ms."), HumanMessage("And pricing?")]
    whole = model.get_num_tokens_from_messages(messages)
    prompt = native.tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in (("system", "You are terse."),
                                                ("user", "Is checkout slow?"),
                                                ("assistant", "No, p95 is 180 ms."),
                                                ("user", "And pricing?"))],
        add_generation_prompt=True, tokenize=True)
    prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
    assert whole == len(prompt)  # the exact prompt the engine runs
    trimmed = trim_messages(messages, max_tokens=whole - 5, token_counter=model,
                            strategy="last", include_system=True)
    assert 0 < len(trimmed) < len(messages)  # trimmed by real counts
    assert model.get_num_tokens_from_messages(trimmed) <= whole - 5


def test_an_image_block_is_refused_with_a_clear_error(native: Engine) -> None:
    model = ContextKitChatModel(engine=native, max_tokens=2)
    message = HumanMessage(content=[
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image", "url": "https://example.com/cat.png"}])
    with pytest.raises(ValueError, match=r"'image' content block.*text-only"):
        model.invoke([message])
    with pytest.raises(ValueError, match=r"'image_url' content block"):
        model.invoke([HumanMessage(content=[{"type": "image_url",
                                             "image_url": {"url": "data:image/png;base64,AA"}}])])
    # text blocks are read
    assert model.invoke([HumanMessage(content=[{"type": "text", "text": HI}])]).text


def test_timeout_bounds_a_call(native: Engine) -> None:
    model = ContextKitChatModel(engine=native, max_tokens=64, timeout=1e-9)
    with pytest.raises(TimeoutError, match="timeout="):
        model.invoke("Tell me a long story about the sea.")


def test_async_calls_run_off_the_event_loop(native: Engine) -> None:
    model = ContextKitChatModel(engine=native, max_tokens=6)
    expected = model.invoke(HI).text

    async def both() -> tuple[str, str]:
        reply = await model.ainvoke(HI)
        chunks = [c async for c in model.astream(HI)]
        return reply.text, "".join(str(c.content) for c in chunks)

    assert asyncio.run(both()) == (expected, expected)
