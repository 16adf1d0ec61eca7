"""What operators see: spilled lines reported and warned, and Prometheus figures that
equal the per-call reports after a real run of the embedded engine."""

from __future__ import annotations

import json
import logging
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from contextkit.cli.commands import main
from contextkit.engine.engine import Engine
from contextkit.metrics import ContextkitMetrics, serve
from contextkit.pipeline.pipeline import CacheAwareContextPipeline, PipelineResult
from contextkit.prompt.layers import LayerConfig, LayerSpec

pytestmark = pytest.mark.slow

LAYERS = LayerConfig([
    LayerSpec("axioms", 200, 400, stable=True),
    LayerSpec("identity", 60, 120, stable=True),
    LayerSpec("neurons", 20, 40),
    LayerSpec("system_state", 40, 80, volatile=True),
])


def prompt(turn: int, *, axioms: list[str] | None = None) -> dict[str, Any]:
    return {
        "axioms": axioms or ["Tell the truth about what you checked.",
                             "Never delete data without a yes."],
        "identity": ["You are Atlas, the platform team's SRE assistant."],
        # Over the 40-token budget: some lines spill on every call.
        "neurons": [f"When p95 rises after deploy {i}, compare pool wait time in region {i}."
                    for i in range(8)],
        "system_state": [f"checkout-api: p95 {700 + 13 * turn} ms"],
    }


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_long_layer_spills_with_a_report_field_and_one_warning_per_layer(
        fresh: Callable[..., Engine], caplog: pytest.LogCaptureFixture) -> None:
    metrics = ContextkitMetrics(registry=CollectorRegistry())
    pipeline = CacheAwareContextPipeline(fresh("tq4"), layers=LAYERS, metrics=metrics)
    # The case: a 9,000-word [AXIOMS] layer, far over its 400-token budget.
    words = [f"rule{i}" for i in range(9000)]
    huge = [" ".join(words[i:i + 30]) for i in range(0, 9000, 30)]
    with caplog.at_level(logging.WARNING, logger="contextkit.pipeline.pipeline"):
        first = pipeline.build(prompt(0, axioms=huge)).report
        second = pipeline.build(prompt(1, axioms=huge)).report
    assert first.spilled_by_layer["axioms"] > 250 and first.spilled_by_layer["neurons"] > 0
    assert set(first.spilled_by_layer) == {"axioms", "neurons"}
    assert first.spilled_lines == sum(first.spilled_by_layer.values())
    assert second.spilled_by_layer == first.spilled_by_layer
    warned = [r.getMessage() for r in caplog.records if "spilled" in r.getMessage()]
    assert len(warned) == 2, warned  # once per layer, not once per call
    assert any("axioms" in m and "budget" in m for m in warned)
    family = metrics.registry.get_sample_value
    assert family("contextkit_pipeline_spilled_lines_total", {"layer": "axioms"}) == \
        first.spilled_by_layer["axioms"] * 2


def test_scraped_metrics_equal_the_per_call_reports(
        fresh: Callable[..., Engine], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    registry = CollectorRegistry()
    metrics = ContextkitMetrics(registry=registry)
    engine = fresh("tq4", metrics=metrics)
    pipeline = CacheAwareContextPipeline(engine, layers=LAYERS, metrics=metrics)
    results: list[PipelineResult] = []
    for turn in range(3):
        pipeline.build(prompt(turn))
        results.append(pipeline.generate("Is checkout healthy?", max_new_tokens=3))
    pipeline.build(prompt(0), tenant="acme")
    results.append(pipeline.generate("Hello", max_new_tokens=2, tenant="acme"))
    # One call built but never generated (a prompt sent to another server) still counts.
    pipeline.build(prompt(5), tenant="acme")
    port = serve(0, registry=registry)
    got = scrape(port)

    def value(name: str, **labels: str) -> float:
        return got.get((name, tuple(sorted(labels.items()))), 0.0)

    reports = [r.report for r in results]
    assert value("contextkit_pipeline_calls_total", tenant="default") == 3
    assert value("contextkit_pipeline_calls_total", tenant="acme") == 2
    layers = {layer for r in reports for layer in (*r.reused_by_layer, *r.computed_by_layer)}
    assert {"axioms", "identity", "neurons", "system_state", "user_turn", "template"} <= layers
    for layer in layers:
        for kind, field in (("reused", "reused_by_layer"), ("computed", "computed_by_layer")):
            want = sum(getattr(r, field).get(layer, 0) for r in reports)
            assert value("contextkit_pipeline_prompt_tokens_total", layer=layer,
                         kind=kind) == want, (layer, kind)
    for r in reports:
        assert sum(r.reused_by_layer.values()) == r.reused_tokens
        assert sum(r.computed_by_layer.values()) == r.computed_tokens
    assert sum(r.reused_tokens for r in reports) > 0  # the later turns reused the prefix
    breaks: dict[str, int] = {}
    for r in [*reports, pipeline.last_report("acme")]:
        assert r is not None and r.prefix_broken_by is not None
        breaks[r.prefix_broken_by] = breaks.get(r.prefix_broken_by, 0) + 1
    for layer, n in breaks.items():
        assert value("contextkit_pipeline_prefix_breaks_total", layer=layer) == n
    spilled = sum(r.spilled_by_layer.get("neurons", 0) for r in reports) + \
        pipeline.last_report("acme").spilled_by_layer["neurons"]  # type: ignore[union-attr]
    assert spilled > 0
    assert value("contextkit_pipeline_spilled_lines_total", layer="neurons") == spilled
    assert value("contextkit_pipeline_pinned_blocks", tenant="default") == \
        reports[2].pinned_blocks > 0
    # The engine's own figures.
    gens = [r.generation for r in results]
    assert value("contextkit_engine_requests_total") == len(gens)
    assert value("contextkit_engine_tokens_total", kind="reused") == \
        sum(g.reused_tokens for g in gens)
    assert value("contextkit_engine_tokens_total", kind="computed") == \
        sum(g.computed_tokens for g in gens)
    assert value("contextkit_engine_tokens_total", kind="generated") == \
        sum(len(g.token_ids) for g in gens)
    assert value("contextkit_engine_ttft_seconds_count") == len(gens)
    assert value("contextkit_engine_ttft_seconds_sum") == pytest.approx(
        sum(g.ttft_ms for g in gens) / 1000.0)
    # `contextkit status --metrics URL` shows the same figures.
    capsys.readouterr()
    url = f"http://127.0.0.1:{port}/metrics"
    assert main(["status", "--store", str(tmp_path), "--metrics", url, "--json"]) == 0
    out = capsys.readouterr().out
    assert "pipeline calls     acme 2, default 3" in out
    doc = json.loads(out.strip().splitlines()[-1])["metrics"]
    assert doc["pipeline"]["calls"] == {"acme": 2, "default": 3}
    assert doc["pipeline"]["spilled_lines"] == {"neurons": spilled}
    assert doc["pipeline"]["reused_tokens"] == {
        layer: n for layer in layers
        if (n := sum(r.reused_by_layer.get(layer, 0) for r in reports))}
    assert doc["engine"]["requests"] == len(gens)
    assert doc["engine"]["tokens"]["generated"] == sum(len(g.token_ids) for g in gens)
    assert doc["has_connector"] is False


def test_status_metrics_url_errors_are_one_line(capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    for url, says in (("localhost:9/metrics", "must be an http(s) URL"),
                      ("http://127.0.0.1:9/metrics", "could not read")):
        assert main(["status", "--store", str(tmp_path), "--metrics", url]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""  # checked before anything is printed
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and says in err[0] and "--metrics" in err[0], err
