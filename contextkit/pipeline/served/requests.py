"""A pipeline attached to a served model: the OpenAI-format layout of a chat request,
the request fields that label its token ranges for contextkit's vLLM connector, and the
usage the server reports back (the :class:`~contextkit.pipeline.pipeline.CacheAwareContextPipeline`
methods ``openai_messages``, ``request_fields`` and ``record_usage``)."""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from contextkit.pipeline.reports import BuiltPrompt, CallReport, _tokens_by_layer
from contextkit.pipeline.tenancy import _check_tenant, _TenantState
from contextkit.engine.types import TokenSpan
from contextkit.prompt.layers import LayerConfig
from contextkit.pipeline.served.model import LabelRangeError, ServedModel
from gpu_cache import InvalidNameError
from gpu_cache.metadata import PINNABLE_SOURCES

if TYPE_CHECKING:
    from contextkit.engine.engine import Engine
    from contextkit.metrics import ContextkitMetrics

logger = logging.getLogger("contextkit.pipeline.pipeline")

#: The connector's key in ``kv_transfer_params`` (integrations/vllm/planning.py).
PARAMS_KEY = "contextkit"
#: Source layer and importance of conversation messages (as the embedded engine labels them).
TURN_LAYER, TURN_IMPORTANCE = "user_turn", 0.3
#: Characters vLLM refuses in ``cache_salt`` (with more than 128 characters).
_SALT_FORBIDDEN = frozenset("@/\\\x00")


def cache_salt(tenant: str) -> str:
    """``tenant`` as vLLM's ``cache_salt`` (which the connector reads as the tenant).

    Raises:
        InvalidNameError: a tenant vLLM would refuse as a salt (``@``, ``/``, ``\\``, NUL).
    """
    tenant = _check_tenant(tenant)
    if any(c in _SALT_FORBIDDEN for c in tenant) or len(tenant) > 128:
        raise InvalidNameError(
            f"tenant {tenant!r} cannot be sent to vLLM as cache_salt, which refuses '@', '/', "
            "'\\' and NUL; use a tenant name without '@' for a pipeline on a served model")
    return tenant


