"""A test registry for the connector's Prometheus metrics: prometheus-client's classes
bound to it (vLLM injects its own) and its samples as a dict."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

Sample = tuple[str, tuple[tuple[str, str], ...]]


def metric_types(registry: CollectorRegistry) -> dict[Any, Any]:
    """prometheus-client's classes bound to ``registry``."""

    def bound(cls: Any) -> Any:
        class Bound(cls):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, registry=registry, **kwargs)

        return Bound

    return {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}


def samples(registry: CollectorRegistry) -> dict[Sample, float]:
    """``(name, sorted labels) -> value`` as a scrape would read them."""
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if not s.name.endswith("_created")}
