"""The API server's side of agent hints: an ASGI middleware for vLLM's ``--middleware``.

vLLM hands its KV connector a request's ``kv_transfer_params``, not its other fields or
headers. This middleware reads the hint dialects of an OpenAI request
(:func:`integrations.vllm.hints.from_request`), removes the fields vLLM would reject or
ignore, and adds contextkit's normalized hints to ``kv_transfer_params``, where the
scheduler-side connector reads them. ``contextkit serve-vllm`` installs it; without
that wrapper pass ``--middleware integrations.vllm.hints_middleware.AgentHintsMiddleware``.

A body that is not a JSON object passes through untouched (vLLM answers it); a hint
that cannot be used is dropped with one warning line and the request is served.

It also turns ``kv_transfer_params["contextkit"]["chunks"] = true`` into the request's
opt-in to chunk reuse: its ``cache_salt`` gets contextkit's chunk suffix
(:func:`contextkit.pipeline.served.wire.chunk_salt`), which keeps vLLM's prefix cache
of such requests apart from every other request's.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from contextkit.pipeline.served.wire import PARAMS_KEY, chunk_salt
from integrations.vllm.hints import HINTS_KEY, from_request

__all__ = ["PATHS", "AgentHintsMiddleware", "rewrite_body", "schedules_by_priority"]

logger = logging.getLogger(__name__)

#: The OpenAI routes whose requests carry hints.
PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
#: Bodies larger than this pass through unread (vLLM bounds them itself).
MAX_BODY_BYTES = 64 << 20

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def schedules_by_priority(argv: list[str] | None = None) -> bool:
    """Whether this vLLM server was started with ``--scheduling-policy priority``: its
    requests' ``priority`` is then vLLM's own (lower is earlier), not a hint."""
    args = sys.argv if argv is None else argv
    for i, arg in enumerate(args):
        if arg == "--scheduling-policy" and i + 1 < len(args):
            return args[i + 1] == "priority"
        if arg.startswith("--scheduling-policy="):
            return arg.split("=", 1)[1] == "priority"
    return False


def rewrite_body(body: bytes, headers: dict[str, str], *, priority_scheduling: bool
                 ) -> tuple[bytes, list[str]]:
    """The request body with its hints moved into ``kv_transfer_params`` (unchanged if
    it has none), and one line per hint dropped."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body, []
    if not isinstance(doc, dict):
        return body, []
    hints, warnings, consumed = from_request(doc, headers,
                                             priority_scheduling=priority_scheduling)
    params = doc.get("kv_transfer_params")
    ours = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    opt_in = isinstance(ours, dict) and ours.get("chunks") is True
    salt = doc.get("cache_salt")
    if opt_in and (salt is None or isinstance(salt, str)):
        doc["cache_salt"] = chunk_salt(salt)
    elif not consumed and hints is None:
        return body, warnings
    for name in consumed:
        doc.pop(name, None)
    if hints is not None:
        params = doc.get("kv_transfer_params")
        params = dict(params) if isinstance(params, dict) else {}
        params[HINTS_KEY] = hints.to_wire()
        doc["kv_transfer_params"] = params
    return json.dumps(doc).encode(), warnings


class AgentHintsMiddleware:
    """ASGI middleware: agent hints of POSTed OpenAI requests into
    ``kv_transfer_params`` (see the module's docstring)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        self.priority_scheduling = schedules_by_priority()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope.get("type") != "http" or scope.get("method") != "POST"
                or scope.get("path") not in PATHS):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message.get("type") != "http.request":  # the client went away
                await self.app(scope, _replay([message], receive), send)
                return
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            more = bool(message.get("more_body"))
            if size > MAX_BODY_BYTES:
                head = {"type": "http.request", "body": b"".join(chunks), "more_body": more}
                await self.app(scope, _replay([head], receive), send)
                return
        body = b"".join(chunks)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        new, warnings = rewrite_body(body, headers,
                                     priority_scheduling=self.priority_scheduling)
        for line in warnings:
            logger.warning("request hint ignored (%s); the request is served without it",
                           line)
        if new is not body:
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope.get("headers", [])
                                if k.lower() != b"content-length"]
            scope["headers"].append((b"content-length", str(len(new)).encode()))
        await self.app(scope, _replay([{"type": "http.request", "body": new,
                                        "more_body": False}], receive), send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that hands out ``messages`` first, then the client's own."""
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
