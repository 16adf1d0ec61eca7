"""Prometheus export of the tier manager's cycles (``ContextTierManager(prometheus=True)``)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from contextkit.config.errors import require
from contextkit.loop.tier_types import CycleMetrics

__all__ = ["TierPrometheus"]


class TierPrometheus:
    """Counters, gauges and a histogram of the cycles on one CollectorRegistry."""

    def __init__(self, registry: Any | None) -> None:
        pc = require("prometheus_client", "ooda")
        self.registry = registry if registry is not None else pc.CollectorRegistry()
        r = self.registry
        self.cycles = pc.Counter("contextkit_tier_cycles", "OODA cycles run", registry=r)
        self.actions = pc.Counter("contextkit_tier_actions", "tier changes decided",
                                  ["action"], registry=r)
        self.blocks = pc.Counter("contextkit_tier_blocks", "blocks warmed, spilled or removed",
                                 ["move"], registry=r)
        self.skips = pc.Counter("contextkit_tier_blocks_skipped", "blocks left alone",
                                ["reason"], registry=r)
        self.bytes = pc.Counter("contextkit_tier_bytes_moved", "bytes moved between tiers",
                                registry=r)
        self.duration = pc.Histogram(
            "contextkit_tier_cycle_seconds", "OODA cycle duration", registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
        self.items = pc.Gauge("contextkit_tier_items", "items per context tier", ["tier"],
                              registry=r)
        self.thresholds = pc.Gauge("contextkit_tier_threshold", "score thresholds", ["name"],
                                   registry=r)
        self.occupancy = pc.Gauge("contextkit_tier_cache_occupancy",
                                  "used fraction of a cache tier", ["tier"], registry=r)

    def record(self, m: CycleMetrics) -> None:
        self.cycles.inc()
        self.duration.observe(m.duration_s)
        self.bytes.inc(m.bytes_moved)
        for action, n in m.actions.items():
            self.actions.labels(action).inc(n)
        for move, n in m.blocks_moved.items():
            self.blocks.labels(move).inc(n)
        for reason, n in m.blocks_skipped.items():
            self.skips.labels(reason).inc(n)
        for tier, n in m.items_by_tier.items():
            self.items.labels(tier).set(n)
        for name, value in asdict(m.thresholds_after).items():
            self.thresholds.labels(name).set(value)
        for tier, occ in (("device", m.device_occupancy), ("host", m.host_occupancy)):
            if occ is not None:
                self.occupancy.labels(tier).set(occ)
