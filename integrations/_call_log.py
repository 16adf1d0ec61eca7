"""The telemetry the LangChain and LlamaIndex handlers write.

:class:`CallLog` holds one :class:`ModelCall` per model call, with the usage and
prompt-cache figures the provider reported; :func:`usage_from` reads those from the
engine's, Anthropic's or OpenAI's shapes. Nothing here imports LangChain or LlamaIndex.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["CallLog", "LogView", "ModelCall", "usage_from"]


def _get(obj: Any, key: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(key)
    return getattr(obj, key, None)


def usage_from(obj: Any) -> dict[str, int]:
    """Normalize a usage report to input/output/cache_read/cache_creation tokens.

    Understands LangChain's ``UsageMetadata`` (``input_token_details``), Anthropic's
    usage (``cache_read_input_tokens``, ``cache_creation_input_tokens``) and
    OpenAI's (``prompt_tokens``, ``prompt_tokens_details.cached_tokens``), as
    mappings or objects. Missing figures are left out.
    """
    if obj is None:
        return {}
    out: dict[str, int] = {}

    def put(name: str, *values: Any) -> None:
        for v in values:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[name] = int(v)
                return

    put("input_tokens", _get(obj, "input_tokens"), _get(obj, "prompt_tokens"))
    put("output_tokens", _get(obj, "output_tokens"), _get(obj, "completion_tokens"))
    details = _get(obj, "input_token_details")
    put("cache_read_tokens", _get(details, "cache_read"), _get(obj, "cache_read_input_tokens"),
        _get(_get(obj, "prompt_tokens_details"), "cached_tokens"))
    put("cache_creation_tokens", _get(details, "cache_creation"),
        _get(obj, "cache_creation_input_tokens"))
    return out


@dataclass
class ModelCall:
    """One model call seen by a telemetry handler."""

    run_id: str
    framework: str
    model: str | None = None
    tenant: str | None = None
    started_at: float = 0.0
    latency_ms: float | None = None
    messages: int = 0
    system_chars: int = 0
    layers: list[str] = field(default_factory=list)
    #: the system message's content blocks: characters and whether each has a
    #: provider cache breakpoint
    content_blocks: list[dict[str, Any]] = field(default_factory=list)
    stable_hash: str | None = None
    prefix_broken_by: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_tokens: int | None = None
    cache_creation_tokens: int | None = None
    ttft_ms: float | None = None
    kv_reuse_ratio: float | None = None
    error: str | None = None
    done: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class CallLog:
    """Thread-safe log of :class:`ModelCall` records, with a summary.

    Args:
        sink: called with each finished record (e.g. to export metrics).
        max_records: oldest records are dropped beyond this.
    """

    def __init__(self, sink: Callable[[ModelCall], None] | None = None,
                 max_records: int = 10_000) -> None:
        self.sink = sink
        self.max_records = max_records
        self._records: list[ModelCall] = []
        self._open: dict[str, tuple[ModelCall, float]] = {}
        self._lock = threading.Lock()

    def start(self, run_id: str, framework: str, **fields: Any) -> ModelCall:
        rec = ModelCall(run_id=str(run_id), framework=framework, started_at=time.time(),
                        **fields)
        with self._lock:
            self._open[rec.run_id] = (rec, time.perf_counter())
            self._records.append(rec)
            del self._records[:-self.max_records]
        return rec

    def end(self, run_id: str, *, error: str | None = None, **fields: Any) -> ModelCall | None:
        """Finish a record (unknown run ids are ignored: observing never raises)."""
        with self._lock:
            entry = self._open.pop(str(run_id), None)
        if entry is None:
            return None
        rec, t0 = entry
        rec.latency_ms = (time.perf_counter() - t0) * 1000
        for key, value in fields.items():
            if value is not None and hasattr(rec, key):
                setattr(rec, key, value)
        rec.error = error
        rec.done = True
        if self.sink is not None:
            self.sink(rec)
        return rec

    def is_open(self, run_id: str) -> bool:
        """Whether ``run_id`` was started and not ended yet."""
        with self._lock:
            return str(run_id) in self._open

    @property
    def records(self) -> list[ModelCall]:
        with self._lock:
            return list(self._records)

    def summary(self) -> dict[str, Any]:
        """Totals over finished calls: tokens, cache reads, hit ratio, TTFT p50."""
        done = [r for r in self.records if r.done]
        total_in = sum(r.input_tokens or 0 for r in done)
        read = sum(r.cache_read_tokens or 0 for r in done)
        ttfts = [r.ttft_ms for r in done if r.ttft_ms is not None]
        return {
            "calls": len(done), "errors": sum(1 for r in done if r.error),
            "input_tokens": total_in, "output_tokens": sum(r.output_tokens or 0 for r in done),
            "cache_read_tokens": read,
            "cache_creation_tokens": sum(r.cache_creation_tokens or 0 for r in done),
            "cache_hit_ratio": read / total_in if total_in else 0.0,
            "ttft_ms_p50": statistics.median(ttfts) if ttfts else None,
        }


class LogView:
    """``records`` and ``summary()`` of a handler's :class:`CallLog` (``self.log``)."""

    log: CallLog

    @property
    def records(self) -> list[ModelCall]:
        """Every call seen so far (oldest first)."""
        return self.log.records

    def summary(self) -> dict[str, Any]:
        """See :meth:`CallLog.summary`."""
        return self.log.summary()
