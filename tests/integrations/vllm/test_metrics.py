"""The vLLM connector's metrics: stats accumulation, aggregation and Prometheus export
(no vLLM needed; the e2e suite checks them on vLLM's own /metrics)."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from prometheus_client import CollectorRegistry

from gpu_cache import hash_token_blocks
from integrations.vllm.config import ConnectorConfig
from integrations.vllm.identity import vllm_cache_identity
from integrations.vllm.metrics import (
    GAUGES,
    METRIC_NAMES,
    OTHER,
    UNLABELLED,
    ContextKitConnectorStats,
    ContextKitPromMetrics,
    LayerLabels,
    StatsRecorder,
    layer_names,
)
from integrations.vllm.planning import RequestPlanner, StepRequest
from integrations.vllm.precision import BlockLabel
from integrations.vllm.store import ConnectorStore
from tests.integrations.vllm.prometheus_registry import metric_types, samples

BS, LAYERS, HEADS, DIM = 16, 2, 2, 64


# ---------------------------------------------------------------------- accumulation
def _worker_step() -> ContextKitConnectorStats:
    rec = StatsRecorder(layer_names())
    rec.count("hit_tokens", 64)
    rec.count("loaded_blocks", 4)
    rec.count_layers("saved_blocks", ["axioms", "axioms", None])
    rec.set_gauge("shadow_lag_seconds", 1.5)
    data = rec.take()
    assert data is not None
    return ContextKitConnectorStats(data=data)


def _scheduler_step(lookups: int = 2) -> ContextKitConnectorStats:
    rec = StatsRecorder(layer_names())
    rec.count("lookups", lookups)
    data = rec.take()
    assert data is not None
    return ContextKitConnectorStats(data=data)


def test_worker_and_scheduler_stats_aggregate_and_reduce() -> None:
    # what vLLM's scheduler does: worker_stats.aggregate(scheduler_stats)
    merged = _worker_step().aggregate(_scheduler_step())
    assert merged.reduce() == {"hit_tokens": 64, "loaded_blocks": 4, "lookups": 2,
                               "saved_blocks": 3, "shadow_lag_seconds": 1.5}
    assert merged.data["by_layer"]["saved_blocks"] == {"axioms": 2, UNLABELLED: 1}
    # a second worker: counters add up, the gauge keeps the worst lag
    other = _worker_step()
    other.data["gauges"]["shadow_lag_seconds"] = 0.5
    merged.aggregate(other)
    assert merged.reduce()["hit_tokens"] == 128
    assert merged.data["by_layer"]["saved_blocks"] == {"axioms": 4, UNLABELLED: 2}
    assert merged.reduce()["shadow_lag_seconds"] == 1.5
    # what crosses processes: pickled (worker -> engine core), plain JSON-able data
    # with str keys and numbers (engine core -> API server, msgpack)
    assert pickle.loads(pickle.dumps(merged)).data == merged.data
    assert json.loads(json.dumps(merged.to_dict())) == merged.data
    # vLLM's logger rebuilds the object from the dict, then accumulates intervals
    rebuilt = ContextKitConnectorStats(data=json.loads(json.dumps(merged.to_dict())))
    assert rebuilt.aggregate(_scheduler_step(5)).reduce()["lookups"] == 7


def test_reset_is_empty_and_partial_data() -> None:
    stats = _worker_step()
    assert not stats.is_empty()
    stats.reset()
    assert stats.is_empty() and stats.reduce() == {}
    assert ContextKitConnectorStats().is_empty()
    assert ContextKitConnectorStats(data={}).reduce() == {}
    # an empty interval merges as a no-op
    assert _scheduler_step().aggregate(ContextKitConnectorStats()).reduce() == {"lookups": 2}
    assert not ContextKitConnectorStats(data={"counters": {"lookups": 1}}).is_empty()


def test_recorder_hands_out_deltas_not_totals() -> None:
    rec = StatsRecorder(layer_names())
    assert rec.take() is None  # nothing recorded: vLLM gets None
    rec.count("lookups")
    rec.count("lookups", 2)
    assert rec.take() == {"counters": {"lookups": 3}, "by_layer": {}, "gauges": {}}
    assert rec.take() is None
    rec.count("lookups")
    rec.count("load_errors", 0)  # zero is not recorded
    assert rec.take() == {"counters": {"lookups": 1}, "by_layer": {}, "gauges": {}}
    with pytest.raises(KeyError, match="known"):
        rec.count("hits")
    with pytest.raises(KeyError):
        rec.count_layers("lookups", ["axioms"])


def test_layer_labels_stay_bounded() -> None:
    names = layer_names("custom_default")
    assert {"axioms", "memories", "user_turn", "custom_default"} <= names
    label = LayerLabels(names)
    assert label("axioms") == "axioms" and label("custom_default") == "custom_default"
    assert label(None) == label("") == UNLABELLED
    rec = StatsRecorder(names)
    rec.count_layers("evicted_blocks", [f"span-{i}" for i in range(1000)] + ["memories"])
    data = rec.take()
    assert data is not None
    assert data["by_layer"]["evicted_blocks"] == {OTHER: 1000, "memories": 1}


# ---------------------------------------------------------------------- Prometheus
class _TransferConfig:
    kv_connector_extra_config: ClassVar[dict[str, Any]] = {"default_source_layer": "chat"}


class _VllmConfig:
    """The attribute the metrics read of vLLM's ``VllmConfig``."""

    kv_transfer_config = _TransferConfig()


