"""A LangChain callback handler that records every chat model call's prompt layers, usage
and prompt-cache figures (observes only)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import BaseMessage, SystemMessage
from langchain_core.outputs import LLMResult

from integrations._call_log import CallLog, LogView, usage_from
from integrations._system_parts import layers_in
from integrations.langchain.middleware import METADATA_KEY

__all__ = ["ContextKitCallbackHandler"]


class ContextKitCallbackHandler(LogView, BaseCallbackHandler):
    """Telemetry of chat model calls; observes only (never changes messages).

    Records, per call, the prompt's layers and content blocks (with cache
    breakpoints) and the pipeline's stable hash; at the end, input/output tokens and
    the cache read/creation tokens the provider reported (contextkit's engine,
    Anthropic and OpenAI shapes), TTFT and KV reuse when the engine reports them.

    Args:
        log: where records go (a new :class:`~integrations._call_log.CallLog` by default).
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
