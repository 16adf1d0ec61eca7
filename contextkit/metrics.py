"""Prometheus metrics of the pipeline and the embedded engine.

Every metric here is named ``contextkit_*`` and is recorded into one registry
(prometheus-client's default one unless told otherwise), so a process that already
serves ``/metrics`` shows them, and :func:`serve` (or ``[metrics] port`` in the
configuration) starts a server for one that does not. The vLLM connector's metrics are
``vllm:contextkit_*`` and appear on the vLLM server's own ``/metrics`` (see
:mod:`integrations.vllm.metrics`). ``contextkit status --metrics URL`` prints both.

Labels stay bounded: ``layer`` takes the source layers of the configured prompt layers
(plus ``user_turn`` and ``template`` for the conversation and the chat markup), and
``tenant`` the first :attr:`~contextkit.config.MetricsSettings.max_tenant_labels`
tenants seen (later ones share ``"other"``).

Every figure equals the sum of the per-call reports it comes from: a call's
:class:`~contextkit.pipeline.pipeline.CallReport` is counted once when it is built
(:meth:`ContextkitMetrics.record_build`) and once more when the engine ran it
(:meth:`ContextkitMetrics.record_generate`).

Where processes run apart, prometheus-client's multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``) carries the values across; gauges use its ``livesum``
mode there.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = ["CallCounts", "ContextkitMetrics", "GenerationCounts", "TenantLabels", "default_metrics",
           "resolve", "serve"]

logger = logging.getLogger(__name__)


class CallCounts(Protocol):
    """What the recorders read of a pipeline call's report
    (:class:`~contextkit.pipeline.reports.CallReport`); metrics sits below the pipeline
    room, so it names the fields rather than import the class."""

    @property
    def tenant(self) -> str: ...

    @property
    def prefix_broken_by(self) -> str | None: ...

    @property
    def spilled_by_layer(self) -> Mapping[str, int]: ...

    @property
    def reused_by_layer(self) -> Mapping[str, int]: ...

    @property
    def computed_by_layer(self) -> Mapping[str, int]: ...

    @property
    def pinned_blocks(self) -> int: ...


class GenerationCounts(Protocol):
    """What :meth:`ContextkitMetrics.record_generation` reads of an engine result
    (:class:`~contextkit.engine.types.GenerationResult`)."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def reused_tokens(self) -> int: ...

    @property
    def computed_tokens(self) -> int: ...

    @property
    def chunk_reused_tokens(self) -> int: ...

    @property
    def repaired_tokens(self) -> int: ...

    @property
    def ttft_ms(self) -> float: ...

    @property
    def total_ms(self) -> float: ...

#: TTFT buckets (seconds): a cached turn on a GPU to a cold 20K-token prefill on a CPU.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)
OTHER = "other"


