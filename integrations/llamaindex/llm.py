"""A LlamaIndex LLM on contextkit's embedded engine (:class:`ContextKitLLM`).

What it supports: ``chat`` / ``stream_chat`` / ``complete`` / ``stream_complete`` and
their async variants, which run the engine on a worker thread (the event loop keeps
running; cancelling the task stops the generation after the current token); ``stop``
strings on every path (per call or set on the LLM); sampling (``temperature``, ``top_p``,
``top_k``, ``seed``, ``repetition_penalty``; greedy by default); ``timeout``; the
metadata's ``context_window`` is what one request can really hold on the engine (its
model's positions or its device tier, whichever is fewer), so LlamaIndex's prompt helper
packs retrieved chunks to fit; ``tokenizer`` / ``count_tokens`` with the engine's own
tokenizer. Every call is recorded by the instrumentation events and legacy callbacks.

What it refuses, with an error that says so: unknown settings (with the nearest known
name), a prompt longer than the engine holds (:class:`~integrations._engine_chat.
ContextWindowError`, saying what to change), function calling (``is_function_calling_model``
is false: SmolLM2's chat template has no tool-call format, so LlamaIndex's
``FunctionAgent`` refuses it; ``ReActAgent`` works through plain text).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from pydantic import Field, PrivateAttr

from contextkit.engine.engine import Engine
from contextkit.engine.sampling import SamplingParams
from contextkit.pipeline.pipeline import CacheAwareContextPipeline
from contextkit.prompt.markup import has_markers
from integrations._call_log import usage_from
from integrations._engine_chat import ChatRun, EngineChat, unknown_setting

__all__ = ["ContextKitLLM"]

Builder = Callable[[Sequence[ChatMessage]], Any]
Conversation = list[tuple[str, str]]

_SAMPLING = ("temperature", "top_p", "top_k", "seed", "repetition_penalty")
#: Settings a call may pass (``llm.chat(messages, stop=[...])``).
CALL_SETTINGS = ("tenant", "stop", "max_new_tokens", "timeout", "formatted", *_SAMPLING)
#: What LlamaIndex's RAG users change when a prompt does not fit.
TOO_LONG = ("LlamaIndex packs prompts by metadata.context_window but counts with "
            "Settings.tokenizer (tiktoken by default, fewer tokens than this model's): set "
            "Settings.tokenizer = llm.tokenizer, or lower similarity_top_k or the chunk size, "
            "or give the engine more num_device_blocks")


def _conversation(messages: Sequence[ChatMessage]) -> Conversation:
    roles = {"system": "system", "developer": "system", "user": "user",
             "assistant": "assistant", "tool": "tool", "function": "tool",
             "chatbot": "assistant", "model": "assistant"}
    out = []
    for m in messages:
        role = m.role.value if isinstance(m.role, MessageRole) else str(m.role)
        out.append((roles.get(role, "user"), m.content or ""))
    return out


def _usage_raw(run: ChatRun, model_name: str) -> dict[str, Any]:
    u = run.usage()
    return {"usage": {"prompt_tokens": u["input_tokens"], "completion_tokens": u["output_tokens"],
                      "total_tokens": u["total_tokens"],
                      "prompt_tokens_details": {"cached_tokens": run.generation.reused_tokens}},
            **run.metadata(model_name)}


class ContextKitLLM(CustomLLM):
    """A LlamaIndex LLM on contextkit's embedded engine (see the module's docstring for
    what it supports and refuses).

    Args:
        engine: the :class:`~contextkit.engine.engine.Engine`.
        pipeline: builds layered system prompts (optional).
        build_system_message: called with the chat messages on every chat; its
            result (marker string, mapping or StructuredPrompt) replaces the system
            message. Default: the incoming system message when it has markers.
        **kwargs: the attributes below, and LlamaIndex's own (``callback_manager``...).

    Attributes:
        tenant: the tenant of this LLM's blocks.
        max_new_tokens: reply length limit.
        stop: stop strings for every call (a call's ``stop`` replaces them).
        temperature: ``None`` or 0 greedy; above 0 sampled, with ``top_p``, ``top_k``,
            ``seed`` and ``repetition_penalty``
            (:class:`~contextkit.engine.sampling.SamplingParams`).
        timeout: seconds a call may take (checked after every token; then ``TimeoutError``).

    Raises:
        TypeError: ``engine`` is not a contextkit Engine.
        ValueError: an unknown setting, or one out of range.
    """

    max_new_tokens: int = Field(default=128, ge=1, description="reply length limit")
    tenant: str | None = Field(default=None, description="tenant of this LLM's blocks")
    stop: list[str] | None = Field(default=None, description="stop strings of every call")
    temperature: float | None = Field(default=None, description="0/None greedy")
    top_p: float | None = Field(default=None, description="nucleus sampling")
    top_k: int | None = Field(default=None, description="top-k sampling")
    seed: int | None = Field(default=None, description="seed of sampled runs")
    repetition_penalty: float | None = Field(default=None, description="> 1 penalizes repeats")
    timeout: float | None = Field(default=None, gt=0, description="seconds a call may take")
    _engine: Engine = PrivateAttr()
    _pipeline: CacheAwareContextPipeline | None = PrivateAttr(default=None)
    _builder: Builder | None = PrivateAttr(default=None)
    _chat_runner: EngineChat = PrivateAttr()

    def __init__(self, engine: Engine, *, pipeline: CacheAwareContextPipeline | None = None,
                 build_system_message: Builder | None = None, **kwargs: Any) -> None:
        if not isinstance(engine, Engine):
            raise TypeError("engine must be a contextkit Engine (Engine.from_pretrained())")
        known = [name for name in type(self).model_fields if not name.startswith("_")]
        for name in kwargs:
            if name not in known:
                raise ValueError(unknown_setting(name, [*known, "pipeline",
                                                        "build_system_message"],
                                                 "ContextKitLLM"))
        super().__init__(**kwargs)
        self._engine = engine
        self._pipeline = pipeline
        self._builder = build_system_message
        self._chat_runner = EngineChat(engine, pipeline, self.tenant, too_long_hint=TOO_LONG)
        self._sampling({})  # checks the ranges now

    @classmethod
    def class_name(cls) -> str:
        return "ContextKitLLM"

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def pipeline(self) -> CacheAwareContextPipeline | None:
        return self._pipeline

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self._chat_runner.context_tokens,
                           num_output=self.max_new_tokens, is_chat_model=True,
                           is_function_calling_model=False,
                           model_name=self._chat_runner.model_name)

    @property
    def tokenizer(self) -> Callable[[str], list[int]]:
        """The engine's tokenizer as LlamaIndex takes one (``Settings.tokenizer =
        llm.tokenizer``: prompts are packed by this model's own counts)."""
        return self._engine.encode

    def count_tokens(self, text: str) -> int:
        """Token count with the engine's tokenizer (for LlamaIndex memory buffers)."""
        return self._engine.count_tokens(text)

    def memory(self, token_limit: int | None = None) -> Any:
        """A ``ChatMemoryBuffer`` that counts with the engine's tokenizer (no download)."""
        from llama_index.core.memory import ChatMemoryBuffer

        limit = token_limit or self.metadata.context_window - self.max_new_tokens
        return ChatMemoryBuffer.from_defaults(token_limit=limit, tokenizer_fn=self._engine.encode)

    def _raw(self, run: ChatRun) -> dict[str, Any]:
        return _usage_raw(run, self._chat_runner.model_name)

    # ------------------------------------------------------------------ settings
    def _sampling(self, kwargs: Mapping[str, Any]) -> SamplingParams | None:
        values = {k: kwargs[k] if kwargs.get(k) is not None else getattr(self, k)
                  for k in _SAMPLING}
        given = {k: v for k, v in values.items() if v is not None}
        return SamplingParams(**given) if given else None

    def _run_kwargs(self, kwargs: Mapping[str, Any], tenant: str) -> dict[str, Any]:
        for name in kwargs:
            if name not in CALL_SETTINGS:
                raise ValueError(unknown_setting(name, CALL_SETTINGS, "a ContextKitLLM call"))
        stop = kwargs.get("stop")
        if stop is None:
            stop = self.stop or []
        return {"tenant": tenant,
                "max_new_tokens": int(kwargs.get("max_new_tokens") or self.max_new_tokens),
                "stop": [stop] if isinstance(stop, str) else list(stop),
                "sampling": self._sampling(kwargs),
                "timeout": kwargs.get("timeout") or self.timeout}

    def _prepare(self, messages: Sequence[ChatMessage], kwargs: Mapping[str, Any]
                 ) -> tuple[Conversation, dict[str, Any]]:
        conv = _conversation(messages)
        tenant = self._chat_runner.resolve_tenant(kwargs.get("tenant"))
        built = None
        pipeline = self._pipeline
        if pipeline is not None and pipeline.attached:
            raw: Any = None
            if self._builder is not None:
                raw = self._builder(messages)
            elif conv and conv[0][0] == "system" and has_markers(conv[0][1], pipeline.config):
                raw = conv[0][1]
            if raw is not None:  # EngineChat.run lays out ``built`` in place of conv[0]
                built = pipeline.build(raw, tenant=tenant)
        return conv, {"built": built, **self._run_kwargs(kwargs, tenant)}

    def _prepare_prompt(self, prompt: str, kwargs: Mapping[str, Any]
                        ) -> tuple[Conversation, dict[str, Any]]:
        # The prompt is sent as one user message through the chat template (SmolLM2 is
        # an instruct model); ``formatted`` is accepted for the interface.
        tenant = self._chat_runner.resolve_tenant(kwargs.get("tenant"))
        return [("user", prompt)], self._run_kwargs(kwargs, tenant)

    # ------------------------------------------------------------------ responses
    def _chat_response(self, item: str | ChatRun, text: str,
                       streamed: bool = True) -> ChatResponse:
        message = ChatMessage(role=MessageRole.ASSISTANT, content=text)
        if isinstance(item, str):
            return ChatResponse(message=message, delta=item)
        return ChatResponse(message=message, delta="" if streamed else None, raw=self._raw(item),
                            additional_kwargs=dict(usage_from(item.usage())))

    def _completion(self, item: str | ChatRun, text: str) -> CompletionResponse:
        if isinstance(item, str):
            return CompletionResponse(text=text, delta=item)
        return CompletionResponse(text=text, delta="", raw=self._raw(item),
                                  additional_kwargs=dict(usage_from(item.usage())))

    # ------------------------------------------------------------------ chat
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        conv, run_kw = self._prepare(messages, kwargs)
        run = self._chat_runner.run(conv, **run_kw)
        return self._chat_response(run, run.text, streamed=False)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        conv, run_kw = self._prepare(messages, kwargs)

        def gen() -> ChatResponseGen:
            text = ""
            for item in self._chat_runner.stream(conv, **run_kw):
                text = text + item if isinstance(item, str) else item.text
                yield self._chat_response(item, text)

        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        conv, run_kw = self._prepare(messages, kwargs)
        run = await self._chat_runner.arun(conv, **run_kw)
        return self._chat_response(run, run.text, streamed=False)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage],
                           **kwargs: Any) -> ChatResponseAsyncGen:
        conv, run_kw = self._prepare(messages, kwargs)

        async def gen() -> ChatResponseAsyncGen:
            text = ""
            async for item in self._chat_runner.astream(conv, **run_kw):
                text = text + item if isinstance(item, str) else item.text
                yield self._chat_response(item, text)

        return gen()

    # ------------------------------------------------------------------ completion
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        conv, run_kw = self._prepare_prompt(prompt, kwargs)
        run = self._chat_runner.run(conv, **run_kw)
        return self._completion(run, run.text)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False,
                        **kwargs: Any) -> CompletionResponseGen:
        conv, run_kw = self._prepare_prompt(prompt, kwargs)

        def gen() -> CompletionResponseGen:
            text = ""
            for item in self._chat_runner.stream(conv, **run_kw):
                text = text + item if isinstance(item, str) else item.text
                yield self._completion(item, text)

        return gen()

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False,
                        **kwargs: Any) -> CompletionResponse:
        conv, run_kw = self._prepare_prompt(prompt, kwargs)
        run = await self._chat_runner.arun(conv, **run_kw)
        return self._completion(run, run.text)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        conv, run_kw = self._prepare_prompt(prompt, kwargs)

        async def gen() -> CompletionResponseAsyncGen:
            text = ""
            async for item in self._chat_runner.astream(conv, **run_kw):
                text = text + item if isinstance(item, str) else item.text
                yield self._completion(item, text)

        return gen()
