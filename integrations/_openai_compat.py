"""What the integrations share for OpenAI-compatible servers (vLLM's ``/v1/chat/completions``).

A pipeline attached to a :class:`~contextkit.pipeline.served.model.ServedModel` lays a
chat request out as the embedded engine does (the stable and changing layers in the main
system message, the volatile layers in a trailing system message after the history,
before the current user turn), labels the request's token ranges
(:meth:`~contextkit.pipeline.pipeline.CacheAwareContextPipeline.request_fields`) and
records the usage the server reports
(:meth:`~contextkit.pipeline.pipeline.CacheAwareContextPipeline.record_usage`). The
frameworks differ only in their message types; the rules live here.

Only vLLM takes contextkit's fields (``kv_transfer_params``, ``cache_salt``); another
OpenAI-compatible server refuses them (``transformers serve``: 422 "Unexpected fields").
The integrations then resend the request without them (:func:`fall_back`,
:func:`without_fields`) and the served model sends plain requests from then on, the
layout still applied (:meth:`~contextkit.pipeline.served.model.ServedModel.refuse_fields`).

Nothing here imports LangChain, LlamaIndex or openai.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from contextkit.pipeline.pipeline import BuiltPrompt, CacheAwareContextPipeline, CallReport
from contextkit.pipeline.served.wire import encode_hints
from integrations._call_log import usage_from

__all__ = [
    "FIELD_NAMES",
    "agent_hints",
    "fall_back",
    "merge_extra_body",
    "record_served_usage",
    "refuses_fields",
    "system_texts",
    "trailing_index",
    "without_fields",
]

#: contextkit's request fields, which only vLLM accepts.
FIELD_NAMES = ("kv_transfer_params", "cache_salt")

logger = logging.getLogger(__name__)


def agent_hints(session: Any, keep_s: Any, priority: Any) -> dict[str, Any] | None:
    """A call's agent hints entry from what its run says: a ``session`` id, ``keep_s``
    (keep the prompt's KV this many seconds, e.g. through a tool call) and ``priority``
    (0-100, higher keeps it longer). A bad value is dropped with one warning line; the
    others stay."""
    importance = None
    if priority is not None:
        if isinstance(priority, bool) or not isinstance(priority, int | float):
            logger.warning("kv_priority must be a number in 0-100, got %r; ignored", priority)
        else:
            importance = min(max(float(priority), 0.0), 100.0) / 100
    try:
        return encode_hints(session=session, keep_s=keep_s, importance=importance)
    except ValueError as exc:
        logger.warning("agent hints ignored (%s)", exc)
        return encode_hints(session=session, importance=importance)


def system_texts(built: BuiltPrompt, trailing_system: bool = True) -> tuple[str, str]:
    """``(main, trailing)`` system message texts of a built prompt.

    ``main`` holds the stable and changing layers, ``trailing`` the volatile ones (the
    same texts as :meth:`~contextkit.pipeline.pipeline.CacheAwareContextPipeline.openai_messages`).
    With ``trailing_system=False`` (providers that reject a second system message)
    everything is in ``main`` (:attr:`BuiltPrompt.text`) and ``trailing`` is empty.
    """
    if not trailing_system or not built.trailing:
        return built.text, ""
    main = "".join(built.section_texts[s.layer] for s in built.main)[:-1]
    trailing = "".join(built.section_texts[s.layer] for s in built.trailing)[:-1]
    return main, trailing


def trailing_index(roles: Sequence[str]) -> int:
    """Where the trailing system message goes among the conversation's messages (their
    roles, ``"user"`` for user turns): before the last user message, so that the
    history before it stays a cacheable prefix and the current turn and its tool
    rounds follow; at the end when there is no user message."""
    users = [i for i, role in enumerate(roles) if role == "user"]
    return users[-1] if users else len(roles)


def merge_extra_body(base: Mapping[str, Any] | None, fields: Mapping[str, Any] | None
                     ) -> dict[str, Any]:
    """``base`` updated with ``fields`` (``fields`` win); ``kv_transfer_params`` objects
    are merged key by key, so another connector's entry survives contextkit's."""
    out = dict(base or {})
    for key, value in (fields or {}).items():
        mine = out.get(key)
        if key == "kv_transfer_params" and isinstance(mine, Mapping) and isinstance(value,
                                                                                     Mapping):
            out[key] = {**mine, **value}
        else:
            out[key] = value
    return out


def record_served_usage(pipeline: CacheAwareContextPipeline, report: CallReport | None,
                        usage: Any) -> bool:
    """Put a reply's usage (OpenAI ``usage``, LangChain ``usage_metadata``, as a mapping
    or object) into the call's report through ``pipeline.record_usage``.

    Observing never fails the call: a reply without usage (a stream without
    ``stream_options.include_usage``) records nothing, and counts the pipeline refuses
    are logged. Returns whether the report was filled.
    """
    if report is None or pipeline.served is None:
        return False
    counts = usage_from(usage)
    if "input_tokens" not in counts:
        return False
    try:
        pipeline.record_usage(report, counts["input_tokens"], counts.get("cache_read_tokens", 0))
    except (ValueError, RuntimeError) as exc:
        logger.warning("not recording the server's usage %s: %s", counts, exc)
        return False
    return True


def refuses_fields(exc: BaseException) -> bool:
    """Whether a client's error is a server refusing contextkit's fields: a 400 or 422
    (``openai.BadRequestError`` / ``UnprocessableEntityError``) that names one of them."""
    status = getattr(exc, "status_code", None)
    if status is None:
        status = getattr(getattr(exc, "response", None), "status_code", None)
    if status not in (400, 422):
        return False
    text = f"{exc} {getattr(exc, 'body', '')}"
    return any(name in text for name in FIELD_NAMES)


def without_fields(extra_body: Mapping[str, Any] | None) -> dict[str, Any]:
    """``extra_body`` without contextkit's fields (what a server that refused them takes)."""
    return {k: v for k, v in (extra_body or {}).items() if k not in FIELD_NAMES}


def fall_back(pipeline: CacheAwareContextPipeline, report: CallReport | None,
              exc: BaseException) -> bool:
    """Whether to resend a request that failed with ``exc`` without contextkit's fields:
    the server refused them and the served model negotiates (``extra_fields=None``). The
    served model then sends plain requests (said once in the log) and ``report`` says
    ``served_fields="plain"``."""
    served = pipeline.served
    if served is None or not refuses_fields(exc) or not served.refuse_fields(str(exc)):
        return False
    if report is not None:
        report.served_fields = "plain"
    return True
