"""LlamaIndex: an LLM on the engine, an instrumentation event handler, a legacy callback.

Adopting contextkit in a LlamaIndex chat engine::

    from llama_index.core.chat_engine import SimpleChatEngine
    from llama_index.core.instrumentation import get_dispatcher
    from contextkit import CacheAwareContextPipeline, Engine
    from integrations.llamaindex import ContextKitEventHandler, ContextKitLLM

    engine = Engine.from_pretrained()
    pipeline = CacheAwareContextPipeline(engine)
    llm = ContextKitLLM(engine, pipeline=pipeline, build_system_message=build_system_message)
    handler = ContextKitEventHandler()
    get_dispatcher().add_event_handler(handler)
    chat = SimpleChatEngine.from_defaults(llm=llm, memory=llm.memory())
    chat.chat("What changed since the deploy?")

- :class:`ContextKitLLM` runs chat messages on the embedded engine. A system
  message with ``[LAYER]`` markers (or the output of ``build_system_message``,
  called on every chat) goes through the pipeline: budgets, volatility order,
  layer-tagged blocks, pinned stable prefix. Responses carry OpenAI-shaped usage
  in ``raw["usage"]`` (``prompt_tokens_details.cached_tokens`` = reused tokens).
- :class:`ContextKitOpenAILike` wraps an OpenAI-compatible LLM (``OpenAILike(
  is_chat_model=True)`` or ``OpenAI``) pointed at a vLLM server: with a pipeline
  attached to the served model (:class:`~contextkit.pipeline.served.model.ServedModel`) it lays each
  chat out as the embedded engine does (volatile layers in a trailing system message
  after the history), sends the request fields of contextkit's vLLM connector in
  ``extra_body`` (layer, importance and pin of every token range, ``cache_salt`` = the
  tenant) and records the server's usage in the call's report.
- :class:`ContextKitEventHandler` (instrumentation, ``LLMChatStartEvent`` /
  ``LLMChatEndEvent``) and :class:`ContextKitLlamaCallbackHandler` (legacy
  ``CBEventType.LLM``) record layers, usage and cache reads for any LLM.

Requires the ``llamaindex`` extra (``pip install 'contextkit[llamaindex]'``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from contextkit.config.errors import require

require("llama_index.core", "llamaindex")

from llama_index.core.base.llms.types import (  # noqa: E402
    ChatMessage,
    ChatResponse,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.callbacks import CBEventType, EventPayload  # noqa: E402
from llama_index.core.callbacks.base_handler import (  # noqa: E402
    BaseCallbackHandler as LlamaBaseCallbackHandler,
)
from llama_index.core.instrumentation.event_handlers import BaseEventHandler  # noqa: E402
from llama_index.core.instrumentation.events import BaseEvent  # noqa: E402
from llama_index.core.instrumentation.events.llm import (  # noqa: E402
    LLMChatEndEvent,
    LLMChatStartEvent,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback  # noqa: E402
from llama_index.core.llms.custom import CustomLLM  # noqa: E402
from pydantic import Field, PrivateAttr  # noqa: E402

from contextkit.engine.engine import Engine  # noqa: E402
from contextkit.pipeline.pipeline import BuiltPrompt, CacheAwareContextPipeline, CallReport  # noqa: E402
from contextkit.pipeline.served.model import LabelRangeError  # noqa: E402
from contextkit.prompt.markup import has_markers  # noqa: E402
from integrations._common import (  # noqa: E402
    CallLog,
    ChatRun,
    EngineChat,
    LogView,
    layers_in,
    usage_from,
)
from integrations._openai_compat import (  # noqa: E402
    merge_extra_body,
    record_served_usage,
    system_texts,
    trailing_index,
)

__all__ = [
    "ContextKitEventHandler",
    "ContextKitLLM",
    "ContextKitLlamaCallbackHandler",
    "ContextKitOpenAILike",
]

Builder = Callable[[Sequence[ChatMessage]], Any]


def _conversation(messages: Sequence[ChatMessage]) -> list[tuple[str, str]]:
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
    """A LlamaIndex LLM on contextkit's embedded engine (greedy decoding, streaming).

    Args:
        engine: the :class:`~contextkit.engine.engine.Engine`.
        pipeline: builds layered system prompts (optional).
        build_system_message: called with the chat messages on every chat; its
            result (marker string, mapping or StructuredPrompt) replaces the system
            message. Default: the incoming system message when it has markers.
        tenant: the tenant of this LLM's blocks.
        max_new_tokens: reply length limit.
    """

    max_new_tokens: int = Field(default=128, description="reply length limit")
    tenant: str | None = Field(default=None, description="tenant of this LLM's blocks")
    _engine: Engine = PrivateAttr()
    _pipeline: CacheAwareContextPipeline | None = PrivateAttr(default=None)
    _builder: Builder | None = PrivateAttr(default=None)
    _chat_runner: EngineChat = PrivateAttr()

    def __init__(self, engine: Engine, *, pipeline: CacheAwareContextPipeline | None = None,
                 build_system_message: Builder | None = None, tenant: str | None = None,
                 max_new_tokens: int = 128, **kwargs: Any) -> None:
        if not isinstance(engine, Engine):
            raise TypeError("engine must be a contextkit Engine (Engine.from_pretrained())")
        super().__init__(max_new_tokens=max_new_tokens, tenant=tenant, **kwargs)
        self._engine = engine
        self._pipeline = pipeline
        self._builder = build_system_message
        self._chat_runner = EngineChat(engine, pipeline, tenant)

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
        return LLMMetadata(context_window=int(self._engine.model.max_positions),
                           num_output=self.max_new_tokens, is_chat_model=True,
                           model_name=self._chat_runner.model_name)

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

    # ------------------------------------------------------------------ chat
    def _prepare(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]
                 ) -> tuple[list[tuple[str, str]], dict[str, Any]]:
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
        stop = kwargs.get("stop") or []
        return conv, {"built": built, "tenant": tenant,
                      "max_new_tokens": int(kwargs.get("max_new_tokens") or self.max_new_tokens),
                      "stop": [stop] if isinstance(stop, str) else list(stop)}

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        conv, run_kw = self._prepare(messages, kwargs)
        run = self._chat_runner.run(conv, **run_kw)
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=run.text),
                            raw=self._raw(run), additional_kwargs=dict(usage_from(run.usage())))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        conv, run_kw = self._prepare(messages, kwargs)

        def gen() -> ChatResponseGen:
            text = ""
            for item in self._chat_runner.stream(conv, **run_kw):
                if isinstance(item, str):
                    text += item
                    yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT,
                                                           content=text), delta=item)
                else:
                    yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT,
                                                           content=item.text),
                                       delta="", raw=self._raw(item),
                                       additional_kwargs=dict(usage_from(item.usage())))

        return gen()

    # ------------------------------------------------------------------ completion
    # The prompt is sent as one user message through the chat template (SmolLM2 is
    # an instruct model); ``formatted`` is accepted for the interface.
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        run = self._chat_runner.run([("user", prompt)], tenant=kwargs.get("tenant") or self.tenant,
                                    max_new_tokens=int(kwargs.get("max_new_tokens")
                                                       or self.max_new_tokens))
        return CompletionResponse(text=run.text, raw=self._raw(run))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False,
                        **kwargs: Any) -> CompletionResponseGen:
        def gen() -> CompletionResponseGen:
            text = ""
            for item in self._chat_runner.stream(
                    [("user", prompt)], tenant=kwargs.get("tenant") or self.tenant,
                    max_new_tokens=int(kwargs.get("max_new_tokens") or self.max_new_tokens)):
                if isinstance(item, str):
                    text += item
                    yield CompletionResponse(text=text, delta=item)
                else:
                    yield CompletionResponse(text=item.text, delta="", raw=self._raw(item))

        return gen()


# ---------------------------------------------------------------------------- vLLM server
def _role(message: ChatMessage) -> str:
    return message.role.value if isinstance(message.role, MessageRole) else str(message.role)


class ContextKitOpenAILike(CustomLLM):
    """An OpenAI-compatible LlamaIndex LLM laid out and labelled by a pipeline attached to
    the model a vLLM server serves.

    Args:
        llm: ``OpenAILike(model=<served name>, api_base=".../v1", is_chat_model=True)``
            (or ``OpenAI``); it sends the requests.
        pipeline: ``CacheAwareContextPipeline(served=ServedModel(model_dir, name=...))``.
        build_system_message: called with the chat messages on every chat; its result
            (marker string, mapping or StructuredPrompt) replaces the system message.
            Default: the incoming system message when it has markers (otherwise the
            chat goes to ``llm`` unchanged, without labels).
        tenant: the tenant of this LLM's calls (default: the pipeline's rule); a
            ``tenant=`` call argument wins. Sent as ``cache_salt``.
        trailing_system: put the volatile layers in a second system message after the
            history (default); ``False`` keeps every layer in the leading one.

    Every chat sends the pipeline's layout and, in ``extra_body``,
    :meth:`~contextkit.pipeline.pipeline.CacheAwareContextPipeline.request_fields` computed on
    exactly the message dicts LlamaIndex sends (its converter joins a message's text
    blocks with ``""``); ``llm.additional_kwargs["extra_body"]`` and a per-call
    ``extra_body`` are kept underneath. The usage the server reports (non-streaming, or
    a stream with ``stream_options={"include_usage": True}``) is recorded in the
    call's report (``pipeline.last_report(tenant)``).

    Raises:
        ValueError: ``llm`` is not a chat model (``OpenAILike(is_chat_model=False)``
            would send ``/v1/completions``) or the pipeline has no served model.
    """

    tenant: str | None = Field(default=None, description="tenant of this LLM's calls")
    trailing_system: bool = Field(default=True, description="volatile layers after history")
    _llm: Any = PrivateAttr()
    _pipeline: CacheAwareContextPipeline = PrivateAttr()
    _builder: Builder | None = PrivateAttr(default=None)
    _extra_body: dict[str, Any] = PrivateAttr(default_factory=dict)

    def __init__(self, llm: Any, pipeline: CacheAwareContextPipeline, *,
                 build_system_message: Builder | None = None, tenant: str | None = None,
                 trailing_system: bool = True, **kwargs: Any) -> None:
        if pipeline.served is None:
            raise ValueError("ContextKitOpenAILike needs a pipeline attached to the served "
                             "model: CacheAwareContextPipeline(served=ServedModel(model_dir))")
        if not getattr(getattr(llm, "metadata", None), "is_chat_model", False):
            raise ValueError("the LLM is not a chat model, so it would send /v1/completions "
                             "without the chat template; use OpenAILike(..., "
                             "is_chat_model=True)")
        super().__init__(tenant=tenant, trailing_system=trailing_system, **kwargs)
        own = dict(getattr(llm, "additional_kwargs", None) or {})
        if "extra_body" in own:  # it would override the per-call value: send it ourselves
            self._extra_body = dict(own.pop("extra_body") or {})
            llm = llm.model_copy(update={"additional_kwargs": own})
        self._llm = llm
        self._pipeline = pipeline
        self._builder = build_system_message

    @classmethod
    def class_name(cls) -> str:
        return "ContextKitOpenAILike"

    @property
    def llm(self) -> Any:
        return self._llm

    @property
    def pipeline(self) -> CacheAwareContextPipeline:
        return self._pipeline

    @property
    def metadata(self) -> LLMMetadata:
        return self._llm.metadata

    def prepare(self, messages: Sequence[ChatMessage], *, tenant: str | None = None,
                tools: Sequence[Any] | None = None, extra_body: Any = None
                ) -> tuple[list[ChatMessage], dict[str, Any], CallReport | None]:
        """``(messages, extra_body, report)`` of one chat: the pipeline's layout, the
        fields for the server, the call's report (``None``: nothing built, unchanged).

        Raises:
            LabelRangeError: the LLM's model is not the served model, or the messages
                cannot be labelled exactly.
        """
        pipeline = self._pipeline
        tenant = pipeline.resolve_tenant(tenant or self.tenant)
        msgs = list(messages)
        raw: Any = None
        if self._builder is not None:
            raw = self._builder(msgs)
        elif msgs and _role(msgs[0]) == "system" and has_markers(msgs[0].content or "",
                                                                 pipeline.config):
            raw = msgs[0].content
        extra = merge_extra_body(self._extra_body, extra_body)
        if raw is None:
            return msgs, extra, None
        conv = msgs[1:] if msgs and _role(msgs[0]) == "system" else msgs
        built = pipeline.build(raw, tenant=tenant)
        out = self._layout(built, conv)
        fields = self._fields(out, tenant, built, tools)
        return out, merge_extra_body(extra, fields), built.report

    def _layout(self, built: BuiltPrompt, conv: list[ChatMessage]) -> list[ChatMessage]:
        main, trailing = system_texts(built, self.trailing_system)
        out = list(conv)
        if trailing:
            out.insert(trailing_index([_role(m) for m in out]),
                       ChatMessage(role=MessageRole.SYSTEM, content=trailing))
        # the main message is sent even when empty, so no chat template injects its
        # default system prompt
        return [ChatMessage(role=MessageRole.SYSTEM, content=main), *out]

    def _fields(self, messages: list[ChatMessage], tenant: str, built: BuiltPrompt,
                tools: Sequence[Any] | None) -> dict[str, Any]:
        from llama_index.llms.openai.utils import to_openai_message_dicts

        served = self._pipeline.served
        assert served is not None
        model = getattr(self._llm, "model", None)
        if isinstance(model, str) and model != served.name:
            raise LabelRangeError(
                f"the LLM asks for model {model!r} but the pipeline's ServedModel is "
                f"{served.name!r}; its token ranges would be another model's. Use "
                f"ServedModel(model_dir, name={model!r}) for the directory that server serves")
        sent = to_openai_message_dicts(messages, model=model)
        if isinstance(sent, str):  # the Responses API's input string
            raise LabelRangeError("this LLM sends OpenAI's Responses API, which contextkit's "
                                  "vLLM labels do not cover; use OpenAILike(is_chat_model=True)")
        return self._pipeline.request_fields([dict(m) for m in sent], tenant=tenant,
                                             built=built, tools=tools)

    def _call(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]
              ) -> tuple[list[ChatMessage], dict[str, Any], CallReport | None]:
        kwargs = dict(kwargs)
        msgs, extra, report = self.prepare(messages, tenant=kwargs.pop("tenant", None),
                                           tools=kwargs.get("tools"),
                                           extra_body=kwargs.pop("extra_body", None))
        if extra:
            kwargs["extra_body"] = extra
        return msgs, kwargs, report

    def _record(self, report: CallReport | None, response: Any) -> None:
        raw = getattr(response, "raw", None)
        usage = raw.get("usage") if isinstance(raw, dict) else getattr(raw, "usage", None)
        if usage is not None:
            record_served_usage(self._pipeline, report, usage)

    # Not instrumented itself: the wrapped LLM's own chat emits the events (one per
    # model call, with the messages actually sent).
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        msgs, call_kw, report = self._call(messages, kwargs)
        response = self._llm.chat(msgs, **call_kw)
        self._record(report, response)
        return response

    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        msgs, call_kw, report = self._call(messages, kwargs)

        def gen() -> ChatResponseGen:
            for response in self._llm.stream_chat(msgs, **call_kw):
                self._record(report, response)  # the final usage chunk, when sent
                yield response

        return gen()

    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        response = self.chat([ChatMessage(role=MessageRole.USER, content=prompt)], **kwargs)
        return CompletionResponse(text=response.message.content or "", raw=response.raw,
                                  additional_kwargs=response.additional_kwargs)

    def stream_complete(self, prompt: str, formatted: bool = False,
                        **kwargs: Any) -> CompletionResponseGen:
        def gen() -> CompletionResponseGen:
            for r in self.stream_chat([ChatMessage(role=MessageRole.USER, content=prompt)],
                                      **kwargs):
                yield CompletionResponse(text=r.message.content or "", delta=r.delta,
                                         raw=r.raw)

        return gen()


# ---------------------------------------------------------------------------- telemetry
def _response_fields(response: Any) -> dict[str, Any]:
    """Usage, TTFT, reuse and the pipeline's report from a response of any LlamaIndex LLM."""
    if response is None:
        return {}
    raw = getattr(response, "raw", None)
    raw_usage = raw.get("usage") if isinstance(raw, dict) else getattr(raw, "usage", None)
    out: dict[str, Any] = {**usage_from(getattr(response, "additional_kwargs", None)),
                           **usage_from(raw_usage)}
    if isinstance(raw, dict):
        out.update(ttft_ms=raw.get("ttft_ms"), kv_reuse_ratio=raw.get("kv_reuse_ratio"))
        report = raw.get("contextkit")
        if isinstance(report, dict):
            out.update(tenant=report.get("tenant"), stable_hash=report.get("stable_hash"),
                       prefix_broken_by=report.get("prefix_broken_by"),
                       layers=[*report.get("layer_order", []),
                               *report.get("trailing_layers", [])])
    return out


