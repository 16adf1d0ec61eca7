"""An OpenAI-compatible LlamaIndex LLM laid out and labelled by a pipeline attached to a
served model (:class:`ContextKitOpenAILike`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.llms.custom import CustomLLM
from pydantic import Field, PrivateAttr

from contextkit.pipeline.pipeline import BuiltPrompt, CacheAwareContextPipeline, CallReport
from contextkit.pipeline.served.model import LabelRangeError
from contextkit.pipeline.served.wire import PARAMS_KEY, with_hints
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
from integrations.llamaindex.llm import Builder

__all__ = ["ContextKitOpenAILike"]


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
        session_id: the agent session of this LLM's calls (a ``session_id=`` call
            argument wins); with ``kv_keep_s=`` and ``kv_priority=`` call arguments,
            the call's agent hints, which let the connector keep the session's KV
            through its tool calls.

    Every chat sends the pipeline's layout and, in ``extra_body``,
    :meth:`~contextkit.pipeline.pipeline.CacheAwareContextPipeline.request_fields` computed on
    exactly the message dicts LlamaIndex sends (its converter joins a message's text
    blocks with ``""``); ``llm.additional_kwargs["extra_body"]`` and a per-call
    ``extra_body`` are kept underneath. The usage the server reports (non-streaming, or
    a stream with ``stream_options={"include_usage": True}``) is recorded in the
    call's report (``pipeline.last_report(tenant)``). A server that is not vLLM refuses
    contextkit's fields: the call is resent without them and later calls are plain
    requests with the same layout (one line in the log). The async methods use the
    wrapped LLM's own (``achat``, ``astream_chat``).

    Raises:
        ValueError: ``llm`` is not a chat model (``OpenAILike(is_chat_model=False)``
            would send ``/v1/completions``) or the pipeline has no served model.
    """

    tenant: str | None = Field(default=None, description="tenant of this LLM's calls")
    session_id: str | None = Field(default=None, description="agent session of its calls "
                                   "(the connector keeps its KV through tool calls)")
    trailing_system: bool = Field(default=True, description="volatile layers after history")
    _llm: Any = PrivateAttr()
    _pipeline: CacheAwareContextPipeline = PrivateAttr()
    _builder: Builder | None = PrivateAttr(default=None)
    _extra_body: dict[str, Any] = PrivateAttr(default_factory=dict)

    def __init__(self, llm: Any, pipeline: CacheAwareContextPipeline, *,
                 build_system_message: Builder | None = None, tenant: str | None = None,
                 trailing_system: bool = True, session_id: str | None = None,
                 **kwargs: Any) -> None:
        if pipeline.served is None:
            raise ValueError("ContextKitOpenAILike needs a pipeline attached to the served "
                             "model: CacheAwareContextPipeline(served=ServedModel(model_dir))")
        if not getattr(getattr(llm, "metadata", None), "is_chat_model", False):
            raise ValueError("the LLM is not a chat model, so it would send /v1/completions "
                             "without the chat template; use OpenAILike(..., "
                             "is_chat_model=True)")
        super().__init__(tenant=tenant, trailing_system=trailing_system,
                         session_id=session_id, **kwargs)
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
        hints = self._hints(kwargs)
        msgs, extra, report = self.prepare(messages, tenant=kwargs.pop("tenant", None),
                                           tools=kwargs.get("tools"),
                                           extra_body=kwargs.pop("extra_body", None))
        if report is not None and PARAMS_KEY in (extra.get("kv_transfer_params") or {}):
            extra = with_hints(extra, hints)  # with contextkit's labels, never alone
        if extra:
            kwargs["extra_body"] = extra
        return msgs, kwargs, report

    def _hints(self, kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """The call's agent hints, popped from its keywords: ``session_id`` (default
        this LLM's ``session_id``), ``kv_keep_s`` and ``kv_priority`` (see
        :func:`integrations._openai_compat.agent_hints`)."""
        return agent_hints(kwargs.pop("session_id", None) or self.session_id,
                           kwargs.pop("kv_keep_s", None), kwargs.pop("kv_priority", None))

    def _record(self, report: CallReport | None, response: Any) -> None:
        raw = getattr(response, "raw", None)
        usage = raw.get("usage") if isinstance(raw, dict) else getattr(raw, "usage", None)
        if usage is not None:
            record_served_usage(self._pipeline, report, usage)

    def _plain(self, report: CallReport | None, exc: Exception,
               call_kw: dict[str, Any]) -> dict[str, Any]:
        """The call's keywords without contextkit's fields, when the server refused them
        (else ``exc`` is raised)."""
        if report is None or not fall_back(self._pipeline, report, exc):
            raise exc
        plain = dict(call_kw)
        extra = without_fields(plain.pop("extra_body", None))
        return {**plain, "extra_body": extra} if extra else plain

    # Not instrumented itself: the wrapped LLM's own chat emits the events (one per
    # model call, with the messages actually sent).
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        msgs, call_kw, report = self._call(messages, kwargs)
        try:
            response = self._llm.chat(msgs, **call_kw)
        except Exception as exc:
            response = self._llm.chat(msgs, **self._plain(report, exc, call_kw))
        self._record(report, response)
        return response

    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        msgs, call_kw, report = self._call(messages, kwargs)

        def opened(kw: dict[str, Any]) -> tuple[Iterator[ChatResponse], list[ChatResponse]]:
            stream = iter(self._llm.stream_chat(msgs, **kw))
            return stream, [r for r in (next(stream, None),) if r is not None]

        def gen() -> ChatResponseGen:
            try:  # the request is sent on the first chunk
                stream, first = opened(call_kw)
            except Exception as exc:
                stream, first = opened(self._plain(report, exc, call_kw))
            for source in (first, stream):
                for response in source:
                    self._record(report, response)  # the final usage chunk, when sent
                    yield response

        return gen()

    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        msgs, call_kw, report = self._call(messages, kwargs)
        try:
            response = await self._llm.achat(msgs, **call_kw)
        except Exception as exc:
            response = await self._llm.achat(msgs, **self._plain(report, exc, call_kw))
        self._record(report, response)
        return response

    async def astream_chat(self, messages: Sequence[ChatMessage],
                           **kwargs: Any) -> ChatResponseAsyncGen:
        msgs, call_kw, report = self._call(messages, kwargs)
        send: Callable[..., Any] = self._llm.astream_chat

        async def gen() -> ChatResponseAsyncGen:
            try:
                stream = await send(msgs, **call_kw)
                first = [await anext(stream)]
            except StopAsyncIteration:
                return
            except Exception as exc:
                stream = await send(msgs, **self._plain(report, exc, call_kw))
                first = [await anext(stream)]
            self._record(report, first[0])
            yield first[0]
            async for response in stream:
                self._record(report, response)
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
