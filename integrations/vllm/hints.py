"""Agent hints in the serving stacks' own dialects, as contextkit's connector reads them.

Clients of Dynamo, SGLang, llm-d and the vLLM retention proposal already say which KV
matters and for how long. :func:`from_request` reads those dialects from an OpenAI
request (body and headers) into one :class:`Hints`; the API server's middleware
(:mod:`integrations.vllm.hints_middleware`) puts it in the request's
``kv_transfer_params`` under :data:`HINTS_KEY`, where the scheduler-side connector finds
it (:func:`from_wire`). The planner turns it into block labels: a higher importance
for eviction, and pins that last ``keep_s`` seconds, within the tenant's pin quota.

=============================================  ========================================
dialect (where)                                contextkit
=============================================  ========================================
Dynamo ``nvext.agent_hints.priority`` (int,    importance ``min(priority, 100) / 100``
higher = more important; < 0 counts as 0)      for the whole prompt
Dynamo ``nvext.cache_control``                 keep the prompt ``ttl`` seconds
(``{"type": "ephemeral", "ttl": "5m"}``)       (``"600"``, ``"5m"``, ``"1h"``; 300-3600)
Dynamo ``x-dynamo-request-priority`` header    as ``agent_hints.priority`` (wins)
SGLang ``priority`` (int, higher = first)      importance ``min(priority, 100) / 100``
and its ``x-override-priority`` header         (only where vLLM does not schedule by
                                               priority; the field is then removed)
vLLM retention (PR 38514) / llm-d              per token range ``[start, end)``:
``retention_directives: [{start, end,          importance ``priority / 100``, kept
priority 0-100, duration s}]``                 ``duration`` seconds (1-3600)
``agent_hint.cache_control.ttl`` (vLLM RFC     keep the prompt ``ttl`` seconds (0-3600)
52113), ``agent_hint.session_id``
session: ``x-dynamo-session-id``,              the session the kept blocks belong to
``x-session-id``, ``retention_scope``          (reported; pins stay per tenant)
=============================================  ========================================

Hints only raise what a block keeps: a request's own labels stay, a hint never pins
past the tenant's quota (:class:`gpu_cache.PrefixPinManager`), and never touches
another tenant's blocks (every block is the request's tenant's). A bad hint (a wrong
type, a negative TTL, a priority out of range) is dropped with a one-line reason; the
request is served without it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from contextkit.pipeline.served.wire import HINTS_KEY, MAX_KEEP_S

__all__ = ["HINTS_KEY", "MAX_KEEP_S", "SESSION_HEADERS", "Hints", "Retention", "from_request",
           "from_wire", "parse_ttl"]

#: Dynamo's cache_control TTL range (seconds).
_DYNAMO_TTL = (300.0, 3600.0)
#: Session headers, in the order they are read.
SESSION_HEADERS = ("x-dynamo-session-id", "x-session-id")
_TTL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*$")


@dataclass(frozen=True)
class Retention:
    """Keep the prompt's tokens ``[start, end)`` (``end`` None: to the end) for
    ``keep_s`` seconds, at ``importance`` (None: the request's own)."""

    start: int
    end: int | None
    importance: float | None
    keep_s: float | None


@dataclass(frozen=True)
class Hints:
    """What a request's hints ask of the KV it computes, in contextkit's terms."""

    importance: float | None = None  # for every block of the prompt, in [0, 1]
    keep_s: float | None = None  # pin every block of the prompt this long
    ranges: tuple[Retention, ...] = ()
    session: str | None = None
    sources: tuple[str, ...] = field(default=())  # the dialects it came from

    def __bool__(self) -> bool:
        return bool(self.importance is not None or self.keep_s or self.ranges
                    or self.session)

    def to_wire(self) -> dict[str, Any]:
        return {"importance": self.importance, "keep_s": self.keep_s,
                "ranges": [[r.start, r.end, r.importance, r.keep_s] for r in self.ranges],
                "session": self.session, "sources": list(self.sources)}

    def at(self, position: int) -> tuple[float | None, float | None]:
        """(importance, keep_s) for the block starting at token ``position``: the
        request-wide hint, raised by the ranges that hold it."""
        importance, keep = self.importance, self.keep_s
        for r in self.ranges:
            if r.start <= position and (r.end is None or position < r.end):
                if r.importance is not None:
                    importance = max(importance or 0.0, r.importance)
                if r.keep_s:
                    keep = max(keep or 0.0, r.keep_s)
        return importance, keep


# ---------------------------------------------------------------------- values
def _number(value: Any, what: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
            value):
        raise ValueError(f"{what} must be a number, got {value!r:.40}")
    if not lo <= value <= hi:
        raise ValueError(f"{what} must be in [{lo:g}, {hi:g}], got {value:g}")
    return float(value)


def _priority(value: Any, what: str) -> float:
    """A 'higher is more important' integer priority as an importance in [0, 1]."""
    if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer, got {value!r:.40}")
    return min(max(value, 0), 100) / 100


def parse_ttl(value: Any, what: str = "ttl") -> float:
    """Seconds from a TTL: a number of seconds, or a string ``"600"``, ``"600s"``,
    ``"5m"``, ``"1h"``."""
    if isinstance(value, str):
        match = _TTL.match(value)
        if match is None:
            raise ValueError(f"{what} must be seconds or like '5m' / '1h', got {value!r:.40}")
        number, unit = float(match.group(1)), match.group(2)
        value = number * {"": 1, "s": 1, "m": 60, "h": 3600}[unit]
    return _number(value, what, 0.0, math.inf)


# ---------------------------------------------------------------------- dialects
def _dynamo(nvext: Any, header_priority: str | None, out: dict[str, Any],
            warnings: list[str]) -> None:
    if nvext is not None and not isinstance(nvext, Mapping):
        warnings.append(f"nvext must be an object, got {type(nvext).__name__}")
        nvext = {}
    nvext = nvext or {}
    agent = nvext.get("agent_hints")
    priority = header_priority
    if priority is None and isinstance(agent, Mapping):
        priority = agent.get("priority")
    elif agent is not None and not isinstance(agent, Mapping):
        warnings.append(f"nvext.agent_hints must be an object, got {type(agent).__name__}")
    if priority is not None:
        try:
            out["importance"] = _priority(priority, "nvext.agent_hints.priority")
            out["sources"].append("dynamo")
        except ValueError as exc:
            warnings.append(str(exc))
    cache = nvext.get("cache_control")
    if cache is not None:
        try:
            if not isinstance(cache, Mapping) or cache.get("type", "ephemeral") != "ephemeral":
                raise ValueError("nvext.cache_control must be {\"type\": \"ephemeral\", "
                                 "\"ttl\": ...}")
            ttl = parse_ttl(cache.get("ttl", "300"), "nvext.cache_control.ttl")
            out["keep_s"] = min(max(ttl, _DYNAMO_TTL[0]), _DYNAMO_TTL[1])
            out["sources"].append("dynamo")
        except ValueError as exc:
            warnings.append(str(exc))


def _retention(directives: Any, out: dict[str, Any], warnings: list[str]) -> None:
    if not isinstance(directives, list):
        warnings.append("retention_directives must be a list of {start, end, priority, "
                        "duration}")
        return
    ranges = []
    for i, d in enumerate(directives[:64]):
        what = f"retention_directives[{i}]"
        try:
            if not isinstance(d, Mapping):
                raise ValueError(f"{what} must be an object")
            start = int(_number(d.get("start", 0), f"{what}.start", 0, 2**40))
            end = d.get("end")
            end = None if end is None else int(_number(end, f"{what}.end", start, 2**40))
            priority = d.get("priority")
            importance = (None if priority is None
                          else _number(priority, f"{what}.priority", 0, 100) / 100)
            duration = d.get("duration")
            keep = (None if duration is None else
                    min(_number(duration, f"{what}.duration", 0, math.inf), MAX_KEEP_S))
            ranges.append(Retention(start, end, importance, keep))
        except ValueError as exc:
            warnings.append(str(exc))
    if ranges:
        out["ranges"] = tuple(ranges)
        out["sources"].append("vllm-retention")


def _agent_hint(hint: Any, out: dict[str, Any], warnings: list[str]) -> None:
    if not isinstance(hint, Mapping):
        warnings.append("agent_hint must be an object")
        return
    cache = hint.get("cache_control")
    if cache is not None:
        try:
            if not isinstance(cache, Mapping):
                raise ValueError("agent_hint.cache_control must be an object")
            ttl = _number(cache.get("ttl", 300), "agent_hint.cache_control.ttl", 0,
                          MAX_KEEP_S)
            out["keep_s"] = max(out.get("keep_s") or 0.0, ttl)
            out["sources"].append("vllm-agent-hint")
        except ValueError as exc:
            warnings.append(str(exc))
    session = hint.get("session_id")
    if isinstance(session, str) and session:
        out.setdefault("session", session[:256])


def from_request(body: Mapping[str, Any], headers: Mapping[str, str], *,
                 priority_scheduling: bool = False
                 ) -> tuple[Hints | None, list[str], list[str]]:
    """Hints from an OpenAI request's body and headers (lower-case names).

    Returns the hints (None if none was given or usable), one line per hint dropped,
    and the body fields consumed, which the caller removes before vLLM reads the body:
    vLLM's API documents a non-zero ``priority`` as an error unless it schedules by
    priority (0.32 lets it through, meaningless under first-come-first-served), and
    ignores the others. With ``priority_scheduling``, ``priority`` is vLLM's (lower is earlier)
    and is left alone.
    """
    out: dict[str, Any] = {"sources": []}
    warnings: list[str] = []
    consumed: list[str] = []
    if "nvext" in body or "x-dynamo-request-priority" in headers:
        _dynamo(body.get("nvext"), headers.get("x-dynamo-request-priority"), out, warnings)
        if "nvext" in body:
            consumed.append("nvext")
    sglang = headers.get("x-override-priority", body.get("priority"))
    if sglang is not None and not priority_scheduling:
        try:
            importance = _priority(sglang, "priority")
            out["importance"] = max(out.get("importance") or 0.0, importance)
            out["sources"].append("sglang")
        except ValueError as exc:
            warnings.append(str(exc))
        if "priority" in body:
            consumed.append("priority")
    if "retention_directives" in body:
        _retention(body["retention_directives"], out, warnings)
        consumed.append("retention_directives")
    if "agent_hint" in body:
        _agent_hint(body["agent_hint"], out, warnings)
        consumed.append("agent_hint")
    scope = body.get("retention_scope")
    if "retention_scope" in body:
        consumed.append("retention_scope")
    session = next((headers[h] for h in SESSION_HEADERS if headers.get(h)), None)
    if session is None and isinstance(scope, str) and scope:
        session = scope
    if session is not None:
        out.setdefault("session", session[:256])
    hints = Hints(out.get("importance"), out.get("keep_s"), out.get("ranges", ()),
                  out.get("session"), tuple(dict.fromkeys(out["sources"])))
    return (hints if hints else None), warnings, consumed


def from_wire(params: Any) -> tuple[Hints | None, str | None]:
    """The hints in a request's ``kv_transfer_params`` (:data:`HINTS_KEY`), checked
    again (a client may send them directly): (hints, None), (None, why) for an entry
    that is not usable, or (None, None) for none."""
    entry = params.get(HINTS_KEY) if isinstance(params, Mapping) else None
    if entry is None:
        return None, None
    try:
        if not isinstance(entry, Mapping):
            raise ValueError(f"{HINTS_KEY} must be an object")
        importance = entry.get("importance")
        importance = None if importance is None else _number(importance, "importance", 0, 1)
        keep = entry.get("keep_s")
        keep = None if keep is None else _number(keep, "keep_s", 0, MAX_KEEP_S)
        ranges = []
        raw = entry.get("ranges") or []
        if not isinstance(raw, list):
            raise ValueError("ranges must be a list")
        for r in raw[:64]:
            if not isinstance(r, list) or len(r) != 4:
                raise ValueError("each range must be [start, end, importance, keep_s]")
            start = int(_number(r[0], "range start", 0, 2**40))
            end = None if r[1] is None else int(_number(r[1], "range end", start, 2**40))
            imp = None if r[2] is None else _number(r[2], "range importance", 0, 1)
            kept = None if r[3] is None else _number(r[3], "range keep_s", 0, MAX_KEEP_S)
            ranges.append(Retention(start, end, imp, kept))
        session = entry.get("session")
        sources = entry.get("sources") or []
        hints = Hints(importance, keep, tuple(ranges),
                      session[:256] if isinstance(session, str) else None,
                      tuple(str(s)[:32] for s in sources[:8]) if isinstance(sources, list)
                      else ())
    except (ValueError, TypeError) as exc:
        return None, str(exc)
    return (hints if hints else None), None
