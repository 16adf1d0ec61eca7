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
its turn (``lookahead``).

The manager is a facade over parts it owns: the value types (tiers, items, decisions,
:class:`TierManagerConfig`, reports) live in ``tier_types``, the items and the blocks
they own in ``table`` (an :class:`~contextkit.loop.table.ItemStore`), the Observe,
Orient and Decide computations in ``ooda``, the look-ahead in ``lookahead`` (a
:class:`~contextkit.loop.lookahead.Lookahead` the manager delegates to), the bridge in
``bridge`` and the Prometheus export in ``prometheus``; every public name is
re-exported here, its import path. :meth:`ContextTierManager.from_config` reads the
``tiers`` section of :mod:`contextkit.config`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from contextkit.config.errors import require
from contextkit.loop.bridge import TierCacheBridge
from contextkit.loop.lookahead import Lookahead
from contextkit.loop.ooda import decide, ingest, orient
from contextkit.loop.ooda import spilled_line_id as spilled_line_id  # its import path
from contextkit.loop.prometheus import TierPrometheus
from contextkit.loop.table import ItemStore
from contextkit.loop.tier_types import (
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
from gpu_cache import Tier, TQGPUCache, validate_name

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


class ContextTierManager:
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
    :meth:`set_lookahead`, :meth:`prefetch` (the look-ahead part the manager owns).
    Thread-safe.
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
        self._items = ItemStore(self.cache)
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
        self._prom = TierPrometheus(registry) if prometheus else None
        self._ahead = Lookahead(self._items, self.config, clock, self._lock, self._cycle_lock)

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
            self._items.add(item_id, kind, ContextTier(tier), tenant, tuple(block_ids),
                            relevance, payload,
                            self.clock() if last_access is None else last_access)

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
            row = self._items.row(item_id)
            item = self._items.table.snapshot(row)
            self._items.drop_row(row)
            return item

    def record_access(self, item_id: str, count: int = 1) -> None:
        """Count ``count`` uses of an item now (blocks attended are counted by Observe)."""
        with self._lock:
            t, row = self._items.table, self._items.row(item_id)
            t.hits[row] += count
            t.last_access[row] = max(t.last_access[row], self.clock())

    def set_relevance(self, item_id: str, relevance: float) -> None:
        if not 0.0 <= relevance <= 1.0:
            raise ValueError(f"relevance must be within [0, 1], got {relevance}")
        with self._lock:
            self._items.table.relevance[self._items.row(item_id)] = relevance

    def get(self, item_id: str) -> TierItem:
        """A snapshot of an item. Raises KeyError for an unknown id."""
        with self._lock:
            return self._items.table.snapshot(self._items.row(item_id))

    def items(self, tier: ContextTier | None = None) -> list[TierItem]:
        """Snapshots of every item (of one tier)."""
        with self._lock:
            t = self._items.table
            mask = t.alive[: t.size].copy()
            if tier is not None:
                mask &= t.tier[: t.size] == int(tier)
            return [t.snapshot(int(r)) for r in np.flatnonzero(mask)]

    def tier_counts(self) -> dict[str, int]:
        with self._lock:
            return self._tier_counts_locked()

    def _tier_counts_locked(self) -> dict[str, int]:
        t = self._items.table
        counts = np.bincount(t.tier[: t.size][t.alive[: t.size]], minlength=3)
        return {tier.name.lower(): int(counts[tier]) for tier in ContextTier}

    def __len__(self) -> int:
        return len(self._items.table.row_of)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._items.table.row_of

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
            accesses = ingest(self._items, lines, blocks, self.config.spilled_line_tier)
            table = self._items.table
            elapsed = (0.0 if self._last_cycle_at is None
                       else max(0.0, started - self._last_cycle_at))
            self._last_cycle_at = started
            orient(table, self.config, started, elapsed,
                   self._ahead.due_term_locked(table.size))
            t2 = time.perf_counter()
            decisions, self._last_actions = decide(table, self.config, self._thresholds)
            items_by_tier = self._tier_counts_locked()
            num_items = len(table.row_of)
            prefetch = self._ahead.take_prefetch_counts_locked()
        t3 = time.perf_counter()
        act = self.bridge.act(decisions)
        with self._lock:  # and what the cache evicted to make room for the warms
            self._items.forget_blocks(act.removed + act.gone)
            self._items.reconcile()
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

    # ------------------------------------------------------------------ many agents
    def register_segments(self, agent: str, tenant: str,
                          segments: Sequence[tuple[str, float, Sequence[int]]]) -> list[str]:
        """Track the blocks of one call of ``agent`` as prompt segments.

        Each ``(layer, importance, block_ids)`` becomes an item of kind
        :attr:`ItemKind.SEGMENT` in the prompt tier, ``relevance=importance``, payload a
        :class:`SegmentInfo`. Blocks another item owns already (another agent of the
        tenant sharing the organisation's layers, or this agent's previous call) are
        not owned twice: they count as an access of their owner, which gains
        ``agent``. A segment without unowned blocks creates no item. Items of the
        agent's previous call that this call does not touch lose ``agent``. Block ids
        no longer in the cache are ignored.

        A new segment of a layer the agent's previous call also had (its text changed
        since: the system state, the time, the conversation) is *volatile*: it will
        most likely change again before it is reused, so prefetch moves it away as if
        no agent were due, before the stable blocks of agents that are.

        Returns:
            The ids of the items touched (new or existing), in prompt order.

        Raises:
            InvalidNameError: ``agent`` or ``tenant`` breaks the naming rule.
            ValueError: an importance outside ``[0, 1]``.
        """
        return self._ahead.register_segments(agent, tenant, segments)

    def agent_items(self, agent: str) -> list[str]:
        """Ids of the items of ``agent``'s latest registered call, in prompt order."""
        return self._ahead.agent_items(agent)

    def set_lookahead(self, due: Mapping[str, int | None], *,
                      tenants: Mapping[str, str] | None = None) -> None:
        """Replace the look-ahead: agent -> steps until its next turn (1 = the next
        step; ``None`` or absent: not expected again).

        ``tenants`` (agent -> tenant) lets an agent that has not run yet protect its
        tenant's blocks: its first turn reuses the organisation's layers other agents
        of the tenant registered, so every item of that tenant counts as due no later
        than that agent.

        Raises:
            InvalidNameError: an agent name that breaks the naming rule.
            ValueError: steps that are not an integer >= 0.
        """
        self._ahead.set_lookahead(due, tenants=tenants)

    def lookahead(self) -> dict[str, int | None]:
        """The look-ahead set by :meth:`set_lookahead` (a copy)."""
        return self._ahead.lookahead()

    def prefetch(self, agent: str, *, need_blocks: int = 0,
                 blocks: Sequence[int] = ()) -> PrefetchReport:
        """Get the cache ready for ``agent``'s turn, now (between turns).

        1. Make ``need_blocks`` device blocks free *beyond* the room the warm in
           step 3 takes, by spilling the unpinned, unused blocks of other agents'
           items: first those no agent is due to read (items no agent's latest call
           holds, of agents the look-ahead does not expect, volatile segments), then
           the lowest effective layer priority, the agent due furthest among equals
           (see ``_victim_order``).
        2. When the host tier must make room for those spills, free host blocks the
           same way, never those of ``agent`` or of agents due within
           ``config.protect_horizon`` steps; spill only what then fits.
        3. Warm every host-tier block of ``agent``'s items (its latest call) to the
           device, in prompt order; what finds no room stays (skipped, ``tier_full``).

        ``blocks`` are the cached blocks the turn will reuse, when the caller knows them
        (:meth:`CacheAwareContextPipeline.plan_turn
        <contextkit.pipeline.pipeline.CacheAwareContextPipeline.plan_turn>` looks the assembled
        prompt up; with ``need_blocks=plan.need_blocks``): they are warmed first and
        are never spilled or archived, whoever owns them (an agent's first turn reuses
        its organisation's blocks, registered by another agent), and they replace step
        3: the agent's other blocks (its last call's volatile tail) are not warmed and
        count as blocks no agent is due to read.

        Warms and spills alternate into free slots, so the host blocks archived are
        the net room the spills need beyond what the warms give back, and the cache
        never evicts anything on prefetch's behalf. Pinned and in-use blocks never
        move; they are reported as skipped. Prefetch moves bytes, not items: an
        item's context tier (where it stands in the context) changes only by a
        cycle's decisions, so a cycle does not warm back what prefetch spilled; a
        segment whose every block was archived is dropped. Runs one at a time with
        the OODA cycle.

        Raises:
            InvalidNameError: ``agent`` breaks the naming rule.
            ValueError: a negative ``need_blocks``.
            RuntimeError: the manager is closed.
        """
        validate_name(agent, "agent")
        if need_blocks < 0:
            raise ValueError(f"need_blocks must be >= 0, got {need_blocks}")
        if self._closed:
            raise RuntimeError("this ContextTierManager is closed; create a new one")
        return self._ahead.prefetch(agent, need_blocks, blocks)

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