class TenantLabels:
    """Maps tenants to label values, at most ``limit`` distinct names (then ``"other"``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, tenant: str) -> str:
        with self._lock:
            if tenant in self._seen:
                return tenant
            if len(self._seen) < self.limit:
                self._seen.add(tenant)
                return tenant
            return OTHER


class ContextkitMetrics:
    """The metric families, created once per registry.

    Args:
        registry: a ``prometheus_client.CollectorRegistry``; ``None``: the default one.
        max_tenant_labels: distinct tenant label values before ``"other"``.
    """

    def __init__(self, registry: Any = None, max_tenant_labels: int = 32) -> None:
        import prometheus_client as pc

        self.registry = registry if registry is not None else pc.REGISTRY
        self.tenant = TenantLabels(max_tenant_labels)
        multiproc = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        r = self.registry

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            return pc.Counter(name, doc, list(labels), registry=r)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Any:
            if multiproc:
                return pc.Gauge(name, doc, list(labels), registry=r,
                                multiprocess_mode="livesum")
            return pc.Gauge(name, doc, list(labels), registry=r)

        # Pipeline.
        self.pipeline_calls = counter("contextkit_pipeline_calls", "pipeline calls",
                                      ("tenant",))
        self.pipeline_tokens = counter(
            "contextkit_pipeline_prompt_tokens",
            "prompt tokens of pipeline calls by layer; kind=reused (KV from the cache) or "
            "computed", ("layer", "kind"))
        self.prefix_breaks = counter(
            "contextkit_pipeline_prefix_breaks",
            "calls whose cached prefix was broken, by the first layer that changed", ("layer",))
        self.spilled_lines = counter("contextkit_pipeline_spilled_lines",
                                     "lines over their layer's budget, spilled", ("layer",))
        self.pinned_blocks = gauge("contextkit_pipeline_pinned_blocks",
                                   "blocks pinned for a tenant's stable prefix", ("tenant",))
        # Engine.
        self.engine_requests = counter("contextkit_engine_requests", "engine requests")
        self.engine_tokens = counter(
            "contextkit_engine_tokens",
            "engine tokens; kind=reused (the cached prefix), chunk_reused (moved in from "
            "chunks cached elsewhere), repaired (of those, recomputed: also in computed), "
            "computed (prompt) or generated", ("kind",))
        self.engine_ttft = pc.Histogram("contextkit_engine_ttft_seconds",
                                        "time to first token", buckets=TTFT_BUCKETS,
                                        registry=r)
        self.engine_decode_tps = gauge("contextkit_engine_decode_tokens_per_second",
                                       "decode rate of the last request")

    # ------------------------------------------------------------------ recorders
    def record_build(self, report: CallCounts) -> None:
        """Count one pipeline call when its prompt is built: the call, the layer that
        broke the cached prefix, and the lines spilled over their layer's budget."""
        self.pipeline_calls.labels(self.tenant(report.tenant)).inc()
        if report.prefix_broken_by:
            self.prefix_breaks.labels(report.prefix_broken_by).inc()
        for layer, lines in report.spilled_by_layer.items():
            if lines:
                self.spilled_lines.labels(layer).inc(lines)

    def record_generate(self, report: CallCounts) -> None:
        """Count what the engine did for one call: reused and computed prompt tokens per
        layer, and the tenant's pinned blocks afterwards."""
        for kind, by_layer in (("reused", report.reused_by_layer),
                               ("computed", report.computed_by_layer)):
            for layer, tokens in by_layer.items():
                if tokens:
                    self.pipeline_tokens.labels(layer, kind).inc(tokens)
        self.pinned_blocks.labels(self.tenant(report.tenant)).set(report.pinned_blocks)

    def record_generation(self, result: GenerationCounts) -> None:
        """Count one engine request from its result."""
        self.engine_requests.inc()
        self.engine_tokens.labels("reused").inc(result.reused_tokens)
        self.engine_tokens.labels("computed").inc(result.computed_tokens)
        self.engine_tokens.labels("chunk_reused").inc(result.chunk_reused_tokens)
        self.engine_tokens.labels("repaired").inc(result.repaired_tokens)
        generated = len(result.token_ids)
        self.engine_tokens.labels("generated").inc(generated)
        self.engine_ttft.observe(result.ttft_ms / 1000.0)
        decode_s = (result.total_ms - result.ttft_ms) / 1000.0
        if generated > 1 and decode_s > 0:
            self.engine_decode_tps.set((generated - 1) / decode_s)


_DEFAULT: ContextkitMetrics | None = None
_RESOLVED = False
_DEFAULT_LOCK = threading.Lock()


def default_metrics() -> ContextkitMetrics | None:
    """The process's metrics in prometheus-client's default registry, created on first
    use from the ``[metrics]`` section of :func:`contextkit.config.load_config` (which
    also starts a ``/metrics`` server when ``port`` is set); ``None`` when
    ``metrics.enabled`` is false. Engines and pipelines record here unless given their
    own :class:`ContextkitMetrics` (``metrics=``)."""
    global _DEFAULT, _RESOLVED
    with _DEFAULT_LOCK:
        if not _RESOLVED:
            from contextkit.config import load_config

            settings = load_config().metrics
            if settings.enabled:
                _DEFAULT = ContextkitMetrics(max_tenant_labels=settings.max_tenant_labels)
                if settings.port is not None:
                    serve(settings.port, settings.addr)
            _RESOLVED = True
        return _DEFAULT


def resolve(metrics: ContextkitMetrics | bool | None) -> ContextkitMetrics | None:
    """A ``metrics=`` argument: an instance as is, ``False`` none, ``None``/``True`` the
    process default (:func:`default_metrics`)."""
    if isinstance(metrics, ContextkitMetrics):
        return metrics
    if metrics is False:
        return None
    return default_metrics()


def serve(port: int = 0, addr: str = "127.0.0.1", registry: Any = None) -> int:
    """Serve ``/metrics`` on ``addr:port`` in a daemon thread; returns the bound port."""
    import prometheus_client as pc

    server, _thread = pc.start_http_server(port, addr=addr,
                                           registry=registry if registry is not None
                                           else pc.REGISTRY)
    bound = int(server.server_port)
    logger.info("contextkit metrics on http://%s:%d/metrics", addr, bound)
    return bound
