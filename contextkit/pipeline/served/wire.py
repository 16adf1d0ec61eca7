"""The wire format between a pipeline and contextkit's vLLM connector: contextkit's
entry in a request's ``kv_transfer_params`` (one definition, imported by both sides).

A labelled request carries::

    {"kv_transfer_params": {"contextkit": {
        "spans": [[start, end, source_layer, importance, pinned], ...],
        "pin": bool, "prompt_tokens": int, "prompt_sha256": str,
        "precision": {...}, "volatile_from": int}}}

``spans`` label token ranges of the prompt (:class:`WireSpan`, a JSON list read by
position; ``pinned`` is optional: without it the request's ``pin`` decides for
pinnable layers); ``prompt_tokens`` and ``prompt_sha256`` fingerprint the prompt the
ranges were computed on (:func:`prompt_fingerprint`); ``precision`` is a request's
precision policy keys over the server's; ``volatile_from`` is the first token of the
prompt's volatile tail (the trailing message of volatile layers and what follows it),
which the sender's next call changes, so no later prompt reuses it as a prefix. The
pipeline writes it
(:meth:`~contextkit.pipeline.pipeline.CacheAwareContextPipeline.request_fields`), as
does :func:`integrations.vllm.planning.semantic_params`; the connector's planner reads
it (:mod:`integrations.vllm.planning`).

A response carries back what its prompt reused, in its own ``kv_transfer_params``::

    {"kv_transfer_params": {"contextkit_cache": {
        "reuse": "prefix" | "recomputed" | "none", "prompt_tokens": int,
        "vllm_cached_tokens": int, "contextkit_loaded_tokens": int,
        "shared_tier_tokens": int, "computed_tokens": int,
        "fallback": str | None, "complete": bool}}}

(:func:`cache_report` reads it).

Standard library only: the connector's scheduler side imports it without torch.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

__all__ = [
    "CHUNKS_SALT_SUFFIX",
    "HINTS_KEY",
    "MAX_KEEP_S",
    "PARAMS_KEY",
    "REPORT_KEY",
    "REUSE_CLASSES",
    "TURN_LAYER",
    "WireSpan",
    "cache_report",
    "chunk_salt",
    "decode_fingerprint",
    "decode_precision",
    "decode_spans",
    "decode_volatile_from",
    "encode_hints",
    "encode_labels",
    "labels_entry",
    "opted_into_chunks",
    "prompt_fingerprint",
    "with_hints",
]

#: contextkit's key in a request's ``kv_transfer_params``.
PARAMS_KEY = "contextkit"

#: The source layer of a conversation message's span (every message of the chat).
TURN_LAYER = "user_turn"
#: contextkit's key in a response's ``kv_transfer_params``: what the prompt reused.
REPORT_KEY = "contextkit_cache"
#: contextkit's key in a request's ``kv_transfer_params``: its agent hints, normalized
#: (``{"session": str, "keep_s": seconds, "importance": 0..1, "ranges": [[start, end,
#: importance, keep_s], ...]}``, every key optional); the connector's middleware writes
#: it from the serving stacks' dialects (``integrations.vllm.hints``), a pipeline from
#: its run's metadata (:func:`encode_hints`).
HINTS_KEY = "contextkit_hints"
#: The longest a hint keeps blocks (Dynamo's cache_control ceiling).
MAX_KEEP_S = 3600.0
#: A report's reuse classes.
REUSE_CLASSES = ("prefix", "chunk", "recomputed", "none")
#: The end of a ``cache_salt`` that opts a request into chunk reuse on vLLM: K/V moved
#: from elsewhere in the cache, its seams repaired, an approximation of a full prefill.
#: vLLM keys its prefix cache by the salt, so such blocks never reach a request whose
#: salt lacks it (see :func:`chunk_salt`).
CHUNKS_SALT_SUFFIX = "#ck-chunks"


def chunk_salt(tenant: str | None) -> str:
    """The ``cache_salt`` of ``tenant``'s requests that opt into chunk reuse (contextkit's
    tenant on vLLM is the salt; these requests are a namespace of their own)."""
    base = tenant or "default"
    return base if base.endswith(CHUNKS_SALT_SUFFIX) else base + CHUNKS_SALT_SUFFIX


def opted_into_chunks(salt: str | None) -> bool:
    """Whether a request with this ``cache_salt`` opted into chunk reuse."""
    return bool(salt) and str(salt).endswith(CHUNKS_SALT_SUFFIX)


def encode_hints(*, session: str | None = None, keep_s: float | None = None,
                 importance: float | None = None) -> dict[str, Any] | None:
    """A hints entry (None when it would say nothing).

    Raises:
        ValueError: ``keep_s`` outside [0, :data:`MAX_KEEP_S`] or ``importance``
            outside [0, 1].
    """
    if keep_s is not None and not (isinstance(keep_s, int | float) and 0 <= keep_s <= MAX_KEEP_S):
        raise ValueError(f"keep_s must be seconds in [0, {MAX_KEEP_S:g}], got {keep_s!r:.40}")
    if importance is not None and not (isinstance(importance, int | float)
                                       and 0 <= importance <= 1):
        raise ValueError(f"importance must be in [0, 1], got {importance!r:.40}")
    entry = {"session": str(session)[:256] if session else None, "keep_s": keep_s,
             "importance": importance}
    out = {k: v for k, v in entry.items() if v is not None}
    return out or None


def with_hints(fields: Mapping[str, Any], entry: Mapping[str, Any] | None) -> dict[str, Any]:
    """Request ``fields`` (``request_fields``' output) carrying a hints entry; unchanged
    without one, or for a server that takes no fields (``{}``)."""
    if not entry or not fields:
        return dict(fields)
    params = dict(fields.get("kv_transfer_params") or {})
    params[HINTS_KEY] = dict(entry)
    return {**fields, "kv_transfer_params": params}


def cache_report(params: object) -> dict[str, Any] | None:
    """contextkit's cache report from a response's ``kv_transfer_params`` (None where
    there is none: no connector, or another server)."""
    entry = params.get(REPORT_KEY) if isinstance(params, Mapping) else None
    return dict(entry) if isinstance(entry, Mapping) else None


class WireSpan(NamedTuple):
    """One labelled token range, as it travels: ``[start, end, source_layer,
    importance]`` plus ``pinned`` when the sender decides the pin per span.

    Attributes:
        start, end: the token range ``[start, end)`` in the server's prompt ids.
        source_layer: the layer the range holds (``user_turn`` for the conversation).
        importance: in ``[0, 1]``.
        pinned: pin the range's blocks; ``None``: not sent (the request's ``pin``
            decides, for pinnable layers).
    """

    start: int
    end: int
    source_layer: str
    importance: float = 0.5
    pinned: bool | None = None

    def encode(self) -> list[Any]:
        """The JSON list form (``pinned`` only when set)."""
        head: list[Any] = [self.start, self.end, self.source_layer, self.importance]
        return head if self.pinned is None else [*head, self.pinned]

    @classmethod
    def decode(cls, item: Sequence[Any]) -> WireSpan:
        """A span from its JSON list form.

        Raises:
            TypeError, ValueError, IndexError: not a list of at least four values of
                the right kinds.
        """
        return cls(int(item[0]), int(item[1]), str(item[2]), float(item[3]),
                   bool(item[4]) if len(item) > 4 else None)


def prompt_fingerprint(token_ids: Sequence[int]) -> tuple[int, str]:
    """``(prompt_tokens, prompt_sha256)`` of prompt ids: their count and the SHA-256 hex
    of the ids packed as little-endian int32 (what a labelled request carries so the
    connector can tell its spans were computed for this very prompt)."""
    ids = [int(t) for t in token_ids]
    return len(ids), hashlib.sha256(struct.pack(f"<{len(ids)}i", *ids)).hexdigest()


def encode_labels(spans: Iterable[WireSpan], *, pin: bool,
                  prompt_token_ids: Sequence[int] | None = None,
                  precision: Mapping[str, Any] | None = None,
                  volatile_from: int | None = None) -> dict[str, Any]:
    """contextkit's entry of ``kv_transfer_params``, keyed: ``{PARAMS_KEY: {...}}``.

    Args:
        spans: the labelled ranges.
        pin: pin the blocks of pinnable layers in spans without their own flag.
        prompt_token_ids: the prompt the ranges were computed on (its fingerprint is
            sent; ``None``: none is).
        precision: precision policy keys over the server's, as plain JSON values.
        volatile_from: the first token of the prompt's volatile tail (``None``: not
            sent; the connector then stores every block alike).
    """
    ours: dict[str, Any] = {"spans": [span.encode() for span in spans], "pin": bool(pin)}
    if prompt_token_ids is not None:
        ours["prompt_tokens"], ours["prompt_sha256"] = prompt_fingerprint(prompt_token_ids)
    if precision is not None:
        ours["precision"] = dict(precision)
    if volatile_from is not None:
        ours["volatile_from"] = int(volatile_from)
    return {PARAMS_KEY: ours}


def labels_entry(params: object) -> Any:
    """contextkit's entry of ``kv_transfer_params`` as sent (``None`` when there is none,
    or when ``params`` is not a mapping); the readers below take it apart."""
    return params.get(PARAMS_KEY) if isinstance(params, Mapping) else None


def decode_spans(entry: Any) -> tuple[bool, list[WireSpan]]:
    """The request's ``pin`` and its spans, from an entry.

    Raises:
        TypeError, ValueError, IndexError, AttributeError, KeyError: a malformed entry.
    """
    return bool(entry.get("pin", False)), [WireSpan.decode(s) for s in entry.get("spans", [])]


def decode_fingerprint(entry: Mapping[str, Any]) -> tuple[Any, Any]:
    """``(prompt_tokens, prompt_sha256)`` as sent (each ``None`` when absent)."""
    return entry.get("prompt_tokens"), entry.get("prompt_sha256")


def decode_precision(entry: Mapping[str, Any]) -> Any:
    """The request's precision policy keys as sent (``None`` when absent)."""
    return entry.get("precision")


def decode_volatile_from(entry: Mapping[str, Any]) -> Any:
    """The first token of the volatile tail as sent (``None`` when absent)."""
    return entry.get("volatile_from")