def test_prometheus_metrics_from_two_steps() -> None:
    registry = CollectorRegistry()
    prom = ContextKitPromMetrics(_VllmConfig(), metric_types(registry),
                                 ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    step1 = _worker_step().aggregate(_scheduler_step()).to_dict()
    step1["by_layer"]["evicted_blocks"] = {"chat": 2, "from-a-request": 1}
    prom.observe(step1, engine_idx=0)
    rec = StatsRecorder(layer_names())
    rec.count("lookups")
    rec.count("shadow_bytes", 4096)
    rec.count("label_mismatches")
    rec.set_gauge("shadow_lag_seconds", 0.0)
    prom.observe(rec.take() or {}, engine_idx=0)
    prom.observe(_scheduler_step(7).to_dict(), engine_idx=1)

    got = samples(registry)
    e0 = (("engine", "0"), ("model_name", "m"))
    assert got[("vllm:contextkit_lookups_total", e0)] == 3  # deltas add up
    assert got[("vllm:contextkit_lookups_total", (("engine", "1"), ("model_name", "m")))] == 7
    assert got[("vllm:contextkit_hit_tokens_total", e0)] == 64
    assert got[("vllm:contextkit_loaded_blocks_total", e0)] == 4
    assert got[("vllm:contextkit_load_errors_total", e0)] == 0
    assert got[("vllm:contextkit_shadow_bytes_total", e0)] == 4096
    assert got[("vllm:contextkit_label_mismatches_total", e0)] == 1
    assert got[("vllm:contextkit_shadow_lag_seconds", e0)] == 0.0  # the latest value
    assert got[("vllm:contextkit_saved_blocks_total", (*e0[:1], ("layer", "axioms"),
                                                       e0[1]))] == 2
    assert got[("vllm:contextkit_saved_blocks_total", (*e0[:1], ("layer", UNLABELLED),
                                                       e0[1]))] == 1
    # the configured default layer keeps its name; anything else is "other"
    assert got[("vllm:contextkit_evicted_blocks_total", (*e0[:1], ("layer", "chat"),
                                                         e0[1]))] == 2
    assert got[("vllm:contextkit_evicted_blocks_total", (*e0[:1], ("layer", OTHER),
                                                         e0[1]))] == 1
    layers = {dict(labels).get("layer") for name, labels in got if "layer" in dict(labels)}
    assert layers <= layer_names("chat") | {UNLABELLED, OTHER}

    # `contextkit status --metrics URL` reads the same names: served over real HTTP
    from prometheus_client import start_http_server

    from contextkit.cli.scrape import scrape_metrics

    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        status = scrape_metrics(f"http://127.0.0.1:{server.server_port}/metrics")
    finally:
        server.shutdown()
        thread.join()
    connector = status["connector"]
    assert connector["lookups"] == 10 and connector["hit_tokens"] == 64  # both engines
    assert connector["loaded_blocks"] == 4 and connector["shadow_bytes"] == 4096
    assert connector["saved_blocks"] == {"axioms": 2, UNLABELLED: 1}
    assert connector["evicted_blocks"] == {"chat": 2, OTHER: 1}
    assert connector["shadow_lag_seconds"] == 0.0
    assert connector["label_mismatches"] == 1
    from contextkit.cli.scrape import format_metrics

    assert "label mismatches 1" in " ".join(format_metrics(status).split())


def test_dashboard_queries_use_the_exported_names() -> None:
    """The Grafana dashboard reads only names the connector exports."""
    root = Path(__file__).resolve().parents[3]
    text = (root / "docs" / "grafana" / "contextkit.json").read_text()
    used = set(re.findall(r"vllm:contextkit_[a-z_]+", text))
    exported = {name + "_total" for stat, name in METRIC_NAMES.items() if stat not in GAUGES}
    exported |= {METRIC_NAMES[stat] for stat in GAUGES}
    assert used and used <= exported, used - exported


# ---------------------------------------------------------------------- real code paths
def _kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    shape = (LAYERS, n, BS, HEADS, DIM)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _keys(digest: bytes, n: int, offset: int = 0) -> list[bytes]:
    return [bytes(k) for k in hash_token_blocks(digest, "default",
                                                list(range(offset, offset + n * BS)), BS)]


def test_a_label_mismatch_feeds_the_scheduler_stats() -> None:
    from integrations.vllm.planning import semantic_params

    tokens = list(range(40))
    planner = RequestPlanner(b"\0" * 32, BS)
    params = semantic_params([(0, 40, "axioms", 1.0, True)], prompt_token_ids=tokens[:39])
    planner.matched_tokens("r", tokens, len(tokens), 0, params=params)
    planner.matched_tokens("s", tokens, len(tokens), 0,
                           params=semantic_params([(0, 40, "axioms")], prompt_token_ids=tokens))
    assert planner.stats.take() == {"counters": {"lookups": 2, "label_mismatches": 1},
                                    "by_layer": {}, "gauges": {}}


def test_planner_lookups_feed_the_scheduler_stats() -> None:
    tokens = list(range(40))
    planner = RequestPlanner(b"\0" * 32, BS)
    planner.seed(hash_token_blocks(b"\0" * 32, "default", tokens, BS))
    assert planner.matched_tokens("r", tokens, len(tokens), 0) == 32
    planner.on_alloc("r", 32)
    planner.plan([StepRequest("r", tokens, 32, 8, [1, 2, 3])])  # plans, not a lookup
    assert planner.matched_tokens("s", tokens, len(tokens), 16) == 16
    assert planner.stats.take() == {"counters": {"lookups": 2}, "by_layer": {},
                                    "gauges": {}}
    assert planner.stats.take() is None


def test_store_saves_loads_and_evictions_feed_the_worker_stats(model: Path,
                                                               tmp_path: Path) -> None:
    ident = vllm_cache_identity(str(model), BS)
    config = ConnectorConfig(block_size=BS, host_blocks=8, shadow_url="", local_store="",
                             shadow_on_save=False)
    store = ConnectorStore(ident, config)
    axioms, chat = _keys(ident.digest(), 4), _keys(ident.digest(), 4, offset=1000)
    store.save(*_kv(4), axioms, "default", [BlockLabel("axioms", 1.0)] * 4)
    store.save(*_kv(4), chat, "default",
               [BlockLabel("user_turn", 0.1)] * 2 + [BlockLabel("a-custom-span", 0.1)] * 2)
    assert store.save(*_kv(4), chat, "default", [BlockLabel("user_turn")] * 4).stored == []
    assert store.take_stats() == {"counters": {}, "gauges": {}, "by_layer": {
        "saved_blocks": {"axioms": 4, "user_turn": 2, OTHER: 2}}}
    # the tier is full: two fresh blocks evict two chat blocks (semantic priority)
    fresh = _keys(ident.digest(), 2, offset=5000)
    result = store.save(*_kv(2), fresh, "default", [BlockLabel("memories")] * 2)
    assert len(result.removed) == 2
    # loads: a held prefix, then a key the store does not hold
    assert store.read([*axioms[:3], b"\1" * 32], "default") is not None
    assert store.read([b"\1" * 32], "default") is None
    data = store.take_stats()
    assert data is not None
    assert data["counters"] == {"loaded_blocks": 3, "hit_tokens": 3 * BS, "load_errors": 2}
    assert data["by_layer"]["saved_blocks"] == {"memories": 2}
    evicted = data["by_layer"]["evicted_blocks"]
    assert sum(evicted.values()) == 2 and set(evicted) <= {"user_turn", OTHER}
    assert "gauges" in data and data["gauges"] == {}  # no shadow: no lag gauge
    assert store.take_stats() is None


def test_store_shadow_bytes_and_lag(model: Path, tmp_path: Path) -> None:
    ident = vllm_cache_identity(str(model), BS)
    config = ConnectorConfig(block_size=BS, host_blocks=8, local_store="",
                             shadow_url=f"file://{tmp_path / 'shadow'}", shadow_on_save=False)
    store = ConnectorStore(ident, config)
    store.open_shadow(restored=False)
    try:
        nothing = store.take_stats()
        assert nothing is not None and nothing["gauges"] == {"shadow_lag_seconds": 0.0}
        keys = _keys(ident.digest(), 3)
        store.save(*_kv(3), keys, "default", [BlockLabel("rules")] * 3)
        _, lag = store.shadow_stats(now=1e12)  # pending since the save
        assert lag > 1e11
        result = store.shadow_now()  # what the connector's save thread calls
        assert result is not None and result.bytes_written > 0
        data = store.take_stats()
        assert data is not None
        assert data["counters"]["shadow_bytes"] == result.bytes_written + result.manifest_bytes
        assert data["gauges"] == {"shadow_lag_seconds": 0.0}  # every block is shadowed
        # a shadow run by someone else (the periodic job) is counted once, when seen
        store.save(*_kv(1), _keys(ident.digest(), 1, offset=900), "default",
                   [BlockLabel("rules")])
        assert store.shadow is not None
        periodic = store.shadow.shadow_now()
        again = store.take_stats()
        assert again is not None
        assert again["counters"]["shadow_bytes"] == (periodic.bytes_written
                                                    + periodic.manifest_bytes)
        assert again["gauges"]["shadow_lag_seconds"] == 0.0
        assert (store.take_stats() or {}).get("counters") == {}  # counted once
    finally:
        store.close()
