"""LangChain's own standard tests (``langchain-tests``) against ContextKitChatModel on the
embedded engine (the packaged SmolLM2, native K/V: the fastest decode on CPU).

Every capability the class lacks is declared below, and each is one it really lacks
(the refusals are tested in test_langchain_settings.py): tool calling and structured
output (SmolLM2's chat template has no tool-call format), a per-call model override
(one engine runs one model), multimodal inputs (a text-only model), serialization (the
engine is a live object), environment-based setup (the engine is passed in) and VCR
recordings (no HTTP traffic to record).
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from contextkit.engine.engine import Engine
from integrations.langchain import ContextKitChatModel

#: The engine the suites' models run on (set per module by the fixture below).
_ENGINES: dict[str, Engine] = {}


@pytest.fixture(scope="module", autouse=True)
def standard_engine(engine: Engine) -> Engine:
    _ENGINES["engine"] = engine.sibling("native", num_device_blocks=256, num_host_blocks=0)
    return _ENGINES["engine"]


class ContextKitStandard:
    """What both suites share: the class, its parameters, its declared capabilities."""

    @property
    def chat_model_class(self) -> type[ContextKitChatModel]:
        return ContextKitChatModel

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # The suite's standard parameters (max_tokens 100, timeout 60, max_retries 2,
        # ...) are used as they are.
        return {"engine": _ENGINES["engine"]}

    @property
    def has_tool_calling(self) -> bool:
        return False  # bind_tools raises: no tool-call format in SmolLM2's template

    @property
    def has_structured_output(self) -> bool:
        return False  # with_structured_output raises

    @property
    def supports_model_override(self) -> bool:
        return False  # one engine runs one model; another name is refused

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        details = ["cache_read_input", "cache_creation_input"]
        return {"invoke": details, "stream": details}


class TestContextKitChatModelUnit(ContextKitStandard, ChatModelUnitTests):
    """``test_init_from_env`` skips ("init_from_env_params not specified"): the class
    reads no environment variables, the engine is passed in."""


class TestContextKitChatModelIntegration(ContextKitStandard, ChatModelIntegrationTests):
    """``test_stream_time`` skips ("VCR not set up"): the embedded engine makes no HTTP
    calls, so there is nothing for VCR to record."""

    def _twice(self, stream: bool) -> AIMessage:
        model = self.chat_model_class(**self.chat_model_params, max_tokens=4)
        prompt = "Name three colors of the rainbow, please, in order."
        model.invoke(prompt)  # the second call reuses the first one's blocks
        if not stream:
            return model.invoke(prompt)
        full: Any = None
        for chunk in model.stream(prompt):
            full = chunk if full is None else full + chunk
        return full

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        reply = self._twice(stream)
        assert reply.usage_metadata is not None
        assert reply.usage_metadata["input_token_details"]["cache_read"] > 0  # type: ignore[typeddict-item]
        return reply

    def invoke_with_cache_creation_input(self, *, stream: bool = False) -> AIMessage:
        reply = self._twice(stream)
        assert reply.usage_metadata is not None
        assert reply.usage_metadata["input_token_details"]["cache_creation"] > 0  # type: ignore[typeddict-item]
        return reply
