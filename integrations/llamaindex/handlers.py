"""LlamaIndex telemetry: an instrumentation event handler and a legacy callback handler
that record every LLM call (chat and completion, streamed or not) with its layers, usage
and prompt-cache figures, for any LLM (observe only)."""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.callbacks import CBEventType, EventPayload
from llama_index.core.callbacks.base_handler import (
    BaseCallbackHandler as LlamaBaseCallbackHandler,
)
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.llm import (
    LLMChatEndEvent,
    LLMChatStartEvent,
    LLMCompletionEndEvent,
    LLMCompletionStartEvent,
)
from pydantic import Field

from integrations._call_log import CallLog, LogView, usage_from
from integrations._system_parts import layers_in

__all__ = ["ContextKitEventHandler", "ContextKitLlamaCallbackHandler"]

#: The model call in progress in this thread or task: an LLM's ``chat`` that runs its own
#: ``complete`` (``CustomLLM``'s default) is one model call, recorded once.
_CURRENT_CALL: ContextVar[str | None] = ContextVar("contextkit_llamaindex_call", default=None)
_CURRENT_LEGACY_CALL: ContextVar[str | None] = ContextVar("contextkit_llamaindex_legacy_call",
                                                          default=None)


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


def _prompt_fields(prompt: str, model: dict[str, Any] | None) -> dict[str, Any]:
    """A completion call: one prompt, sent as one user message."""
    model = model or {}
    return {"model": model.get("model_name") or model.get("model") or model.get("class_name"),
            "tenant": model.get("tenant"), "messages": 1, "system_chars": 0, "layers": []}


def _start_fields(messages: Sequence[ChatMessage], model: dict[str, Any] | None) -> dict[str, Any]:
    # every system message: a trailing one carries the volatile layers
    system = "\n".join(m.content or "" for m in messages
                       if str(getattr(m.role, "value", m.role)) == "system")
    model = model or {}
    return {"model": model.get("model_name") or model.get("model") or model.get("class_name"),
            "tenant": model.get("tenant"), "messages": len(messages),
            "system_chars": len(system), "layers": layers_in(system)}


class ContextKitEventHandler(LogView, BaseEventHandler):
    """Instrumentation handler: one record per model call, from ``LLMChatStartEvent`` /
    ``LLMChatEndEvent`` and ``LLMCompletionStartEvent`` / ``LLMCompletionEndEvent``.

    Register with ``get_dispatcher().add_event_handler(handler)``. Observes only.
    """

    log: CallLog = Field(default_factory=CallLog, exclude=True)
    nested: set[str] = Field(default_factory=set, exclude=True)

    @classmethod
    def class_name(cls) -> str:
        return "ContextKitEventHandler"

    def handle(self, event: BaseEvent, **kwargs: Any) -> Any:
        key = str(event.span_id or "")
        if isinstance(event, (LLMChatStartEvent, LLMCompletionStartEvent)):
            outer = _CURRENT_CALL.get()
            if outer is not None and outer != key and self.log.is_open(outer):
                self.nested.add(key)  # inside a call already recorded
                return None
            fields = (_start_fields(event.messages, event.model_dict)
                      if isinstance(event, LLMChatStartEvent)
                      else _prompt_fields(event.prompt, event.model_dict))
            self.log.start(key, "llamaindex", **fields)
            _CURRENT_CALL.set(key)
        elif isinstance(event, (LLMChatEndEvent, LLMCompletionEndEvent)):
            if key in self.nested:
                self.nested.discard(key)
                return None
            self.log.end(key, **_response_fields(event.response))
            if _CURRENT_CALL.get() == key:
                _CURRENT_CALL.set(None)
        return None


class ContextKitLlamaCallbackHandler(LogView, LlamaBaseCallbackHandler):
    """Legacy callback handler for ``CBEventType.LLM`` events, chat and completion
    (observes only).

    Register with ``Settings.callback_manager = CallbackManager([handler])`` or on
    the LLM's ``callback_manager``.
    """

    def __init__(self, log: CallLog | None = None) -> None:
        super().__init__(event_starts_to_ignore=[], event_ends_to_ignore=[])
        self.log = log if log is not None else CallLog()
        self._nested: set[str] = set()

    def on_event_start(self, event_type: CBEventType, payload: dict[str, Any] | None = None,
                       event_id: str = "", parent_id: str = "", **kwargs: Any) -> str:
        outer = _CURRENT_LEGACY_CALL.get()
        if event_type == CBEventType.LLM and outer not in (None, event_id) \
                and self.log.is_open(str(outer)):
            self._nested.add(event_id)  # e.g. CustomLLM.chat running its own complete
            return event_id
        if event_type == CBEventType.LLM and payload is not None:
            messages = payload.get(EventPayload.MESSAGES)
            model = payload.get(EventPayload.SERIALIZED)
            if messages is not None:
                self.log.start(event_id, "llamaindex-legacy", **_start_fields(messages, model))
                _CURRENT_LEGACY_CALL.set(event_id)
            elif isinstance(payload.get(EventPayload.PROMPT), str):
                self.log.start(event_id, "llamaindex-legacy",
                               **_prompt_fields(payload[EventPayload.PROMPT], model))
                _CURRENT_LEGACY_CALL.set(event_id)
        return event_id

    def on_event_end(self, event_type: CBEventType, payload: dict[str, Any] | None = None,
                     event_id: str = "", **kwargs: Any) -> None:
        if event_id in self._nested:
            self._nested.discard(event_id)
            return
        if event_type != CBEventType.LLM or payload is None:
            return
        if _CURRENT_LEGACY_CALL.get() == event_id:
            _CURRENT_LEGACY_CALL.set(None)
        if EventPayload.EXCEPTION in payload:
            error = payload[EventPayload.EXCEPTION]
            self.log.end(event_id, error=f"{type(error).__name__}: {error}")
        elif EventPayload.RESPONSE in payload:
            self.log.end(event_id, **_response_fields(payload[EventPayload.RESPONSE]))
        elif EventPayload.COMPLETION in payload:
            self.log.end(event_id, **_response_fields(payload[EventPayload.COMPLETION]))

    def start_trace(self, trace_id: str | None = None) -> None:
        return None

    def end_trace(self, trace_id: str | None = None,
                  trace_map: dict[str, list[str]] | None = None) -> None:
        return None
