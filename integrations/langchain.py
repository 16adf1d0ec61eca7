"""LangChain 1.x: agent middleware, a telemetry callback, and a chat model on the engine.

Adopting contextkit in a ``create_agent`` agent::

    from langchain.agents import create_agent
    from contextkit import CacheAwareContextPipeline, Engine
    from integrations.langchain import (ContextKitCallbackHandler, ContextKitChatModel,
                                        ContextKitMiddleware)

    engine = Engine.from_pretrained()
    pipeline = CacheAwareContextPipeline(engine)
    agent = create_agent(
        ContextKitChatModel(engine=engine, pipeline=pipeline),   # or any chat model
        tools=[],
        middleware=[ContextKitMiddleware(pipeline, build_system_message)],
    )
    handler = ContextKitCallbackHandler()
    agent.invoke({"messages": [("user", "hi")]}, config={"callbacks": [handler]})

- :class:`ContextKitMiddleware` (``wrap_model_call``) builds the system message
  through the pipeline each model call and overrides the request's system message
  with it: the stable prefix, the changing layers and the volatile layers are
  separate content blocks, the stable one with a ``cache_control`` breakpoint, so
  providers' prompt caches (Anthropic) benefit as well as contextkit's engine.
  For an OpenAI-compatible chat model (``ChatOpenAI`` and its subclasses, or any
  model with an ``extra_body`` field) the layout is the embedded engine's instead:
  the volatile layers go in a trailing system message after the history, so the
  server's prefix cache reuses the conversation too; with the pipeline attached to
  a :class:`~contextkit.pipeline.served.model.ServedModel` (a vLLM server), every call also carries
  the request fields of contextkit's vLLM connector in ``extra_body`` (layer,
  importance and pin of every token range, ``cache_salt`` = the tenant) and the
  server's reported usage goes into the call's report.
- :class:`ContextKitCallbackHandler` only observes: prompt layers and content
  blocks at ``on_chat_model_start``, usage and cache read/creation tokens at
  ``on_llm_end`` (whatever the provider reports). Callbacks cannot change messages.
- :class:`ContextKitChatModel` is a ``BaseChatModel`` (with streaming) backed by the
  embedded engine; with the middleware, it lays the prompt out the pipeline's way
  (pinned stable prefix, volatile layers after the history).

LangChain over a vLLM server::

    from langchain_openai import ChatOpenAI
    from contextkit import CacheAwareContextPipeline
    from contextkit.pipeline.served.model import ServedModel

    served = ServedModel("/models/Qwen2.5-7B-Instruct", name="qwen")  # what vLLM serves
    pipeline = CacheAwareContextPipeline(served=served)
    model = ChatOpenAI(model="qwen", base_url="http://127.0.0.1:8000/v1", api_key="x",
                       stream_usage=True)
    agent = create_agent(model, tools=[...],
                         middleware=[ContextKitMiddleware(pipeline, build_system_message)])

Requires the ``langchain`` extra (``pip install 'contextkit[langchain]'``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from contextkit.config.errors import require

require("langchain.agents", "langchain")
require("langchain_core", "langchain")

from langchain.agents.middleware import AgentMiddleware, ModelRequest  # noqa: E402
from langchain_core.callbacks import BaseCallbackHandler, CallbackManagerForLLMRun  # noqa: E402
from langchain_core.language_models.chat_models import BaseChatModel  # noqa: E402
from langchain_core.messages import (  # noqa: E402
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    SystemMessage,
)
from langchain_core.outputs import (  # noqa: E402
    ChatGeneration,
    ChatGenerationChunk,
    ChatResult,
    LLMResult,
)
from pydantic import ConfigDict, Field  # noqa: E402

from contextkit.engine.engine import Engine  # noqa: E402
from contextkit.pipeline.pipeline import BuiltPrompt, CacheAwareContextPipeline, CallReport  # noqa: E402
from contextkit.pipeline.served.model import LabelRangeError  # noqa: E402
from contextkit.prompt.markup import has_markers  # noqa: E402
from integrations._common import (  # noqa: E402
    CallLog,
    ChatRun,
    EngineChat,
    LogView,
    SystemParts,
    layers_in,
    split_system_text,
    usage_from,
)
from integrations._openai_compat import (  # noqa: E402
    merge_extra_body,
    record_served_usage,
    system_texts,
    trailing_index,
)

__all__ = [
    "EPHEMERAL",
    "METADATA_KEY",
    "ContextKitCallbackHandler",
    "ContextKitChatModel",
    "ContextKitMiddleware",
    "is_openai_compatible",
    "openai_payload_messages",
    "to_conversation",
]

#: ``SystemMessage.additional_kwargs`` key carrying the pipeline's call summary.
METADATA_KEY = "contextkit"

#: Anthropic's prompt-cache breakpoint, put on the stable block by default.
EPHEMERAL: Mapping[str, Any] = {"type": "ephemeral"}

Builder = Callable[[ModelRequest], Any]
TenantFn = Callable[[ModelRequest], str]


def to_conversation(messages: Sequence[BaseMessage]) -> list[tuple[str, str]]:
    """``(role, text)`` pairs of LangChain messages (tool calls rendered as text)."""
    roles = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool",
             "function": "tool"}
    out = []
    for m in messages:
        role = roles.get(m.type) or str(getattr(m, "role", "user"))
        text = str(m.text)
        calls = getattr(m, "tool_calls", None)
        if calls:
            rendered = "\n".join(f"[tool call] {c['name']}({c.get('args', {})})" for c in calls)
            text = f"{text}\n{rendered}" if text else rendered
        out.append((role, text))
    return out


def is_openai_compatible(model: Any) -> bool:
    """Whether a chat model talks to an OpenAI-compatible ``/v1/chat/completions``
    endpoint and takes ``extra_body``: ``langchain_openai``'s ``BaseChatOpenAI``
    (``ChatOpenAI`` and its subclasses; detected without importing
    ``langchain_openai``) or any model with an ``extra_body`` field."""
    for cls in type(model).__mro__:
        if cls.__name__ == "BaseChatOpenAI" and cls.__module__.startswith("langchain_openai"):
            return True
    fields = getattr(type(model), "model_fields", None)
    return isinstance(fields, Mapping) and "extra_body" in fields


def openai_payload_messages(model: Any, messages: Sequence[BaseMessage],
                            tools: Sequence[Any] = ()) -> tuple[list[dict[str, Any]],
                                                                list[dict[str, Any]] | None]:
    """The message dicts (and tools) ``model`` sends for ``messages``: ``ChatOpenAI``'s
    own conversion (``_get_request_payload``), else LangChain's generic one.

    Raises:
        LabelRangeError: the model would use OpenAI's Responses API (no ``messages``).
    """
    from langchain_core.utils.function_calling import convert_to_openai_tool

    formatted = [convert_to_openai_tool(t) for t in tools] or None
    payload_fn = getattr(model, "_get_request_payload", None)
    if callable(payload_fn):
        payload = payload_fn(list(messages), **({"tools": formatted} if formatted else {}))
        if "messages" not in payload:
            raise LabelRangeError(
                f"{type(model).__name__} sends this request through OpenAI's Responses API, "
                "which a vLLM server's contextkit labels do not cover; set "
                "use_responses_api=False")
        return list(payload["messages"]), payload.get("tools") or formatted
    from langchain_core.messages import convert_to_openai_messages

    converted = convert_to_openai_messages(list(messages))
    return list(converted), formatted


def _tenant_of(context: Any) -> str | None:
    if isinstance(context, Mapping):
        value = context.get("tenant")
    else:
        value = getattr(context, "tenant", None)
    return str(value) if value else None


# ---------------------------------------------------------------------------- middleware
class ContextKitMiddleware(AgentMiddleware):
    """Build the agent's system message through a contextkit pipeline.

    Args:
        pipeline: the pipeline (with or without an engine attached).
        build_system_message: called with the ``ModelRequest`` on every model call;
            returns a ``[LAYER]...[/LAYER]`` string, a ``{layer: lines}`` mapping or a
            ``StructuredPrompt``. Default: the agent's own ``system_prompt`` when it
            carries layer markers (a plain system prompt is left untouched).
        tenant: a tenant id, or a function of the request; default: ``tenant`` of
            the runtime context (mapping key or attribute), else the pipeline's rule
            (its innermost ``tenant_scope``, else its default tenant). The model call
            runs inside ``pipeline.tenant_scope(tenant)``, so the chat model and any
            pipeline read inside it mean the same tenant (see *Tenants* in
            :mod:`contextkit.pipeline.pipeline`).
        cache_control: the breakpoint put on the stable block (Anthropic's format);
            ``None`` for providers that reject extra block keys (their automatic
            prefix caching still sees the stable prefix first).
        trailing_system: for OpenAI-compatible models, put the volatile layers in a
            second system message after the history (default). ``False`` keeps every
            layer in the one leading system message, for providers (or chat
            templates) that reject a second system message; the server's prefix
            cache then stops at the first volatile layer. A pipeline built with
            ``trailing_message=False`` gives the same single message.

    With a cache attached, the pipeline applies budgets and volatility ordering;
    without one, the text is exactly what ``build_system_message`` returned. Either
    way the model gets the same text whichever chat model runs it.

    OpenAI-compatible models (see :func:`is_openai_compatible`) get the embedded
    engine's layout: the main system message (stable and changing layers, as plain
    text), the history, a trailing system message with the volatile layers, then the
    current user turn and its tool rounds. With the pipeline attached to a
    :class:`~contextkit.pipeline.served.model.ServedModel`, the call's ``extra_body`` also carries
    :meth:`~contextkit.pipeline.pipeline.CacheAwareContextPipeline.request_fields` computed
    on exactly the messages the model sends (merged over the model's own
    ``extra_body``; ``kv_transfer_params`` key by key), and the usage the server
    reports (prompt and cached tokens) is recorded in the call's report
    (``pipeline.last_report()``). A model whose name is not the served model's, or
    messages the served model cannot render exactly, raise
    :class:`~contextkit.pipeline.served.model.LabelRangeError` rather than send wrong labels.
    """

    def __init__(self, pipeline: CacheAwareContextPipeline,
                 build_system_message: Builder | None = None, *,
                 tenant: str | TenantFn | None = None,
                 cache_control: Mapping[str, Any] | None = EPHEMERAL,
                 trailing_system: bool = True) -> None:
        super().__init__()
        self.pipeline = pipeline
        self.build_system_message = build_system_message
        self.tenant = tenant
        self.cache_control = dict(cache_control) if cache_control is not None else None
        self.trailing_system = trailing_system

    @property
    def name(self) -> str:
        return "ContextKitMiddleware"

    def _tenant(self, request: ModelRequest) -> str:
        if callable(self.tenant):
            return str(self.tenant(request))
        if self.tenant:
            return str(self.tenant)
        runtime = getattr(request, "runtime", None)
        return _tenant_of(getattr(runtime, "context", None)) or self.pipeline.resolve_tenant()

    def _parts(self, request: ModelRequest, tenant: str) -> SystemParts | None:
        if self.build_system_message is not None:
            raw = self.build_system_message(request)
        else:
            raw = request.system_prompt
            if raw is None or not has_markers(raw, self.pipeline.config):
                return None
        return split_system_text(self.pipeline, raw, tenant)

    def _meta(self, parts: SystemParts, tenant: str) -> dict[str, Any]:
        meta: dict[str, Any] = {"tenant": tenant, "attached": self.pipeline.attached}
        if parts.built is not None:
            report = parts.built.report
            meta.update(pipeline=_pipeline_token(self.pipeline), call=report.call,
                        stable_hash=report.stable_hash, prefix_broken_by=report.prefix_broken_by,
                        changed_layers=list(report.changed_layers),
                        layer_order=list(report.layer_order),
                        trailing_layers=list(report.trailing_layers),
                        layer_tokens=dict(report.layer_tokens))
        return meta

    def _blocks_message(self, parts: SystemParts, tenant: str) -> SystemMessage:
        blocks: list[str | dict[str, Any]] = []
        for i, text in enumerate((parts.stable, parts.changing, parts.trailing)):
            if not text:
                continue
            block: dict[str, Any] = {"type": "text", "text": text}
            if i == 0 and self.cache_control is not None:
                block["cache_control"] = dict(self.cache_control)
            blocks.append(block)
        return SystemMessage(content=blocks, additional_kwargs={
            METADATA_KEY: self._meta(parts, tenant)})

    def system_message(self, request: ModelRequest, tenant: str | None = None
                       ) -> SystemMessage | None:
        """The system message this middleware puts on ``request`` for a model that is not
        OpenAI-compatible (``None``: unchanged); see :meth:`model_request`."""
        tenant = tenant or self._tenant(request)
        parts = self._parts(request, tenant)
        return None if parts is None else self._blocks_message(parts, tenant)

    def model_request(self, request: ModelRequest, tenant: str | None = None
                      ) -> tuple[ModelRequest, CallReport | None]:
        """The request this middleware hands on, and the call's report when the server's
        usage is to be recorded (a pipeline attached to a served model).

        Raises:
            LabelRangeError: labels for a served model cannot be made exact.
        """
        tenant = tenant or self._tenant(request)
        parts = self._parts(request, tenant)
        if parts is None:
            return request, None
        built = parts.built
        if built is None or not is_openai_compatible(request.model):
            return request.override(system_message=self._blocks_message(parts, tenant)), None
        main, trailing = system_texts(built, self.trailing_system)
        meta = self._meta(parts, tenant)
        # sent even when empty, so no chat template injects its default system prompt
        system = SystemMessage(content=main, additional_kwargs={METADATA_KEY: meta})
        messages: list[Any] = list(request.messages)
        if trailing:
            at = trailing_index(["user" if m.type == "human" else m.type for m in messages])
            messages.insert(at, SystemMessage(content=trailing, additional_kwargs={
                METADATA_KEY: {**meta, "trailing": True}}))
        if self.pipeline.served is None:
            return request.override(system_message=system, messages=messages), None
        fields = self.request_fields(request, [system, *messages], tenant, built)
        extra = merge_extra_body(getattr(request.model, "extra_body", None),
                                 request.model_settings.get("extra_body"))
        settings = {**request.model_settings, "extra_body": merge_extra_body(extra, fields)}
        return (request.override(system_message=system, messages=messages,
                                 model_settings=settings), built.report)

    def request_fields(self, request: ModelRequest, messages: Sequence[BaseMessage],
                       tenant: str, built: BuiltPrompt) -> dict[str, Any]:
        """The connector's fields for ``messages`` as ``request.model`` sends them."""
        served = self.pipeline.served
        assert served is not None
        name = getattr(request.model, "model_name", None) or getattr(request.model, "model",
                                                                     None)
        if isinstance(name, str) and name != served.name:
            raise LabelRangeError(
                f"the chat model asks for model {name!r} but the pipeline's ServedModel is "
                f"{served.name!r}; its token ranges would be another model's. Use "
                f"ServedModel(model_dir, name={name!r}) for the directory that server serves")
        sent, tools = openai_payload_messages(request.model, messages, request.tools)
        return self.pipeline.request_fields(sent, tenant=tenant, built=built, tools=tools)

    def wrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], Any]
                        ) -> Any:
        tenant = self._tenant(request)
        with self.pipeline.tenant_scope(tenant):
            request, report = self.model_request(request, tenant)
            response = handler(request)
            if report is not None:
                record_served_usage(self.pipeline, report, _usage_of(response))
            return response

    async def awrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], Any]
                               ) -> Any:
        tenant = self._tenant(request)
        with self.pipeline.tenant_scope(tenant):
            request, report = self.model_request(request, tenant)
            response = await handler(request)
            if report is not None:
                record_served_usage(self.pipeline, report, _usage_of(response))
            return response