def _start_fields(messages: Sequence[ChatMessage], model: dict[str, Any] | None) -> dict[str, Any]:
    # every system message: a trailing one carries the volatile layers
    system = "\n".join(m.content or "" for m in messages
                       if str(getattr(m.role, "value", m.role)) == "system")
    model = model or {}
    return {"model": model.get("model_name") or model.get("model") or model.get("class_name"),
            "tenant": model.get("tenant"), "messages": len(messages),
            "system_chars": len(system), "layers": layers_in(system)}


class ContextKitEventHandler(LogView, BaseEventHandler):
    """Instrumentation handler: one record per ``LLMChatStartEvent``/``LLMChatEndEvent``.

    Register with ``get_dispatcher().add_event_handler(handler)``. Observes only.
    """

    log: CallLog = Field(default_factory=CallLog, exclude=True)

    @classmethod
    def class_name(cls) -> str:
        return "ContextKitEventHandler"

    def handle(self, event: BaseEvent, **kwargs: Any) -> Any:
        key = str(event.span_id or "")
        if isinstance(event, LLMChatStartEvent):
            self.log.start(key, "llamaindex", **_start_fields(event.messages, event.model_dict))
        elif isinstance(event, LLMChatEndEvent):
            self.log.end(key, **_response_fields(event.response))
        return None


