"""Context tier manager (OODA) and the bridge that moves KV blocks to match.

Everything a prompt can draw on beyond its fixed layers is an *item*: a line
spilled by :func:`contextkit.prompt.markup.synthesize_for_budget`, a memory-graph node,
a :class:`memory_graph.GraphBlockReserver` reservation, a prefix segment. Items
live in three context tiers:

* tier 0, :attr:`ContextTier.PROMPT`: in the prompt; their KV belongs in VRAM.
* tier 1, :attr:`ContextTier.WORKING`: working memory; their KV waits in DDR.
* tier 2, :attr:`ContextTier.ARCHIVE`: archived; no KV is kept.

:class:`ContextTierManager` runs an OODA cycle on an apscheduler
``BackgroundScheduler`` (60 s by default, one instance at a time, coalesced):

* **Observe** drains the spillover queue, reads tier occupancy and each block's
  ``last_attended`` (a block attended since the last cycle counts as an access
  of the item that owns it).
* **Orient** scores every item: weighted saturating frequency (decayed counts),
  recency (exponential half-life) and relevance, all in ``[0, 1]``, on numpy
  columns, so a cycle over 100,000 items costs milliseconds.
* **Decide** lists promotions (score >= promote), demotions from the prompt
  (score < demote) and archivals from working memory (score < archive), each a
  :class:`Decision` that says why.
* **Act** applies the tier changes and hands the decisions to the
  :class:`TierCacheBridge`, which warms, spills or frees the items' blocks and
  suggests thresholds from the DDR occupancy.

Every cycle records a :class:`CycleMetrics` (actions, blocks and bytes moved,
duration, thresholds before and after) in a bounded history, optionally exported
as Prometheus metrics.

With many agents sharing one cache, the pipeline registers each call's blocks as
prompt segments (:meth:`ContextTierManager.register_segments`), the schedule says
who is due next (:meth:`ContextTierManager.set_lookahead`), Orient adds a due term,
and :meth:`ContextTierManager.prefetch` makes room from the blocks nobody is due to
read and the lowest effective priorities, and warms the next agent's blocks before
its turn (``_tier_lookahead``).

The value types (tiers, items, decisions, :class:`TierManagerConfig`, reports) live
in ``_tier_types``, the bridge in ``_tier_bridge``, the columnar item table in
``_tier_table``, the look-ahead in ``_tier_lookahead`` and the Prometheus export in
``_tier_prometheus``; every public name is re-exported here, its import path.
:meth:`ContextTierManager.from_config` reads the ``tiers`` section of
:mod:`contextkit.config`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from contextkit.config.errors import require
from contextkit.loop.bridge import TierCacheBridge
from contextkit.loop.lookahead import _LookaheadMixin
from contextkit.loop.prometheus import _Prometheus
from contextkit.loop.table import _ItemTable
from contextkit.loop.tier_types import (
    _KIND_CODE,
    _KINDS,
    Action,
    ActReport,
    BlockSkip,
    ContextTier,
    CycleMetrics,
    CycleReport,
    Decision,
    ItemKind,
    PrefetchReport,
    SegmentInfo,
    ThresholdPolicy,
    Thresholds,
    ThresholdSuggestion,
    TierItem,
    TierManagerConfig,
)
from contextkit.prompt.markup import SpilledLine, SpilloverQueue
from gpu_cache import Tier, TQGPUCache

if TYPE_CHECKING:
    from memory_graph import ReservationResult

__all__ = [
    "ActReport",
    "Action",
    "BlockSkip",
    "ContextTier",
    "ContextTierManager",
    "CycleMetrics",
    "CycleReport",
    "Decision",
    "ItemKind",
    "PrefetchReport",
    "SegmentInfo",
    "ThresholdPolicy",
    "ThresholdSuggestion",
    "Thresholds",
    "TierCacheBridge",
    "TierItem",
    "TierManagerConfig",
]

logger = logging.getLogger(__name__)


def spilled_line_id(line: SpilledLine) -> str:
    """Stable item id of a spilled line (the same line spilled again is the same item)."""
    digest = hashlib.sha256(f"{line.layer}\0{line.text}".encode()).hexdigest()[:16]
    return f"line:{line.layer}:{digest}"


class ContextTierManager(_LookaheadMixin):
    """Keeps items in context tiers by an OODA cycle; see the module docstring.

    Args:
        cache: the tiered cache whose blocks items own; None manages context only.
        config: scoring, thresholds, schedule and limits.
        spillover: queue of spilled prompt lines drained each cycle.
        bridge: the Act hook; by default a :class:`TierCacheBridge` over ``cache``.
        prometheus: export metrics with prometheus-client (``contextkit[ooda]``).
        registry: the ``CollectorRegistry`` to export on (default: a private one).
        clock: wall-clock seconds, comparable with blocks' ``last_attended``.

    Use :meth:`start` for the scheduled cycle, :meth:`run_once` for one cycle now,
    and :meth:`close` (or ``with``) to stop. Many agents: :meth:`register_segments`,
    :meth:`set_lookahead`, :meth:`prefetch`. Thread-safe.
    """

    def __init__(self, cache: TQGPUCache | None = None, *,
                 config: TierManagerConfig | None = None,
                 spillover: SpilloverQueue | None = None,
                 bridge: TierCacheBridge | None = None, prometheus: bool = False,
                 registry: Any | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if bridge is not None and cache is not None and bridge.cache is not cache:
            raise ValueError("bridge.cache is another cache than `cache`; pass one of them")
        self.bridge = bridge if bridge is not None else TierCacheBridge(cache)
        self.cache = self.bridge.cache
        self.config = config or TierManagerConfig()
        self.spillover = spillover
        self.clock = clock
        self._thresholds = self.config.thresholds
        self._table = _ItemTable()
        self._owner: dict[int, int] = {}  # block id -> row
        self._lock = threading.Lock()  # item table; never held while taking the cache lock
        self._cycle_lock = threading.Lock()  # one cycle at a time
        self._history: deque[CycleMetrics] = deque(maxlen=self.config.history)
        self._listeners: list[Callable[[CycleReport], None]] = []
        self._last_cycle_at: float | None = None
        self._last_actions: dict[str, int] = {}
        self._num_cycles = 0
        self._scheduler: Any = None
        self._closed = False
        self.num_errors = 0
        self.last_error: BaseException | None = None
        self.last_report: CycleReport | None = None
        self._prom = _Prometheus(registry) if prometheus else None
        self._init_lookahead()

    @classmethod
    def from_config(cls, cache: TQGPUCache | None = None, config: Any = None, *,
                    spillover: SpilloverQueue | None = None,
                    bridge: TierCacheBridge | None = None, prometheus: bool = False,
                    registry: Any | None = None, clock: Callable[[], float] = time.time,
                    **overrides: Any) -> ContextTierManager:
        """A manager whose :class:`TierManagerConfig` is a configuration's ``tiers``
        section (``[tiers]``, ``[tiers.thresholds]``, ``CONTEXTKIT_TIERS_*``).

        Args:
            cache: as for the constructor (``engine.cache``).
            config: a :class:`contextkit.config.Config`, a TOML/YAML file, or ``None``:
                :func:`contextkit.config.load_config`.
            spillover: as for the constructor (``pipeline.spillover``).
            bridge: as for the constructor.
            prometheus: as for the constructor.
            registry: as for the constructor.
            clock: as for the constructor.
            **overrides: section tables set in code, which win over every other source,
                e.g. ``tiers={"interval_s": 30, "thresholds": {"promote": 0.7}}``.

        Raises:
            ConfigError: an unknown section or key, or a bad value (one line).
        """
        from contextkit.config import resolve_config

        settings: TierManagerConfig = resolve_config(config, overrides).tiers
        return cls(cache, config=settings, spillover=spillover, bridge=bridge,
                   prometheus=prometheus, registry=registry, clock=clock)

    # ------------------------------------------------------------------ items
    def add_item(self, item_id: str, *, kind: ItemKind = ItemKind.MEMORY,
                 tier: ContextTier = ContextTier.WORKING, tenant: str = "default",
                 block_ids: Iterable[int] = (), relevance: float = 0.5,
                 payload: object = None, last_access: float | None = None) -> None:
        """Track an item; ``block_ids`` are the cache blocks holding its KV.

        Raises:
            ValueError: a known ``item_id``, a relevance outside ``[0, 1]``, or a block
                another item already owns.
        """
        with self._lock:
            self._add_locked(item_id, kind, ContextTier(tier), tenant, tuple(block_ids),
                             relevance, payload,
                             self.clock() if last_access is None else last_access)

    def _add_locked(self, item_id: str, kind: ItemKind, tier: ContextTier, tenant: str,
                    block_ids: tuple[int, ...], relevance: float, payload: object,
                    last_access: float) -> None:
        t = self._table
        if item_id in t.row_of:
            raise ValueError(f"item {item_id!r} is already tracked; remove_item() it first")
        if not 0.0 <= relevance <= 1.0:
            raise ValueError(f"relevance must be within [0, 1], got {relevance}")
        taken = [b for b in block_ids if b in self._owner]
        if taken:
            raise ValueError(f"blocks {taken} already belong to another item; an item's "
                             "blocks are its own")
        row = t.new_row()
        t.row_of[item_id] = row
        t.ids[row], t.tenant[row], t.blocks[row], t.payload[row] = (
            item_id, tenant, block_ids, payload)
        t.alive[row], t.kind[row], t.tier[row] = True, _KIND_CODE[kind], int(tier)
        t.relevance[row], t.freq[row], t.hits[row] = relevance, 0.0, 0.0
        t.last_access[row], t.score[row] = last_access, 0.0
        for bid in block_ids:
            self._owner[bid] = row

    def track_reservation(self, result: ReservationResult, *, relevance: float = 0.5) -> str:
        """Track a :class:`memory_graph.ReservationResult` as a working-memory item.

        Returns:
            The item id (``"reservation:<id>"``).
        """
        item_id = f"reservation:{result.reservation_id}"
        tier = (ContextTier.PROMPT if result.state.value == "warmed" else ContextTier.WORKING)
        self.add_item(item_id, kind=ItemKind.RESERVATION, tier=tier, tenant=result.tenant,
                      block_ids=result.block_ids, relevance=relevance,
                      payload=result.reservation_id)
        return item_id

    def remove_item(self, item_id: str) -> TierItem:
        """Stop tracking an item (its blocks stay in the cache); returns its last state."""
        with self._lock:
            row = self._row(item_id)
            item = self._table.snapshot(row)
            self._drop_row_locked(row)
            return item

    def record_access(self, item_id: str, count: int = 1) -> None:
        """Count ``count`` uses of an item now (blocks attended are counted by Observe)."""
        with self._lock:
            row = self._row(item_id)
            self._table.hits[row] += count
            self._table.last_access[row] = max(self._table.last_access[row], self.clock())

    def set_relevance(self, item_id: str, relevance: float) -> None:
        if not 0.0 <= relevance <= 1.0:
            raise ValueError(f"relevance must be within [0, 1], got {relevance}")
        with self._lock:
            self._table.relevance[self._row(item_id)] = relevance

    def get(self, item_id: str) -> TierItem:
        """A snapshot of an item. Raises KeyError for an unknown id."""
        with self._lock:
            return self._table.snapshot(self._row(item_id))

    def items(self, tier: ContextTier | None = None) -> list[TierItem]:
        """Snapshots of every item (of one tier)."""
        with self._lock:
            t = self._table
            mask = t.alive[: t.size].copy()
            if tier is not None:
                mask &= t.tier[: t.size] == int(tier)
            return [t.snapshot(int(r)) for r in np.flatnonzero(mask)]

    def tier_counts(self) -> dict[str, int]:
        with self._lock:
            return self._tier_counts_locked()

    def _tier_counts_locked(self) -> dict[str, int]:
        t = self._table
        counts = np.bincount(t.tier[: t.size][t.alive[: t.size]], minlength=3)
        return {tier.name.lower(): int(counts[tier]) for tier in ContextTier}

    def __len__(self) -> int:
        return len(self._table.row_of)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._table.row_of

    def _row(self, item_id: str) -> int:
        try:
            return self._table.row_of[item_id]
        except KeyError:
            raise KeyError(f"item {item_id!r} is not tracked; add_item() it first") from None

    @property
    def thresholds(self) -> Thresholds:
        return self._thresholds

    def subscribe(self, callback: Callable[[CycleReport], None]) -> None:
        """Call ``callback(report)`` after every cycle (on the cycle's thread)."""
        self._listeners.append(callback)

    # ------------------------------------------------------------------ the cycle
    def run_once(self) -> CycleReport:
        """Run one OODA cycle now (waits for a running one) and return its report.

        Raises:
            RuntimeError: the manager is closed.
        """
        if self._closed:
            raise RuntimeError("this ContextTierManager is closed; create a new one")
        with self._cycle_lock:
            return self._cycle()

    def _cycle(self) -> CycleReport:
        t0 = time.perf_counter()
        started = self.clock()
        lines, blocks = self._observe()
        t1 = time.perf_counter()
        with self._lock:
            accesses = self._ingest(lines, blocks)
            self._orient(started)
            t2 = time.perf_counter()
            decisions = self._decide()
            items_by_tier = self._tier_counts_locked()
            num_items = len(self._table.row_of)
            prefetch = self._take_prefetch_counts_locked()
        t3 = time.perf_counter()
        act = self.bridge.act(decisions)
        with self._lock:  # and what the cache evicted to make room for the warms
            self._forget_blocks(act.removed + act.gone)
            self._reconcile_locked()
        before = self._thresholds
        suggestion = self.bridge.suggest_thresholds(before, self.config.thresholds)
        if suggestion is not None and suggestion.applied:
            self._thresholds = suggestion.after
        t4 = time.perf_counter()
        self._num_cycles += 1
        metrics = CycleMetrics(
            cycle=self._num_cycles, started_at=started, duration_s=t4 - t0,
            phase_ms={"observe": (t1 - t0) * 1e3, "orient": (t2 - t1) * 1e3,
                      "decide": (t3 - t2) * 1e3, "act": (t4 - t3) * 1e3},
            num_items=num_items, items_by_tier=items_by_tier,
            actions=self._last_actions,
            blocks_moved={"warmed": len(act.warmed), "spilled": len(act.spilled),
                          "removed": len(act.removed)},
            blocks_skipped=dict(Counter(s.reason for s in act.skipped)),
            bytes_moved=act.bytes_moved, bytes_freed=act.bytes_freed,
            spilled_lines=len(lines), accesses_observed=accesses,
            host_occupancy=self.bridge.occupancy(Tier.HOST),
            device_occupancy=self.bridge.occupancy(Tier.DEVICE),
            thresholds_before=before, thresholds_after=self._thresholds,
            threshold_reason="" if suggestion is None else
            suggestion.reason + ("" if suggestion.applied else " (suggested, not applied)"),
            prefetch=prefetch,
        )
        report = CycleReport(metrics, tuple(decisions), act, suggestion)
        self._history.append(metrics)
        self.last_report = report
        self._log(report)
        if self._prom is not None:
            self._prom.record(metrics)
        for callback in list(self._listeners):
            callback(report)
        return report

    def _observe(self) -> tuple[list[SpilledLine], tuple[np.ndarray, np.ndarray]]:
        """Spilled lines and ``(block ids, last_attended)`` of every cached block."""
        lines = (self.spillover.drain(self.config.max_spill_drain)
                 if self.spillover is not None else [])
        empty = (np.zeros(0, dtype=np.int64), np.zeros(0))
        if self.cache is None:
            return lines, empty
        with self.cache.locked():
            metas = self.cache.metadata.all()
            ids = np.fromiter((m.block_id for m in metas), dtype=np.int64, count=len(metas))
            attended = np.fromiter((m.last_attended for m in metas), dtype=np.float64,
                                   count=len(metas))
        return lines, (ids, attended)

    def _ingest(self, lines: list[SpilledLine], blocks: tuple[np.ndarray, np.ndarray]) -> int:
        """Fold observations into the table; returns the accesses observed."""
        t = self._table
        accesses = 0
        for line in lines:
            item_id = spilled_line_id(line)
            row = t.row_of.get(item_id)
            if row is None:
                self._add_locked(item_id, ItemKind.SPILLED_LINE, self.config.spilled_line_tier,
                                 "default", (), min(1.0, max(0.0, line.importance)), line,
                                 line.spilled_at)
            else:  # spilled again: in demand
                t.hits[row] += 1
                t.last_access[row] = max(t.last_access[row], line.spilled_at)
                t.relevance[row] = max(t.relevance[row], min(1.0, line.importance))
                accesses += 1
        ids, attended = blocks
        if not self._owner:
            return accesses
        owner = self._owner
        rows = np.fromiter((owner.get(b, -1) for b in ids.tolist()), dtype=np.int64,
                           count=ids.size)
        mine = rows >= 0
        if mine.any():
            latest = np.full(t.size, -np.inf)
            np.maximum.at(latest, rows[mine], attended[mine])
            seen = latest[: t.size] > t.last_access[: t.size]
            t.hits[: t.size][seen] += 1
            t.last_access[: t.size][seen] = latest[seen]
            accesses += int(np.count_nonzero(seen))
        if int(np.count_nonzero(mine)) < len(owner) and self.cache is not None:
            # Owned blocks missing from the snapshot: freed by someone else, or added
            # after it; only the ones gone from the cache now are forgotten.
            present = set(ids[mine].tolist())
            gone = [b for b in owner if b not in present and b not in self.cache.metadata]
            self._forget_blocks(gone)
        return accesses

    def _orient(self, now: float) -> None:
        """Score every row: weighted frequency, recency, relevance (and the due term)."""
        cfg, t, n = self.config, self._table, self._table.size
        elapsed = 0.0 if self._last_cycle_at is None else max(0.0, now - self._last_cycle_at)
        self._last_cycle_at = now
        freq = t.freq[:n]
        freq *= 2.0 ** (-elapsed / cfg.frequency_half_life_s)
        freq += t.hits[:n]
        t.hits[:n] = 0.0
        idle = np.maximum(now - t.last_access[:n], 0.0)
        score = t.score[:n]
        np.exp2(idle * (-1.0 / cfg.recency_half_life_s), out=score)
        score *= cfg.recency_weight
        score += cfg.frequency_weight * -np.expm1(freq * (-1.0 / cfg.frequency_scale))
        score += cfg.relevance_weight * t.relevance[:n]
        due = self._due_term_locked(n)
        if due is not None:  # the agents due next keep their items up
            score += due

    def _decide(self) -> list[Decision]:
        """Promote / demote / archive lists; applies the tier changes to the table."""
        cfg, t, n, th = self.config, self._table, self._table.size, self._thresholds
        alive, tier, score = t.alive[:n], t.tier[:n], t.score[:n]
        promote = np.flatnonzero(alive & (tier > 0) & (score >= th.promote))
        demote = np.flatnonzero(alive & (tier == 0) & (score < th.demote))
        archive = np.flatnonzero(alive & (tier == 1) & (score < th.archive))
        if cfg.max_prompt_items is not None:
            into_prompt = promote[tier[promote] == 1]
            room = cfg.max_prompt_items - (int(np.count_nonzero(alive & (tier == 0)))
                                           - demote.size)
            if into_prompt.size > max(room, 0):
                best_first = into_prompt[np.argsort(-score[into_prompt], kind="stable")]
                promote = np.setdiff1d(promote, best_first[max(room, 0):])
        rows = np.concatenate([promote, demote, archive])
        codes = np.repeat(np.arange(3, dtype=np.int8), [promote.size, demote.size, archive.size])
        limits = np.array([th.promote, th.demote, th.archive])[codes]
        cap = cfg.max_moves_per_cycle
        if cap is not None and rows.size > cap:
            keep = np.sort(np.argpartition(-np.abs(score[rows] - limits), cap - 1)[:cap])
            rows, codes, limits = rows[keep], codes[keep], limits[keep]
        counts = np.bincount(codes, minlength=3)
        self._last_actions = {a.value: int(n) for a, n in zip(Action, counts, strict=True) if n}
        if rows.size == 0:
            return []
        from_tier = tier[rows].copy()
        to_tier = np.where(codes == 0, from_tier - 1, from_tier + 1).astype(np.int8)
        tier[rows] = to_tier
        actions = (Action.PROMOTE, Action.DEMOTE, Action.ARCHIVE)
        tiers = tuple(ContextTier)
        ids, kinds, blocks, tenants, payloads = t.ids, t.kind, t.blocks, t.tenant, t.payload
        return [
            Decision(ids[r] or "", _KINDS[k], actions[c], tiers[f], tiers[to], s, lim,
                     blocks[r], tenants[r], payloads[r])
            for r, k, c, f, to, s, lim in zip(
                rows.tolist(), kinds[rows].tolist(), codes.tolist(), from_tier.tolist(),
                to_tier.tolist(), score[rows].tolist(), limits.tolist(), strict=True)
        ]

    def _log(self, report: CycleReport) -> None:
        m = report.metrics
        if logger.isEnabledFor(logging.DEBUG):
            for d in report.decisions:
                logger.debug("decision: %s", d.reason)
            for skip in report.act.skipped:
                logger.debug("skipped block %d of %s (%s): %s %s", skip.block_id, skip.item_id,
                             skip.action.value, skip.reason, skip.detail)
        level = logging.INFO if m.actions or m.threshold_reason else logging.DEBUG
        logger.log(level, "tier cycle %d: %d items %s, actions %s, blocks %s, skipped %s, "
                   "%.1f ms%s", m.cycle, m.num_items, m.items_by_tier, m.actions,
                   m.blocks_moved, m.blocks_skipped, m.duration_s * 1e3,
                   f"; {m.threshold_reason}" if m.threshold_reason else "")

    # ------------------------------------------------------------------ reporting
    def metrics(self) -> list[CycleMetrics]:
        """Metrics of the last cycles, oldest first (at most ``config.history``)."""
        return list(self._history)

    @property
    def prometheus_registry(self) -> Any | None:
        """The ``CollectorRegistry`` metrics are exported on (None unless prometheus=True)."""
        return None if self._prom is None else self._prom.registry

    def write_status(self, path: str | os.PathLike[str], last: int = 20) -> Path:
        """Write the last ``last`` cycles, thresholds and tier counts as JSON (atomically)."""
        target = Path(path)
        doc = {
            "written_at": time.time(),
            "interval_s": self.config.interval_s,
            "running": self.running,
            "thresholds": asdict(self._thresholds),
            "items_by_tier": self.tier_counts(),
            "num_errors": self.num_errors,
            "cycles": [m.to_dict() for m in list(self._history)[-last:]],
        }
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        os.replace(tmp, target)
        return target

    # ------------------------------------------------------------------ scheduling
    def start(self) -> None:
        """Start the scheduled cycle every ``config.interval_s``; idempotent."""
        if self._closed:
            raise RuntimeError("this ContextTierManager is closed; create a new one")
        if self._scheduler is not None:
            return
        background = require("apscheduler.schedulers.background", "ooda")
        scheduler = background.BackgroundScheduler(daemon=True)
        scheduler.add_job(self._scheduled_cycle, "interval", seconds=self.config.interval_s,
                          id="contextkit-tier-manager", max_instances=1, coalesce=True,
                          misfire_grace_time=max(1, math.ceil(self.config.misfire_grace_s)))
        scheduler.start()
        self._scheduler = scheduler

    def _scheduled_cycle(self) -> None:
        if self._closed:
            return
        try:
            with self._cycle_lock:
                self._cycle()
        except Exception as exc:  # the next cycle tries again; the error is kept
            self.num_errors += 1
            self.last_error = exc
            logger.exception("tier manager cycle failed")

    @property
    def running(self) -> bool:
        return self._scheduler is not None

    def close(self) -> None:
        """Stop the scheduler, waiting for a running cycle; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=True)
            self._scheduler = None

    def __enter__(self) -> ContextTierManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