def _usage_of(response: Any) -> Any:
    """The usage metadata of a model call's reply (an AIMessage, a ModelResponse or an
    ExtendedModelResponse)."""
    response = getattr(response, "model_response", response)
    messages = [response] if isinstance(response, AIMessage) else getattr(response, "result",
                                                                           None) or []
    for message in messages:
        if isinstance(message, AIMessage):
            return message.usage_metadata
    return None


def _pipeline_token(pipeline: CacheAwareContextPipeline) -> str:
    """Which pipeline built a system message (the chat model only trusts its own)."""
    return f"{id(pipeline):x}"


# ---------------------------------------------------------------------------- callbacks
class ContextKitCallbackHandler(LogView, BaseCallbackHandler):
    """Telemetry of chat model calls; observes only (never changes messages).

    Records, per call, the prompt's layers and content blocks (with cache
    breakpoints) and the pipeline's stable hash; at the end, input/output tokens and
    the cache read/creation tokens the provider reported (contextkit's engine,
    Anthropic and OpenAI shapes), TTFT and KV reuse when the engine reports them.

    Args:
        log: where records go (a new :class:`~integrations._common.CallLog` by default).
    """

    raise_error = False

    def __init__(self, log: CallLog | None = None) -> None:
        super().__init__()
        self.log = log if log is not None else CallLog()

    def on_chat_model_start(self, serialized: dict[str, Any], messages: list[list[BaseMessage]],
                            *, run_id: uuid.UUID, **kwargs: Any) -> None:
        msgs = messages[0] if messages else []
        systems = [m for m in msgs if isinstance(m, SystemMessage)]
        system = systems[0] if systems else None
        meta = (system.additional_kwargs.get(METADATA_KEY) or {}) if system is not None else {}
        blocks = []
        if system is not None and isinstance(system.content, list):
            for b in system.content:
                if isinstance(b, Mapping):
                    blocks.append({"chars": len(str(b.get("text", ""))),
                                   "cache_control": "cache_control" in b})
        params = kwargs.get("invocation_params") or {}
        model = (params.get("model") or params.get("model_name")
                 or (serialized or {}).get("name"))
        # every system message: a trailing one carries the volatile layers
        text = "\n".join(m.text for m in systems)
        self.log.start(str(run_id), "langchain", model=model, tenant=meta.get("tenant"),
                       messages=len(msgs), system_chars=len(text), layers=layers_in(text),
                       content_blocks=blocks, stable_hash=meta.get("stable_hash"),
                       prefix_broken_by=meta.get("prefix_broken_by"))

    def on_llm_end(self, response: LLMResult, *, run_id: uuid.UUID, **kwargs: Any) -> None:
        usage: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        gens = response.generations[0] if response.generations else []
        if gens:
            message = getattr(gens[0], "message", None)
            if message is not None:
                usage = usage_from(getattr(message, "usage_metadata", None))
                meta = getattr(message, "response_metadata", None) or {}
                if not usage:
                    usage = usage_from(meta.get("usage")) or usage_from(meta.get("token_usage"))
                extra = {"ttft_ms": meta.get("ttft_ms"),
                         "kv_reuse_ratio": meta.get("kv_reuse_ratio")}
        if not usage and response.llm_output:
            out = response.llm_output
            usage = usage_from(out.get("usage")) or usage_from(out.get("token_usage"))
        self.log.end(str(run_id), **usage, **extra)

    def on_llm_error(self, error: BaseException, *, run_id: uuid.UUID, **kwargs: Any) -> None:
        self.log.end(str(run_id), error=f"{type(error).__name__}: {error}")


