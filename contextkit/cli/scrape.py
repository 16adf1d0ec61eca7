"""``contextkit status --metrics URL``: read a ``/metrics`` page and summarize contextkit's
figures (the pipeline's and engine's ``contextkit_*``, the vLLM connector's
``vllm:contextkit_*``), summed over the labels that only say where they were recorded
(vLLM's ``model_name`` and ``engine``)."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections import defaultdict
from typing import Any

__all__ = ["MetricsScrapeError", "format_metrics", "scrape_metrics"]

#: Connector metric names (without ``vllm:contextkit_`` and ``_total``) shown by status.
CONNECTOR_COUNTERS = ("lookups", "hit_tokens", "loaded_blocks", "saved_blocks",
                      "evicted_blocks", "load_errors", "label_mismatches", "shadow_bytes")


class MetricsScrapeError(ValueError):
    """A ``--metrics`` URL that could not be read or holds no Prometheus text."""


def _fetch(url: str, timeout: float) -> str:
    if not url.startswith(("http://", "https://")):
        raise MetricsScrapeError(f"--metrics must be an http(s) URL of a /metrics page, got "
                                 f"{url!r}")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return str(resp.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise MetricsScrapeError(
            f"could not read {url}: {reason}; check --metrics (a vLLM server's /metrics, or "
            "a process started with [metrics] port set)") from exc


def scrape_metrics(url: str, timeout: float = 10.0) -> dict[str, Any]:
    """The contextkit figures of a ``/metrics`` page, as one JSON-able dict.

    Raises:
        MetricsScrapeError: the page cannot be read or is not Prometheus text.
    """
    from prometheus_client.parser import text_string_to_metric_families

    text = _fetch(url, timeout)
    sums: dict[str, dict[tuple[tuple[str, str], ...], float]] = defaultdict(
        lambda: defaultdict(float))
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if not s.name.startswith(("contextkit_", "vllm:contextkit_")):
                    continue
                labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                      if k not in ("model_name", "engine")))
                sums[s.name][labels] += s.value
    except ValueError as exc:
        raise MetricsScrapeError(f"{url} is not a Prometheus /metrics page: {exc}") from exc

    def by(name: str, label: str, **where: str) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for labels, value in sums.get(name, {}).items():
            d = dict(labels)
            if all(d.get(k) == v for k, v in where.items()):
                out[d.get(label, "")] += value
        return dict(sorted(out.items()))

    def total(name: str) -> float:
        return sum(sums.get(name, {}).values())

    reused = by("contextkit_pipeline_prompt_tokens_total", "layer", kind="reused")
    computed = by("contextkit_pipeline_prompt_tokens_total", "layer", kind="computed")
    prompt = sum(reused.values()) + sum(computed.values())
    ttft_n = total("contextkit_engine_ttft_seconds_count")
    pipeline = {
        "calls": by("contextkit_pipeline_calls_total", "tenant"),
        "reused_tokens": reused, "computed_tokens": computed,
        "kv_reuse_ratio": round(sum(reused.values()) / prompt, 4) if prompt else 0.0,
        "prefix_breaks": by("contextkit_pipeline_prefix_breaks_total", "layer"),
        "spilled_lines": by("contextkit_pipeline_spilled_lines_total", "layer"),
        "pinned_blocks": by("contextkit_pipeline_pinned_blocks", "tenant"),
    }
    engine = {
        "requests": total("contextkit_engine_requests_total"),
        "tokens": by("contextkit_engine_tokens_total", "kind"),
        "ttft_mean_ms": round(1000 * total("contextkit_engine_ttft_seconds_sum") / ttft_n, 2)
        if ttft_n else None,
        "decode_tokens_per_second": total("contextkit_engine_decode_tokens_per_second"),
    }
    connector: dict[str, Any] = {}
    for name in CONNECTOR_COUNTERS:
        full = f"vllm:contextkit_{name}_total"
        if name in ("saved_blocks", "evicted_blocks"):
            connector[name] = by(full, "layer")
        else:
            connector[name] = total(full)
    connector["shadow_lag_seconds"] = total("vllm:contextkit_shadow_lag_seconds")
    found = bool(sums)
    return {"url": url, "found": found,
            "pipeline": pipeline, "engine": engine, "connector": connector,
            "has_pipeline": any(n.startswith("contextkit_pipeline") for n in sums),
            "has_engine": any(n.startswith("contextkit_engine") for n in sums),
            "has_connector": any(n.startswith("vllm:contextkit_") for n in sums)}


def _fmt(values: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:,.0f}" for k, v in values.items()) or "-"


def format_metrics(doc: dict[str, Any]) -> str:
    """The summary as the lines ``contextkit status`` prints."""
    lines = [f"\nmetrics {doc['url']}"]
    if not doc["found"]:
        lines.append("  no contextkit metrics on this page yet (none recorded, or metrics "
                     "disabled)")
        return "\n".join(lines) + "\n"
    if doc["has_pipeline"]:
        p = doc["pipeline"]
        lines += [f"  pipeline calls     {_fmt(p['calls'])}",
                  f"    reused tokens    {_fmt(p['reused_tokens'])}",
                  f"    computed tokens  {_fmt(p['computed_tokens'])}",
                  f"    kv reuse ratio   {p['kv_reuse_ratio']:.1%}",
                  f"    prefix breaks    {_fmt(p['prefix_breaks'])}",
                  f"    spilled lines    {_fmt(p['spilled_lines'])}",
                  f"    pinned blocks    {_fmt(p['pinned_blocks'])}"]
    if doc["has_engine"]:
        e = doc["engine"]
        ttft = f"{e['ttft_mean_ms']:,.1f} ms" if e["ttft_mean_ms"] is not None else "-"
        lines += [f"  engine requests    {e['requests']:,.0f}",
                  f"    tokens           {_fmt(e['tokens'])}",
                  f"    ttft (mean)      {ttft}",
                  f"    decode           {e['decode_tokens_per_second']:,.1f} tokens/s"]
    if doc["has_connector"]:
        c = doc["connector"]
        lines += [f"  connector lookups  {c['lookups']:,.0f}",
                  f"    hit tokens       {c['hit_tokens']:,.0f}",
                  f"    loaded blocks    {c['loaded_blocks']:,.0f}",
                  f"    saved blocks     {_fmt(c['saved_blocks'])}",
                  f"    evicted blocks   {_fmt(c['evicted_blocks'])}",
                  f"    load errors      {c['load_errors']:,.0f}",
                  f"    label mismatches {c['label_mismatches']:,.0f}",
                  f"    shadow           {c['shadow_bytes'] / 1e6:,.1f} MB written, lag "
                  f"{c['shadow_lag_seconds']:,.1f} s"]
    return "\n".join(lines) + "\n"
