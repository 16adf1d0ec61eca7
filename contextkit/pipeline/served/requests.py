"""A pipeline attached to a served model: the OpenAI-format layout of a chat request,
the request fields that label its token ranges for contextkit's vLLM connector, and the
usage the server reports back (:class:`ServedRequests`, owned by
:class:`~contextkit.pipeline.pipeline.CacheAwareContextPipeline`, whose methods
``openai_messages``, ``request_fields`` and ``record_usage`` delegate to it; the fields'
wire format is :mod:`contextkit.pipeline.served.wire`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from contextkit.engine.types import TokenSpan
from contextkit.pipeline.reports import BuiltPrompt, CallReport, tokens_by_layer
from contextkit.pipeline.served.model import LabelRangeError, ServedModel
from contextkit.pipeline.served.wire import TURN_LAYER, WireSpan, chunk_salt, encode_labels
from contextkit.pipeline.tenancy import TenantViews, check_tenant
from contextkit.prompt.layers import LayerConfig
from gpu_cache import InvalidNameError
from gpu_cache.metadata import PINNABLE_SOURCES

if TYPE_CHECKING:
    from contextkit.metrics import ContextkitMetrics

logger = logging.getLogger("contextkit.pipeline.pipeline")

#: Source layer and importance of conversation messages (as the embedded engine labels them).
TURN_IMPORTANCE = 0.3
#: Characters vLLM refuses in ``cache_salt`` (with more than 128 characters).
_SALT_FORBIDDEN = frozenset("@/\\\x00")


def cache_salt(tenant: str) -> str:
    """``tenant`` as vLLM's ``cache_salt`` (which the connector reads as the tenant).

    Raises:
        InvalidNameError: a tenant vLLM would refuse as a salt (``@``, ``/``, ``\\``, NUL).
    """
    tenant = check_tenant(tenant)
    if any(c in _SALT_FORBIDDEN for c in tenant) or len(tenant) > 128:
        raise InvalidNameError(
            f"tenant {tenant!r} cannot be sent to vLLM as cache_salt, which refuses '@', '/', "
            "'\\' and NUL; use a tenant name without '@' for a pipeline on a served model")
    return tenant


class ServedRequests:
    """The served-model side of a pipeline: chat layouts, request fields, usage.

    Args:
        served: the model a vLLM server serves (``None``: :meth:`request_fields`
            refuses; the layout and the usage work for an embedded engine too).
        config: the pipeline's layers.
        tenants: the pipeline's tenants (their last builds and requests).
        metrics: where the per-layer token counts go (``None`` from it: nowhere).
    """

    def __init__(self, served: ServedModel | None, config: LayerConfig, tenants: TenantViews,
                 metrics: Callable[[], ContextkitMetrics | None]) -> None:
        self.served = served
        self.config = config
        self.tenants = tenants
        self.metrics = metrics

    def built_for(self, tenant: str | None,
                  built: BuiltPrompt | None) -> tuple[str, BuiltPrompt]:
        """The tenant of a call and the prompt it uses (the tenant's last by default).

        Raises:
            RuntimeError: nothing built for the tenant yet.
            ValueError: ``built`` belongs to another tenant.
        """
        if tenant is None:
            tenant = built.report.tenant if built is not None else self.tenants.resolve()
        tenant = check_tenant(tenant)
        if built is None:
            built = self.tenants.last(tenant)
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
        """See :meth:`CacheAwareContextPipeline.openai_messages`."""
        _, built = self.built_for(tenant, built)
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

    def request_fields(self, messages: Sequence[Mapping[str, Any]], *, pin: bool,
                       tenant: str | None = None, built: BuiltPrompt | None = None,
                       tools: Sequence[Mapping[str, Any]] | None = None,
                       chunks: bool = False) -> dict[str, Any]:
        """See :meth:`CacheAwareContextPipeline.request_fields`; ``pin``: the pipeline's
        ``pin_stable``, ``chunks``: its ``reuse_chunks`` (the salt opts into chunk
        reuse). ``{}`` when the served model sends no fields
        (:attr:`ServedModel.sends_fields`): the spans are still computed, for the
        per-layer usage."""
        served = self.served
        if served is None:
            raise RuntimeError("request_fields needs a pipeline attached to a served model: "
                               "CacheAwareContextPipeline(served=ServedModel(model_dir))")
        tenant, built = self.built_for(tenant, built)
        salt = cache_salt(tenant)
        if chunks:
            salt = chunk_salt(salt)
            if len(salt) > 128:
                raise InvalidNameError(f"tenant {tenant!r} is too long to opt into chunk "
                                       "reuse: vLLM's cache_salt takes 128 characters")
        rendered = served.render(messages, tools)
        contents = served.content_spans(messages, tools, rendered)
        texts = [rendered.text[a:b] for a, b in contents]
        roles = [str(m.get("role")) for m in messages]
        search = ([k for k, r in enumerate(roles) if r == "system"]
                  + [k for k, r in enumerate(roles) if r != "system"])
        labelled: list[tuple[int, int, str, float, bool]] = []
        holders: set[int] = set()
        stable = set(built.stable_layers)
        trailing = {section.layer for section in built.trailing}
        tail_at: int | None = None  # where the trailing message's first section starts
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
            pinned = pin and section.layer in stable and spec.source in PINNABLE_SOURCES
            labelled.append((contents[k][0] + at, contents[k][0] + end, spec.source,
                             float(importance), pinned))
            if section.layer in trailing:
                first = contents[k][0] + at
                tail_at = first if tail_at is None else min(tail_at, first)
            holders.add(k)
        labelled += [(a, b, TURN_LAYER, TURN_IMPORTANCE, False)
                     for k, (a, b) in enumerate(contents) if k not in holders]
        labelled.sort(key=lambda s: (s[0], s[1]))
        spans: list[WireSpan] = []
        gap = 0
        for a, b, layer, importance, pinned in labelled:
            start, end = rendered.first_token_at(min(gap, a)), rendered.first_token_at(b)
            if end > start:
                spans.append(WireSpan(start, end, layer, importance, pinned))
            gap = max(gap, b)
        ids = rendered.token_ids
        with self.tenants.lock:
            self.tenants.state(tenant).last_request = (built.report, len(ids), [
                TokenSpan(s.start, s.end, s.source_layer, s.importance) for s in spans])
            built.report.served_fields = "sent" if served.sends_fields else "plain"
        if not served.sends_fields:
            return {}
        # the trailing message and all after it change on the next call: no later prompt
        # reuses them as a prefix (the connector stores them only while it has room)
        volatile_from = None if tail_at is None else rendered.first_token_at(tail_at)
        return {"kv_transfer_params": encode_labels(spans, pin=pin, prompt_token_ids=ids,
                                                    volatile_from=volatile_from),
                "cache_salt": salt}

    def record_usage(self, report_or_tenant: CallReport | str | None, prompt_tokens: int,
                     cached_tokens: int) -> CallReport:
        """See :meth:`CacheAwareContextPipeline.record_usage`."""
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
            tenant = self.tenants.resolve(report_or_tenant)
            last = self.tenants.last(tenant)
            if last is None:
                raise RuntimeError(f"no call for tenant {tenant!r} yet; build a prompt and "
                                   "send a request first")
            report = last.report
        with self.tenants.lock:
            state = self.tenants.state(report.tenant)
            request = state.last_request
            report.prompt_tokens = prompt_tokens
            report.reused_tokens = cached_tokens
            report.computed_tokens = prompt_tokens - cached_tokens
            report.kv_reuse_ratio = cached_tokens / prompt_tokens if prompt_tokens else 0.0
            if request is not None and request[0] is report and request[1] == prompt_tokens:
                report.reused_by_layer, report.computed_by_layer = tokens_by_layer(
                    request[2], prompt_tokens, cached_tokens)
            else:
                report.reused_by_layer, report.computed_by_layer = {}, {}
                logger.debug("tenant %s: usage of a request whose fields were not computed "
                             "here; no per-layer split", report.tenant)
        metrics = self.metrics()
        if metrics is not None:
            for kind, by_layer in (("reused", report.reused_by_layer),
                                   ("computed", report.computed_by_layer)):
                for layer, tokens in by_layer.items():
                    if tokens:
                        metrics.pipeline_tokens.labels(layer, kind).inc(tokens)
        return report
