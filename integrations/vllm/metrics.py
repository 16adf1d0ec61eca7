"""Prometheus metrics of the vLLM connector, through vLLM's own KV-connector stats hooks.

vLLM (>= 0.11.1) collects ``get_kv_connector_stats()`` from the worker-role connector
after every step and from the scheduler-role connector in the engine core, merges them
with :meth:`ContextKitConnectorStats.aggregate`, ships ``to_dict()`` to the API server
and hands it to :meth:`ContextKitPromMetrics.observe` there. The metrics therefore land
in the API server's own registry and appear on its ``/metrics`` (no
``PROMETHEUS_MULTIPROC_DIR`` needed), with vLLM's ``model_name`` and ``engine``
labels. Stats flow only while vLLM logs stats (the default; ``--disable-log-stats``
turns them off) and only on engine steps; what the shared tier's writer thread counts
between steps comes through a file instead (:mod:`integrations.vllm.ledger`).

Metrics (counters are exposed with a ``_total`` suffix):

====================================  =========  ============================================
``vllm:contextkit_lookups``           counter    prefix lookups by the scheduler-side connector
``vllm:contextkit_hit_tokens``        counter    prompt tokens loaded from the store, not computed
``vllm:contextkit_loaded_blocks``     counter    blocks loaded into vLLM's paged cache
``vllm:contextkit_saved_blocks``      counter    blocks stored, label ``layer``
``vllm:contextkit_evicted_blocks``    counter    blocks evicted from the store, label ``layer``
``vllm:contextkit_load_errors``       counter    blocks that failed to load (vLLM recomputes them)
``vllm:contextkit_demoted_blocks``    counter    blocks transcoded down to their format to make room
``vllm:contextkit_skipped_blocks``    counter    volatile-tail blocks not stored (no room)
``vllm:contextkit_load_seconds``      counter    time the forward waited on loads (read + decode)
``vllm:contextkit_save_seconds``      counter    time spent storing blocks (off the forward's path)
``vllm:contextkit_shadow_bytes``      counter    bytes written to the shadow store
``vllm:contextkit_shadow_lag_seconds``  gauge    age of the oldest stored block not yet shadowed
``vllm:contextkit_label_mismatches``  counter    requests whose labels fit another prompt (ignored)
``vllm:contextkit_reuse_*_requests``  counter    finished requests by reuse class (prefix,
                                                 chunk, recomputed, none; ``cache_report``)
``vllm:contextkit_chunk_*``           counter    chunk reuse: tokens moved in, tokens the
                                                 connector computed, seconds it took
``vllm:contextkit_hint_*``            counter    agent hints: blocks pinned, pins refused
                                                 by the quota, malformed entries ignored
====================================  =========  ============================================

The shared tier (:mod:`integrations.vllm.shared`) adds counters ``shared_hit_tokens``
(prompt tokens a lookup found there), ``shared_imported_blocks`` (brought into DDR),
``shared_heads``, ``shared_gets``, ``shared_puts``, ``shared_bytes_down``,
``shared_bytes_up``, ``shared_deadline_misses`` (gave up: the request recomputed),
``shared_refused`` (tampered, replayed, foreign, corrupt or oversize objects, and loads
that failed),
``shared_deduplicated`` (not uploaded: held already), ``shared_lookup_seconds`` (what
requests waited for lookups), ``shared_span_hits`` (chunks reused from span objects
another replica published), ``shared_spans_published`` (span objects uploaded),
``shared_dropped`` (write-behind
queue full, or blocks evicted first), ``shared_errors``, and the gauge
``shared_lag_seconds`` (the latest upload's save-to-upload time).

``layer`` is the block's source layer, bounded to the known source layers (see
:func:`layer_names`) plus ``"unlabelled"`` (unknown) and ``"other"`` (any other name).

The accumulation (:class:`StatsRecorder` and the ``*_data`` functions) is plain Python;
only :class:`ContextKitConnectorStats` and :class:`ContextKitPromMetrics` derive from
vLLM's classes, and fall back to local stand-ins with the same interface when vLLM
is absent (unit tests), so importing this module never starts anything.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from integrations.vllm.ledger import LedgerReader

__all__ = [
    "BY_LAYER",
    "COUNTERS",
    "GAUGES",
    "METRIC_NAMES",
    "OTHER",
    "SHARED_COUNTERS",
    "UNLABELLED",
    "ContextKitConnectorStats",
    "ContextKitPromMetrics",
    "LayerLabels",
    "StatsRecorder",
    "aggregate_data",
    "empty_data",
    "is_empty_data",
    "layer_names",
    "reduce_data",
]

logger = logging.getLogger(__name__)

#: The shared tier's counters (:mod:`integrations.vllm.shared`).
SHARED_COUNTERS = ("shared_hit_tokens", "shared_imported_blocks", "shared_heads",
                   "shared_gets", "shared_puts", "shared_bytes_down", "shared_bytes_up",
                   "shared_deadline_misses", "shared_refused", "shared_deduplicated",
                   "shared_dropped", "shared_errors", "shared_lookup_seconds",
                   "shared_span_hits", "shared_spans_published")
#: Plain counters (one value per interval).
COUNTERS = ("lookups", "hit_tokens", "loaded_blocks", "load_errors", "shadow_bytes",
            "label_mismatches", "demoted_blocks", "skipped_blocks", "load_seconds",
            "save_seconds", "reuse_prefix_requests", "reuse_recomputed_requests",
            "reuse_none_requests", "hint_pinned_blocks", "hint_pins_refused",
            "hints_ignored", "hint_other_pins_lost", "pause_kept_blocks",
            "pause_released_blocks", "pause_warmed_blocks", "reuse_chunk_requests",
            "chunk_reused_tokens", "chunk_computed_tokens", "chunk_seconds",
            *SHARED_COUNTERS)
#: Counters broken down by the block's source layer.
BY_LAYER = ("saved_blocks", "evicted_blocks")
#: Gauges (latest value; merged observations keep the largest).
GAUGES = ("shadow_lag_seconds", "shared_lag_seconds")
PREFIX = "vllm:contextkit_"
#: Metric name per stat (counters are exposed with ``_total``).
METRIC_NAMES = {stat: PREFIX + stat for stat in (*COUNTERS, *BY_LAYER, *GAUGES)}

UNLABELLED = "unlabelled"
OTHER = "other"

_DOCS = {
    "lookups": "Prefix lookups by contextkit's scheduler-side connector.",
    "reuse_prefix_requests": "Finished requests whose prompt reused a prefix (vLLM's "
                             "cache or contextkit's).",
    "reuse_recomputed_requests": "Finished requests that computed tokens promised from "
                                 "contextkit's cache (they failed to load).",
    "reuse_none_requests": "Finished requests whose prompt reused nothing.",
    "reuse_chunk_requests": "Finished requests that reused chunks after their prefix "
                            "(moved K/V, seams recomputed).",
    "chunk_reused_tokens": "Prompt tokens moved in from chunks computed elsewhere and not "
                           "recomputed.",
    "chunk_computed_tokens": "Prompt tokens the connector computed itself between and at "
                             "the seams of reused chunks (changed spans, repairs).",
    "chunk_seconds": "Seconds vLLM's forward waited for chunk reuse (decode, move, repair).",
    "hint_pinned_blocks": "Blocks an agent hint pinned for its TTL (then unpinned).",
    "hint_pins_refused": "Blocks an agent hint asked to pin that the tenant's pin quota "
                         "refused (stored unpinned).",
    "hint_other_pins_lost": "Other tenants' pinned blocks unpinned or evicted while an "
                            "agent hint or a session's keep pinned its own (0: a hint takes "
                            "free pin room only).",
    "hints_ignored": "Requests whose agent hints were malformed (served without them).",
    "pause_kept_blocks": "Blocks pinned through a session's expected pause (a tool call), "
                         "learned from its history.",
    "pause_released_blocks": "Blocks released when their session came back.",
    "pause_warmed_blocks": "Blocks of a paused session moved from the DDR tier to the "
                           "device tier: at its pause, and again ahead of its expected "
                           "return.",
    "hit_tokens": "Prompt tokens served from contextkit's cache instead of computed.",
    "loaded_blocks": "Blocks loaded from contextkit's cache into vLLM's paged KV cache.",
    "saved_blocks": "Blocks stored in contextkit's cache, by source layer.",
    "evicted_blocks": "Blocks evicted from contextkit's cache, by source layer.",
    "load_errors": "Blocks that failed to load from contextkit's cache (vLLM recomputed them).",
    "shadow_bytes": "Bytes written to contextkit's shadow store (blocks and manifests).",
    "label_mismatches": "Requests whose contextkit labels were computed for another prompt "
                        "(ignored: their blocks got the default layer).",
    "demoted_blocks": "Blocks transcoded down to their policy's format to make room in "
                      "contextkit's DDR tier (stored above it while there was room).",
    "skipped_blocks": "Blocks of a request's volatile tail not stored in contextkit's DDR "
                      "tier: storing them would have evicted (store_volatile = room).",
    "load_seconds": "Seconds vLLM's forward waited for loads from contextkit's cache "
                    "(lookup, decode into the paged KV cache).",
    "save_seconds": "Seconds spent encoding and storing blocks in contextkit's cache (on a "
                    "background thread, beside the forward).",
    "shared_hit_tokens": "Prompt tokens a lookup found in contextkit's shared tier (beyond "
                         "this server's own DDR tier).",
    "shared_imported_blocks": "Blocks brought from contextkit's shared tier into this "
                              "server's DDR tier.",
    "shared_heads": "Lookups (HEAD) of objects in contextkit's shared tier.",
    "shared_gets": "Objects read (GET) from contextkit's shared tier.",
    "shared_puts": "Objects written (PUT) to contextkit's shared tier (chunks and leases).",
    "shared_bytes_down": "Bytes read from contextkit's shared tier.",
    "shared_bytes_up": "Bytes written to contextkit's shared tier.",
    "shared_deadline_misses": "Shared-tier lookups or loads that gave up at the deadline "
                              "(the request recomputed).",
    "shared_refused": "Shared-tier objects refused: tampered, replayed, corrupt, oversize "
                      "or of another model, and loads that failed (the request "
                      "recomputed).",
    "shared_deduplicated": "Chunks not uploaded to contextkit's shared tier: it held them.",
    "shared_dropped": "Uploads to contextkit's shared tier dropped (write-behind queue full, "
                      "or the blocks were evicted before their upload).",
    "shared_errors": "Shared-tier requests that failed (store errors; nothing was served "
                     "from them).",
    "shared_lookup_seconds": "Seconds requests waited for shared-tier lookups (vLLM "
                             "scheduled them once the answer was in).",
    "shared_span_hits": "Chunks a request reused from span objects in contextkit's shared "
                        "tier (published by another replica, at another position).",
    "shared_spans_published": "Span objects (a labelled span's blocks, named by its "
                              "content) uploaded to contextkit's shared tier.",
    "shared_lag_seconds": "The latest upload's time from storing a block to its chunk "
                          "being findable in contextkit's shared tier.",
    "shadow_lag_seconds": "Age of the oldest block in contextkit's cache not yet shadowed "
                          "(0 when none is pending or there is no shadow).",
}


def layer_names(default_layer: str = "user_turn") -> frozenset[str]:
    """The source layers that get their own ``layer`` label value.

    The semantic eviction policy's layers (:data:`gpu_cache.DEFAULT_SOURCE_PRIORITY`)
    and the connector's ``default_source_layer``.
    """
    from gpu_cache.metadata import DEFAULT_SOURCE_PRIORITY

    return frozenset(DEFAULT_SOURCE_PRIORITY) | {default_layer}


class LayerLabels:
    """Maps a block's source layer to a bounded label value.

    ``None`` or ``""`` (unknown) is ``"unlabelled"``; a name outside ``names`` is ``"other"``.
    """

    def __init__(self, names: Iterable[str]) -> None:
        self.names = frozenset(names) | {UNLABELLED, OTHER}

    def __call__(self, layer: str | None) -> str:
        if not layer:
            return UNLABELLED
        return layer if layer in self.names else OTHER


# ---------------------------------------------------------------------- stats data
# ``{"counters": {stat: n}, "by_layer": {stat: {layer: n}}, "gauges": {stat: x}}``:
# str keys and numbers only (vLLM pickles it from the worker, then msgpacks it to the
# API server). Sections and entries are present only when non-zero / recorded.


def empty_data() -> dict[str, Any]:
    return {"counters": {}, "by_layer": {}, "gauges": {}}


def _normalized(data: Mapping[str, Any] | None) -> dict[str, Any]:
    out = empty_data()
    for section in out:
        value = (data or {}).get(section)
        if isinstance(value, Mapping):
            out[section] = ({k: dict(v) for k, v in value.items()} if section == "by_layer"
                            else dict(value))
    return out


def aggregate_data(into: dict[str, Any], other: Mapping[str, Any]) -> dict[str, Any]:
    """Merge ``other`` into ``into`` (in place): counters add up, gauges keep the larger."""
    other = _normalized(other)
    counters = into.setdefault("counters", {})
    for name, n in other["counters"].items():
        counters[name] = counters.get(name, 0) + n
    by_layer = into.setdefault("by_layer", {})
    for name, layers in other["by_layer"].items():
        mine = by_layer.setdefault(name, {})
        for layer, n in layers.items():
            mine[layer] = mine.get(layer, 0) + n
    gauges = into.setdefault("gauges", {})
    for name, x in other["gauges"].items():
        gauges[name] = max(gauges[name], x) if name in gauges else x
    return into


def reduce_data(data: Mapping[str, Any]) -> dict[str, int | float]:
    """One flat summary (vLLM's "KV Transfer metrics" log line): by-layer counters summed."""
    data = _normalized(data)
    out: dict[str, int | float] = dict(data["counters"])
    for name, layers in data["by_layer"].items():
        out[name] = sum(layers.values())
    out.update(data["gauges"])
    return out


def is_empty_data(data: Mapping[str, Any] | None) -> bool:
    data = _normalized(data)
    return not (data["counters"] or any(data["by_layer"].values()) or data["gauges"])


class StatsRecorder:
    """Thread-safe accumulator of one connector's stats between two :meth:`take` calls.

    Args:
        layers: source layers with their own label value (see :func:`layer_names`).
    """

    def __init__(self, layers: Iterable[str]) -> None:
        self.label = LayerLabels(layers)
        self._lock = threading.Lock()
        self._data = empty_data()

    def count(self, name: str, n: float = 1) -> None:
        if name not in COUNTERS:
            raise KeyError(f"unknown counter {name!r}; known: {COUNTERS}")
        if n:
            with self._lock:
                counters = self._data["counters"]
                counters[name] = counters.get(name, 0) + n

    def count_layers(self, name: str, layers: Iterable[str | None]) -> None:
        """Count one block per entry of ``layers`` (source layers, bounded)."""
        if name not in BY_LAYER:
            raise KeyError(f"unknown by-layer counter {name!r}; known: {BY_LAYER}")
        labels = [self.label(layer) for layer in layers]
        if labels:
            with self._lock:
                mine = self._data["by_layer"].setdefault(name, {})
                for label in labels:
                    mine[label] = mine.get(label, 0) + 1

    def set_gauge(self, name: str, value: float) -> None:
        if name not in GAUGES:
            raise KeyError(f"unknown gauge {name!r}; known: {GAUGES}")
        with self._lock:
            self._data["gauges"][name] = float(value)

    def take(self) -> dict[str, Any] | None:
        """What was recorded since the last call (a delta), or None if nothing was."""
        with self._lock:
            data, self._data = self._data, empty_data()
        return None if is_empty_data(data) else data


# ---------------------------------------------------------------------- vLLM classes
if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics as _PromBase,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorStats as _StatsBase,
    )