class ContextKitLlamaCallbackHandler(LogView, LlamaBaseCallbackHandler):
    """Legacy callback handler for ``CBEventType.LLM`` events (observes only).

    Register with ``Settings.callback_manager = CallbackManager([handler])`` or on
    the LLM's ``callback_manager``.
    """

    def __init__(self, log: CallLog | None = None) -> None:
        super().__init__(event_starts_to_ignore=[], event_ends_to_ignore=[])
        self.log = log if log is not None else CallLog()

    def on_event_start(self, event_type: CBEventType, payload: dict[str, Any] | None = None,
                       event_id: str = "", parent_id: str = "", **kwargs: Any) -> str:
        if event_type == CBEventType.LLM and payload is not None:
            messages = payload.get(EventPayload.MESSAGES)
            if messages is not None:
                self.log.start(event_id, "llamaindex-legacy",
                               **_start_fields(messages, payload.get(EventPayload.SERIALIZED)))
        return event_id

    def on_event_end(self, event_type: CBEventType, payload: dict[str, Any] | None = None,
                     event_id: str = "", **kwargs: Any) -> None:
        if event_type != CBEventType.LLM or payload is None:
            return
        if EventPayload.EXCEPTION in payload:
            error = payload[EventPayload.EXCEPTION]
            self.log.end(event_id, error=f"{type(error).__name__}: {error}")
        elif EventPayload.RESPONSE in payload:
            self.log.end(event_id, **_response_fields(payload[EventPayload.RESPONSE]))

    def start_trace(self, trace_id: str | None = None) -> None:
        return None

    def end_trace(self, trace_id: str | None = None,
                  trace_map: dict[str, list[str]] | None = None) -> None:
        return None