class _ServedPipeline:
    """The served-model side of a pipeline (mixed into CacheAwareContextPipeline)."""

    engine: Engine | None
    served: ServedModel | None
    config: LayerConfig
    pin_stable: bool
    _lock: threading.RLock

    if TYPE_CHECKING:  # provided by _TenantViews and the pipeline
        def resolve_tenant(self, tenant: str | None = None) -> str: ...
        def _state(self, tenant: str) -> _TenantState: ...
        @property
        def metrics(self) -> ContextkitMetrics | None: ...

    def _built_for(self, tenant: str | None,
                   built: BuiltPrompt | None) -> tuple[str, BuiltPrompt]:
        """The tenant of a call and the prompt it uses (the tenant's last by default).

        Raises:
            RuntimeError: nothing built for the tenant yet.
            ValueError: ``built`` belongs to another tenant.
        """
        if tenant is None:
            tenant = built.report.tenant if built is not None else self.resolve_tenant()
        tenant = _check_tenant(tenant)
        if built is None:
            with self._lock:
                built = self._state(tenant).last
            if built is None:
                raise RuntimeError(f"no system prompt built for tenant {tenant!r} yet; call "
                                   "the wrapped build_system_message (or pipeline.build) first")
        elif built.report.tenant != tenant:
            raise ValueError(f"this prompt was built for tenant {built.report.tenant!r}, not "
                             f"{tenant!r}; tenants never share blocks")
        return tenant, built

    def openai_messages(self, conversation: Sequence[Mapping[str, Any]], *,
                        tenant: str | None = None,
                        built: BuiltPrompt | None = None) -> list[dict[str, Any]]:
        """The chat request's messages, laid out as the embedded engine lays out a turn.

        ``conversation`` is the OpenAI-format messages without the system prompt: the
        history, the current user turn and any tool rounds after it. The result is the
        main system message (the stable and changing layers), the history, a trailing
        system message with the volatile layers (none when there are none, or with
        ``trailing_message=False``), then the last user message and everything after
        it. A system message's content is its sections' ``[LAYER]...[/LAYER]`` texts, one
        per line (the same text as :attr:`BuiltPrompt.text`'s parts); the main one is
        sent even when empty, so no template injects a default system prompt. ``built`` picks a
        :meth:`build` result (default: the tenant's last).

        Raises:
            RuntimeError: nothing built for the tenant yet.
            ValueError: a conversation item is not a message dict with a role, or
                ``built`` belongs to another tenant.
        """
        _, built = self._built_for(tenant, built)
        turns = []
        for i, m in enumerate(conversation):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise ValueError(f"conversation item {i} is not an OpenAI message dict with a "
                                 f"string 'role' (got {type(m).__name__})")
            turns.append(dict(m))
        users = [i for i, m in enumerate(turns) if m["role"] == "user"]
        cut = users[-1] if users else len(turns)

        def system(sections: Sequence[Any]) -> dict[str, Any]:
            return {"role": "system",
                    "content": "".join(built.section_texts[s.layer] for s in sections)[:-1]}

        out = [system(built.main), *turns[:cut]]
        if built.trailing:
            out.append(system(built.trailing))
        return out + turns[cut:]

    def request_fields(self, messages: Sequence[Mapping[str, Any]], *,
                       tenant: str | None = None, built: BuiltPrompt | None = None,
                       tools: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
        """The body fields that label a ``/v1/chat/completions`` request for contextkit's
        vLLM connector: ``{"kv_transfer_params": {"contextkit": {...}}, "cache_salt":
        tenant}`` (pass them as the client's ``extra_body``).

        ``messages`` is exactly what will be sent (normally :meth:`openai_messages`'
        output; any list that holds each built section verbatim works), ``tools`` the
        request's tools. The spans are ``[start, end, source_layer, importance, pinned]``
        in the server's prompt ids (:meth:`ServedModel.render`): one per built section
        (``pinned``: a stable-prefix layer of a pinnable source, with ``pin_stable``)
        and one per other message (``user_turn``, 0.3). A span owns the tokens whose
        first character lies between the end of the previous span's text and the end
        of its own text, so the spans tile the prompt from token 0 through the last
        message's content: the chat markup before a text belongs to it, and a token
        merging across a boundary belongs to the text its first character is in. The
        markup after the last message (and the generation prompt) is in no span.

        Raises:
            RuntimeError: the pipeline is not attached to a served model, or nothing is
                built for the tenant yet.
            LabelRangeError: a built section is not in ``messages`` verbatim, or the
                messages cannot be rendered exactly (see :meth:`ServedModel.render`).
            InvalidNameError: a tenant vLLM refuses as ``cache_salt`` (it contains ``@``).
        """
        served = self.served
        if served is None:
            raise RuntimeError("request_fields needs a pipeline attached to a served model: "
                               "CacheAwareContextPipeline(served=ServedModel(model_dir))")
        tenant, built = self._built_for(tenant, built)
        salt = cache_salt(tenant)
        rendered = served.render(messages, tools)
        contents = served.content_spans(messages, tools, rendered)
        texts = [rendered.text[a:b] for a, b in contents]
        roles = [str(m.get("role")) for m in messages]
        search = ([k for k, r in enumerate(roles) if r == "system"]
                  + [k for k, r in enumerate(roles) if r != "system"])
        labelled: list[tuple[int, int, str, float, bool]] = []
        holders: set[int] = set()
        stable = set(built.stable_layers)
        for section in (*built.main, *built.trailing):
            core = built.section_texts[section.layer][:-1]  # without its final newline
            for k in search:
                at = texts[k].find(core)
                if at >= 0:
                    break
            else:
                raise LabelRangeError(
                    f"layer {section.layer}'s [{section.layer.upper()}] section is not in the "
                    "messages verbatim, so its tokens cannot be labelled; send the messages "
                    "of pipeline.openai_messages() (or keep each built section intact)")
            end = at + len(core)
            if texts[k][end:end + 1] == "\n":
                end += 1
            spec = self.config.get(section.layer)
            importance = max((line.importance for line in section.lines), default=0.5)
            pinned = (self.pin_stable and section.layer in stable
                      and spec.source in PINNABLE_SOURCES)
            labelled.append((contents[k][0] + at, contents[k][0] + end, spec.source,
                             float(importance), pinned))
            holders.add(k)
        labelled += [(a, b, TURN_LAYER, TURN_IMPORTANCE, False)
                     for k, (a, b) in enumerate(contents) if k not in holders]
        labelled.sort(key=lambda s: (s[0], s[1]))
        spans: list[list[Any]] = []
        gap = 0
        for a, b, layer, importance, pinned in labelled:
            start, end = rendered.first_token_at(min(gap, a)), rendered.first_token_at(b)
            if end > start:
                spans.append([start, end, layer, importance, pinned])
            gap = max(gap, b)
        ids = rendered.token_ids
        digest = hashlib.sha256(struct.pack(f"<{len(ids)}i", *ids)).hexdigest()
        with self._lock:
            self._state(tenant).last_request = (
                built.report, len(ids), [TokenSpan(s[0], s[1], s[2], s[3]) for s in spans])
        return {"kv_transfer_params": {PARAMS_KEY: {
                    "spans": spans, "pin": self.pin_stable, "prompt_tokens": len(ids),
                    "prompt_sha256": digest}},
                "cache_salt": salt}

    def record_usage(self, report_or_tenant: CallReport | str | None, prompt_tokens: int,
                     cached_tokens: int) -> CallReport:
        """Fill a call's report from the usage the server reported (``prompt_tokens``
        and ``prompt_tokens_details.cached_tokens``): prompt, reused and computed tokens,
        the reuse ratio and, when the counts are those of the tenant's last
        :meth:`request_fields`, the reused and computed tokens per layer (also counted in
        ``contextkit_pipeline_prompt_tokens``).

        ``report_or_tenant``: the call's report, or a tenant (``None``: the resolved
        tenant) whose last report is meant.

        Returns:
            The report.

        Raises:
            RuntimeError: no report for the tenant yet.
            ValueError: counts that are not ints with ``0 <= cached_tokens <=
                prompt_tokens``.
        """
        for name, value in (("prompt_tokens", prompt_tokens), ("cached_tokens", cached_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0 (the server's usage), got "
                                 f"{value!r}")
        if cached_tokens > prompt_tokens:
            raise ValueError(f"cached_tokens ({cached_tokens}) exceeds prompt_tokens "
                             f"({prompt_tokens}); pass the server's usage as reported")
        if isinstance(report_or_tenant, CallReport):
            report = report_or_tenant
        else:
            tenant = self.resolve_tenant(report_or_tenant)
            with self._lock:
                last = self._state(tenant).last
            if last is None:
                raise RuntimeError(f"no call for tenant {tenant!r} yet; build a prompt and "
                                   "send a request first")
            report = last.report
        with self._lock:
            state = self._state(report.tenant)
            request = state.last_request
            report.prompt_tokens = prompt_tokens
            report.reused_tokens = cached_tokens
            report.computed_tokens = prompt_tokens - cached_tokens
            report.kv_reuse_ratio = cached_tokens / prompt_tokens if prompt_tokens else 0.0
            if request is not None and request[0] is report and request[1] == prompt_tokens:
                report.reused_by_layer, report.computed_by_layer = _tokens_by_layer(
                    request[2], prompt_tokens, cached_tokens)
            else:
                report.reused_by_layer, report.computed_by_layer = {}, {}
                logger.debug("tenant %s: usage of a request whose fields were not computed "
                             "here; no per-layer split", report.tenant)
        metrics = self.metrics
        if metrics is not None:
            for kind, by_layer in (("reused", report.reused_by_layer),
                                   ("computed", report.computed_by_layer)):
                for layer, tokens in by_layer.items():
                    if tokens:
                        metrics.pipeline_tokens.labels(layer, kind).inc(tokens)
        return report