# ---------------------------------------------------------------------------- chat model
class ContextKitChatModel(BaseChatModel):
    """A LangChain chat model running on contextkit's embedded engine.

    Its fields are passed by keyword: ``ContextKitChatModel(engine=engine)``.

    Attributes:
        engine: the :class:`~contextkit.engine.engine.Engine` (e.g. ``Engine.from_pretrained()``).
        pipeline: the pipeline the :class:`ContextKitMiddleware` uses; with it, system
            messages the middleware built are laid out the pipeline's way.
        tenant: tenant for prompts that did not come through the middleware.
        max_tokens: reply length limit (``model.bind(max_tokens=...)`` per call).
        streaming: stream through ``invoke`` callbacks too.

    Greedy decoding. Tool calling is not supported (SmolLM2 has no tool-call format):
    use ``create_agent(model, tools=[])``.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    engine: Any = Field(exclude=True)
    pipeline: Any = Field(default=None, exclude=True)
    tenant: str | None = None
    max_tokens: int = 128
    streaming: bool = False

    @property
    def _llm_type(self) -> str:
        return "contextkit"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self._chat().model_name, "max_tokens": self.max_tokens}

    def _chat(self) -> EngineChat:
        if not isinstance(self.engine, Engine):
            raise TypeError("engine must be a contextkit Engine (Engine.from_pretrained())")
        return EngineChat(self.engine, self.pipeline, self.tenant)

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Any:
        raise NotImplementedError(
            "ContextKitChatModel does not call tools: the embedded SmolLM2 has no tool-call "
            "format. Use create_agent(model, tools=[]), or serve a tool-calling model with "
            "vLLM and contextkit's KV connector")

    def _plan(self, messages: list[BaseMessage]) -> tuple[list[tuple[str, str]],
                                                          BuiltPrompt | None, str | None]:
        conv = to_conversation(messages)
        first = messages[0] if messages else None
        meta = first.additional_kwargs.get(METADATA_KEY) if isinstance(first, SystemMessage) \
            else None
        if not meta or self.pipeline is None or not self.pipeline.attached:
            return conv, None, None
        if meta.get("pipeline") != _pipeline_token(self.pipeline):
            return conv, None, meta.get("tenant")
        built = self.pipeline.last_built(meta["tenant"])
        if built is None or first is None or built.text != first.text:  # stale: lay it out plainly
            return conv, None, meta["tenant"]
        return conv, built, meta["tenant"]

    def _run_kwargs(self, messages: list[BaseMessage], stop: list[str] | None,
                    kwargs: Mapping[str, Any]) -> tuple[list[tuple[str, str]], dict[str, Any]]:
        conv, built, tenant = self._plan(messages)
        max_new = int(kwargs.get("max_tokens") or kwargs.get("max_new_tokens") or self.max_tokens)
        return conv, {"built": built, "tenant": tenant or self.tenant,  # None: the rule
                      "max_new_tokens": max_new, "stop": list(stop or [])}

    def _message(self, run: ChatRun, chat: EngineChat) -> AIMessage:
        return AIMessage(content=run.text, usage_metadata=run.usage(),
                         response_metadata=run.metadata(chat.model_name))

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None,
                  **kwargs: Any) -> ChatResult:
        chat = self._chat()
        conv, run_kw = self._run_kwargs(messages, stop, kwargs)
        run = chat.run(conv, **run_kw)
        return ChatResult(generations=[ChatGeneration(message=self._message(run, chat))])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        chat = self._chat()
        conv, run_kw = self._run_kwargs(messages, stop, kwargs)
        for item in chat.stream(conv, **run_kw):
            if isinstance(item, str):
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=item))
                if run_manager is not None:
                    run_manager.on_llm_new_token(item, chunk=chunk)
                yield chunk
            else:
                yield ChatGenerationChunk(message=AIMessageChunk(
                    content="", usage_metadata=item.usage(),  # type: ignore[arg-type]
                    response_metadata=item.metadata(chat.model_name),
                    chunk_position="last"))
