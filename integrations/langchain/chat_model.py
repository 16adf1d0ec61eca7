"""A LangChain chat model on contextkit's embedded engine (:class:`ContextKitChatModel`).

What it supports, as LangChain's standard tests see it (``tests/integrations/
test_langchain_standard.py`` runs ``ChatModelUnitTests`` and
``ChatModelIntegrationTests`` against it):

- ``invoke`` / ``ainvoke`` / ``stream`` / ``astream`` / ``batch`` / events; the async
  paths run the engine on a worker thread (the event loop keeps running; cancelling the
  task stops the generation after the current token);
- every LangChain standard parameter: ``model``, ``max_tokens``, ``stop``,
  ``temperature``, ``timeout`` at construction and per call, and ``max_retries`` and
  ``api_key`` (accepted and kept, unused: the engine runs in this process, so nothing
  goes over a network to retry or authenticate), plus ``top_p``, ``top_k``, ``seed`` and
  ``repetition_penalty`` (greedy unless ``temperature > 0``; a seed repeats a run);
- ``usage_metadata`` with ``cache_read`` (tokens reused from the cache) and
  ``cache_creation``, ``response_metadata`` with ``model_name``, TTFT and blocks per tier;
- ``profile``: the context window is what one request can really hold (the model's
  positions or the engine's device tier, whichever is fewer);
- token counting with the engine's own tokenizer (``get_num_tokens``,
  ``get_num_tokens_from_messages`` counts the exact chat-template prompt), so
  ``trim_messages(..., token_counter=model)`` and ``SummarizationMiddleware`` work offline.

What it refuses, with an error that says so: unknown settings (as pydantic's
``extra="forbid"``, with the nearest known name), a ``model`` other than the engine's,
image / audio / video / file content blocks (SmolLM2-135M-Instruct reads text only),
``bind_tools`` and ``with_structured_output`` (SmolLM2's chat template has no tool-call
format and its 135M weights do not produce reliable JSON; serve a tool-calling model
with vLLM instead).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, SystemMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field, SecretStr, model_validator

from contextkit.engine.engine import Engine
from contextkit.engine.sampling import SamplingParams
from contextkit.pipeline.pipeline import BuiltPrompt
from integrations._engine_chat import ChatRun, EngineChat, unknown_setting
from integrations.langchain.middleware import METADATA_KEY, pipeline_token

__all__ = ["ContextKitChatModel", "to_conversation"]

#: Content block types that carry something other than text: refused, not dropped.
MEDIA_BLOCKS = frozenset({"image", "image_url", "input_image", "audio", "input_audio",
                          "video", "file", "input_file", "document", "pdf", "media"})
#: Settings a call may pass (``model.invoke(..., max_tokens=8)``, ``model.bind(...)``).
CALL_SETTINGS = ("max_tokens", "max_new_tokens", "temperature", "top_p", "top_k", "seed",
                 "repetition_penalty", "timeout", "model")
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "repetition_penalty")
#: Why a setting other chat models take is refused here.
_REFUSED = {
    "base_url": "the model runs in this process on the engine; for a server use ChatOpenAI "
                "with ContextKitMiddleware",
}


def to_conversation(messages: Sequence[BaseMessage]) -> list[tuple[str, str]]:
    """``(role, text)`` pairs of LangChain messages (tool calls rendered as text).

    Raises:
        ValueError: a message holds an image, audio, video or file content block (the
            model reads text only; nothing is dropped silently).
    """
    roles = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool",
             "function": "tool"}
    out = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            for block in m.content:
                kind = block.get("type") if isinstance(block, Mapping) else None
                if kind in MEDIA_BLOCKS:
                    raise ValueError(
                        f"message {i} ({m.type}) has an {kind!r} content block, but "
                        "ContextKitChatModel's model is text-only (SmolLM2-135M-Instruct "
                        "reads no images, audio, video or files): send the content as "
                        "text, or use a multimodal model for it")
        role = roles.get(m.type) or str(getattr(m, "role", "user"))
        text = str(m.text)
        calls = getattr(m, "tool_calls", None)
        if calls:
            rendered = "\n".join(f"[tool call] {c['name']}({c.get('args', {})})" for c in calls)
            text = f"{text}\n{rendered}" if text else rendered
        out.append((role, text))
    return out


def _unknown(name: str, known: Sequence[str]) -> str:
    return unknown_setting(name, known, "ContextKitChatModel", _REFUSED)


class ContextKitChatModel(BaseChatModel):
    """A LangChain chat model running on contextkit's embedded engine.

    Its fields are passed by keyword: ``ContextKitChatModel(engine=engine)``; any other
    keyword is refused (see the module's docstring for what is supported).

    Attributes:
        engine: the :class:`~contextkit.engine.engine.Engine` (e.g. ``Engine.from_pretrained()``).
        pipeline: the pipeline the :class:`~integrations.langchain.middleware.ContextKitMiddleware`
            uses; with it, system messages the middleware built are laid out the
            pipeline's way.
        model_name: the engine's model (alias ``model``); another name is refused.
        tenant: tenant for prompts that did not come through the middleware.
        max_tokens: reply length limit (``model.bind(max_tokens=...)`` per call).
        stop: stop strings (a call's ``stop`` replaces them).
        temperature: ``None`` or 0 greedy; above 0 sampled (with ``top_p``, ``top_k``,
            ``seed``, ``repetition_penalty``: :class:`~contextkit.engine.sampling.SamplingParams`).
        timeout: seconds a call may take (checked after every token; then ``TimeoutError``).
        max_retries: LangChain's standard parameter, accepted so code written for any
            chat model runs unchanged; the engine runs in this process and makes no
            network call, so there is nothing to retry (a failed call raises at once).
        api_key: accepted for the same reason and never used or serialized.
        streaming: stream through ``invoke`` callbacks too.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid",
                              populate_by_name=True, protected_namespaces=())

    engine: Any = Field(exclude=True)
    pipeline: Any = Field(default=None, exclude=True)
    model_name: str | None = Field(default=None, alias="model")
    tenant: str | None = None
    max_tokens: int = Field(default=128, ge=1)
    stop: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    timeout: float | None = Field(default=None, gt=0)
    max_retries: int = Field(default=2, ge=0)
    api_key: SecretStr | None = Field(default=None, exclude=True)
    streaming: bool = False

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            known = [*cls.model_fields, "model"]
            for name in data:
                if name not in known:
                    raise ValueError(_unknown(str(name), [k for k in known
                                                          if k != "model_name"]))
        return data

    @model_validator(mode="after")
    def _check_engine(self) -> ContextKitChatModel:
        if not isinstance(self.engine, Engine):
            raise TypeError("engine must be a contextkit Engine (Engine.from_pretrained())")
        if self.model_name is None:
            self.model_name = self.engine.model_id
        elif self.model_name != self.engine.model_id:
            raise ValueError(f"model {self.model_name!r} is not the engine's: the engine runs "
                             f"{self.engine.model_id!r}; leave model out or load that model "
                             "with Engine.from_pretrained(model_dir)")
        self._sampling({})  # checks the ranges now
        return self

    # ------------------------------------------------------------------ identity
    @property
    def _llm_type(self) -> str:
        return "contextkit"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "max_tokens": self.max_tokens,
                **{k: getattr(self, k) for k in _SAMPLING if getattr(self, k) is not None}}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> Any:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "contextkit"
        model = kwargs.get("model")
        params["ls_model_name"] = model if isinstance(model, str) else str(self.model_name)
        if "ls_temperature" not in params:
            params["ls_temperature"] = 0.0  # greedy
        if stop is None and self.stop:
            params["ls_stop"] = list(self.stop)
        return params

    def _resolve_model_profile(self) -> Any:
        window = int(self.engine.context_tokens)
        media = ("image_inputs", "image_url_inputs", "pdf_inputs", "audio_inputs",
                 "video_inputs", "image_tool_message", "pdf_tool_message", "image_outputs",
                 "audio_outputs", "video_outputs")
        return {"name": str(self.engine.model_id), "open_weights": True,
                "max_input_tokens": window, "max_output_tokens": window - 1,
                "text_inputs": True, "text_outputs": True, "temperature": True,
                "tool_calling": False, "tool_choice": False, "tool_call_streaming": False,
                "structured_output": False, "reasoning_output": False,
                "mid_conversation_system_messages": True, **dict.fromkeys(media, False)}

    # ------------------------------------------------------------------ tokens
    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of ``text`` with the engine's tokenizer (no download)."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        return self.engine.encode(text)

    def get_num_tokens(self, text: str) -> int:
        return len(self.get_token_ids(text))

    def get_num_tokens_from_messages(self, messages: list[BaseMessage],
                                     tools: Sequence[Any] | None = None) -> int:
        """The prompt tokens of ``messages`` as the engine runs them: the model's chat
        template with the assistant header (a pipeline-built system prompt is laid out
        differently and counted by the pipeline's report)."""
        if tools:
            raise NotImplementedError("ContextKitChatModel does not call tools, so a prompt "
                                      "with tools is not one it runs; count without tools")
        return len(self._chat().prompt_ids(to_conversation(messages)))

    # ------------------------------------------------------------------ refused
    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Any:
        raise NotImplementedError(
            "ContextKitChatModel does not call tools: the embedded SmolLM2 has no tool-call "
            "format. Use create_agent(model, tools=[]), or serve a tool-calling model with "
            "vLLM and contextkit's KV connector")

    def with_structured_output(self, schema: Any, *, include_raw: bool = False,
                               **kwargs: Any) -> Any:
        raise NotImplementedError(
            "ContextKitChatModel has no structured output: SmolLM2-135M-Instruct has no "
            "tool-call format and no JSON-constrained decoding here. Ask for the fields in "
            "the prompt and parse the text, or serve a model that supports json_schema")

    # ------------------------------------------------------------------ running
    def _chat(self) -> EngineChat:
        return EngineChat(self.engine, self.pipeline, self.tenant)

    def _sampling(self, kwargs: Mapping[str, Any]) -> SamplingParams | None:
        values = {k: kwargs[k] if kwargs.get(k) is not None else getattr(self, k)
                  for k in _SAMPLING}
        given = {k: v for k, v in values.items() if v is not None}
        return SamplingParams(**given) if given else None

    def _plan(self, messages: list[BaseMessage]) -> tuple[list[tuple[str, str]],
                                                          BuiltPrompt | None, str | None]:
        conv = to_conversation(messages)
        first = messages[0] if messages else None
        meta = first.additional_kwargs.get(METADATA_KEY) if isinstance(first, SystemMessage) \
            else None
        if not meta or self.pipeline is None or not self.pipeline.attached:
            return conv, None, None
        if meta.get("pipeline") != pipeline_token(self.pipeline):
            return conv, None, meta.get("tenant")
        built = self.pipeline.last_built(meta["tenant"])
        if built is None or first is None or built.text != first.text:  # stale: lay it out plainly
            return conv, None, meta["tenant"]
        return conv, built, meta["tenant"]

    def _run_kwargs(self, messages: list[BaseMessage], stop: list[str] | None,
                    kwargs: Mapping[str, Any]) -> tuple[list[tuple[str, str]], dict[str, Any]]:
        for name in kwargs:
            if name not in CALL_SETTINGS and not name.startswith("ls_"):
                raise ValueError(_unknown(name, CALL_SETTINGS))
        model = kwargs.get("model")
        if model is not None and model != self.model_name:
            raise ValueError(f"model {model!r} is not the engine's: the engine runs "
                             f"{self.model_name!r}; one ContextKitChatModel runs one model")
        conv, built, tenant = self._plan(messages)
        max_new = int(kwargs.get("max_tokens") or kwargs.get("max_new_tokens") or self.max_tokens)
        timeout = kwargs.get("timeout") or self.timeout
        return conv, {"built": built, "tenant": tenant or self.tenant,  # None: the rule
                      "max_new_tokens": max_new,
                      "stop": list(stop if stop is not None else self.stop or []),
                      "sampling": self._sampling(kwargs), "timeout": timeout}

    def _message(self, run: ChatRun) -> AIMessage:
        return AIMessage(content=run.text, usage_metadata=run.usage(),
                         response_metadata=run.metadata(str(self.model_name)))

    def _chunk(self, item: str | ChatRun) -> ChatGenerationChunk:
        if isinstance(item, str):
            return ChatGenerationChunk(message=AIMessageChunk(content=item))
        return ChatGenerationChunk(message=AIMessageChunk(
            content="", usage_metadata=item.usage(),  # type: ignore[arg-type]
            response_metadata=item.metadata(str(self.model_name)), chunk_position="last"))

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None,
                  **kwargs: Any) -> ChatResult:
        conv, run_kw = self._run_kwargs(messages, stop, kwargs)
        run = self._chat().run(conv, **run_kw)
        return ChatResult(generations=[ChatGeneration(message=self._message(run))])

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> ChatResult:
        conv, run_kw = self._run_kwargs(messages, stop, kwargs)
        run = await self._chat().arun(conv, **run_kw)
        return ChatResult(generations=[ChatGeneration(message=self._message(run))])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        conv, run_kw = self._run_kwargs(messages, stop, kwargs)
        for item in self._chat().stream(conv, **run_kw):
            chunk = self._chunk(item)
            if isinstance(item, str) and run_manager is not None:
                run_manager.on_llm_new_token(item, chunk=chunk)
            yield chunk

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        conv, run_kw = self._run_kwargs(messages, stop, kwargs)
        async for item in self._chat().astream(conv, **run_kw):
            chunk = self._chunk(item)
            if isinstance(item, str) and run_manager is not None:
                await run_manager.on_llm_new_token(item, chunk=chunk)
            yield chunk