else:
    try:  # vLLM >= 0.11.1
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
            KVConnectorPromMetrics as _PromBase,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
            KVConnectorStats as _StatsBase,
        )
    except ImportError:  # no vLLM (unit tests) or an older one (the hooks are never called)

        @dataclass
        class _StatsBase:
            """Stand-in for vLLM's ``KVConnectorStats`` (same fields and ``to_dict``)."""

            data: dict[str, Any] = field(default_factory=dict)

            def to_dict(self) -> dict[str, Any]:
                return self.data

        class _PromBase:
            """Stand-in for vLLM's ``KVConnectorPromMetrics`` (same constructor)."""

            def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                         labelnames: list[str],
                         per_engine_labelvalues: dict[int, list[object]]) -> None:
                from prometheus_client import Counter, Gauge, Histogram

                self._kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
                self._gauge_cls = metric_types[Gauge]
                self._counter_cls = metric_types[Counter]
                self._histogram_cls = metric_types[Histogram]
                self._labelnames = labelnames
                self.per_engine_labelvalues = per_engine_labelvalues


@dataclass
class ContextKitConnectorStats(_StatsBase):
    """The connector's stats for one interval, both roles (see the module docstring)."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.data = _normalized(self.data)

    def reset(self) -> None:
        self.data = empty_data()

    def aggregate(self, other: Any) -> ContextKitConnectorStats:
        aggregate_data(self.data, getattr(other, "data", None) or {})
        return self

    def reduce(self) -> dict[str, int | float]:
        return reduce_data(self.data)

    def is_empty(self) -> bool:
        return is_empty_data(self.data)


def _extra_config(vllm_config: Any) -> Mapping[str, Any]:
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(transfer, "kv_connector_extra_config", None)
    return extra if isinstance(extra, Mapping) else {}


#: How often the API server reads the workers' ledgers (:mod:`integrations.vllm.ledger`).
LEDGER_POLL_S = 1.0


class ContextKitPromMetrics(_PromBase):
    """The connector's Prometheus metrics, created through vLLM's injected classes.

    Besides each step's stats (:meth:`observe`), a thread reads the ledgers of this
    server's workers every ``ledger_poll_s`` (0: only when :meth:`poll_ledgers` is
    called): what their background threads counted between steps."""

    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]], *,
                 ledger_dir: Path | None = None,
                 ledger_poll_s: float = LEDGER_POLL_S) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        default_layer = _extra_config(vllm_config).get("default_source_layer") or "user_turn"
        self.label = LayerLabels(layer_names(str(default_layer)))
        names = list(labelnames)
        engines = dict(per_engine_labelvalues)
        self._engines = engines
        self.counters: dict[str, dict[int, Any]] = {}
        for stat in COUNTERS:
            metric = self._counter_cls(name=METRIC_NAMES[stat], documentation=_DOCS[stat],
                                       labelnames=names)
            self.counters[stat] = {i: metric.labels(*lv) for i, lv in engines.items()}
        self.by_layer: dict[str, Any] = {
            stat: self._counter_cls(name=METRIC_NAMES[stat], documentation=_DOCS[stat],
                                    labelnames=[*names, "layer"])
            for stat in BY_LAYER}
        self.gauges: dict[str, dict[int, Any]] = {}
        for stat in GAUGES:
            metric = self._gauge_cls(name=METRIC_NAMES[stat], documentation=_DOCS[stat],
                                     labelnames=names, multiprocess_mode="mostrecent")
            self.gauges[stat] = {i: metric.labels(*lv) for i, lv in engines.items()}
        instance = getattr(vllm_config, "instance_id", "")
        # with several API servers (their counters summed) the first one reads them
        api_rank = getattr(getattr(vllm_config, "parallel_config", None),
                           "_api_process_rank", 0)
        self._ledgers = (LedgerReader(str(instance), ledger_dir)
                         if instance and api_rank <= 0 else None)
        if self._ledgers is not None and ledger_poll_s > 0:
            threading.Thread(target=self._poll, args=(ledger_poll_s,),
                             name="contextkit-ledgers", daemon=True).start()

    def poll_ledgers(self) -> None:
        """Record what the workers' ledgers gained since the last poll."""
        if self._ledgers is None:
            return
        for engine, data in self._ledgers.changes().items():
            self.observe(data, engine)

    def _poll(self, every_s: float) -> None:
        while True:  # a daemon thread: it ends with the API server
            time.sleep(every_s)
            try:
                self.poll_ledgers()
            except Exception:  # a metrics reader never takes the server down
                logger.exception("reading contextkit's metrics ledgers failed")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one step's stats (deltas for counters, latest value for gauges)."""
        if engine_idx not in self._engines:
            return
        data = _normalized(transfer_stats_data)
        for stat, n in data["counters"].items():
            if stat in self.counters and n > 0:
                self.counters[stat][engine_idx].inc(n)
        labelvalues = self._engines[engine_idx]
        for stat, layers in data["by_layer"].items():
            if stat not in self.by_layer:
                continue
            for layer, n in layers.items():
                if n > 0:
                    self.by_layer[stat].labels(*labelvalues, self.label(layer)).inc(n)
        for stat, x in data["gauges"].items():
            if stat in self.gauges:
                self.gauges[stat][engine_idx].set(x)
