"""LangChain agent middleware: the system message built through a contextkit pipeline on
every model call, laid out for the chat model that runs it (see
:class:`ContextKitMiddleware`), and what it shares with the chat model (the metadata key
on the system message, the OpenAI-compatible detection)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from langchain.agents.middleware import AgentMiddleware, ModelRequest
from langchain_core.messages import AIMessage, BaseMessage, SystemMessage

from contextkit.pipeline.pipeline import BuiltPrompt, CacheAwareContextPipeline, CallReport
from contextkit.pipeline.served.model import LabelRangeError
from contextkit.pipeline.served.wire import with_hints
from contextkit.prompt.markup import has_markers
from integrations._openai_compat import (
    agent_hints,
    fall_back,
    merge_extra_body,
    record_served_usage,
    system_texts,
    trailing_index,
    without_fields,
)
from integrations._system_parts import SystemParts, split_system_text

__all__ = [
    "EPHEMERAL",
    "METADATA_KEY",
    "ContextKitMiddleware",
    "is_openai_compatible",
    "openai_payload_messages",
    "pipeline_token",
    "run_hints",
]

#: ``SystemMessage.additional_kwargs`` key carrying the pipeline's call summary.
METADATA_KEY = "contextkit"

#: Anthropic's prompt-cache breakpoint, put on the stable block by default.
EPHEMERAL: Mapping[str, Any] = {"type": "ephemeral"}

Builder = Callable[[ModelRequest], Any]
TenantFn = Callable[[ModelRequest], str]


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
    value = _context_value(context, "tenant")
    return str(value) if value else None


def _context_value(context: Any, key: str) -> Any:
    return context.get(key) if isinstance(context, Mapping) else getattr(context, key, None)


def _thread_id() -> str | None:
    """The LangGraph run's ``thread_id`` (its conversation), if the call runs in one."""
    try:
        from langgraph.config import get_config

        configurable = get_config().get("configurable") or {}
    except (ImportError, RuntimeError):
        return None
    thread = configurable.get("thread_id")
    return str(thread) if thread else None


def run_hints(context: Any) -> dict[str, Any] | None:
    """The agent hints of a call, from its runtime context (mapping key or attribute):
    ``session_id`` (default: the LangGraph ``thread_id``), ``kv_keep_s`` and
    ``kv_priority`` (see :func:`integrations._openai_compat.agent_hints`)."""
    return agent_hints(_context_value(context, "session_id") or _thread_id(),
                       _context_value(context, "kv_keep_s"),
                       _context_value(context, "kv_priority"))


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
    The call's agent hints (:func:`run_hints`: ``session_id``, default the LangGraph
    ``thread_id``, ``kv_keep_s`` and ``kv_priority`` from the runtime context) travel
    with them, so the connector keeps the session's KV through its tool calls.
    A server that is not vLLM refuses those fields: the call is resent without them, and
    later calls are plain OpenAI requests with the same layout (one line in the log;
    ``CallReport.served_fields`` says ``"plain"``).
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
            meta.update(pipeline=pipeline_token(self.pipeline), call=report.call,
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
        fields = with_hints(self.request_fields(request, [system, *messages], tenant, built),
                            run_hints(getattr(getattr(request, "runtime", None), "context",
                                              None)))
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

    @staticmethod
    def plain_request(request: ModelRequest) -> ModelRequest:
        """``request`` without contextkit's fields in its ``extra_body`` (for a server
        that refused them; the layout stays)."""
        settings = dict(request.model_settings)
        settings["extra_body"] = without_fields(settings.get("extra_body"))
        return request.override(model_settings=settings)

    def wrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], Any]
                        ) -> Any:
        tenant = self._tenant(request)
        with self.pipeline.tenant_scope(tenant):
            request, report = self.model_request(request, tenant)
            try:
                response = handler(request)
            except Exception as exc:
                if report is None or not fall_back(self.pipeline, report, exc):
                    raise
                response = handler(self.plain_request(request))
            if report is not None:
                record_served_usage(self.pipeline, report, _usage_of(response))
            return response

    async def awrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], Any]
                               ) -> Any:
        tenant = self._tenant(request)
        with self.pipeline.tenant_scope(tenant):
            request, report = self.model_request(request, tenant)
            try:
                response = await handler(request)
            except Exception as exc:
                if report is None or not fall_back(self.pipeline, report, exc):
                    raise
                response = await handler(self.plain_request(request))
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


def pipeline_token(pipeline: CacheAwareContextPipeline) -> str:
    """Which pipeline built a system message (the chat model only trusts its own)."""
    return f"{id(pipeline):x}"
