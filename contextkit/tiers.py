"""Context tier manager (OODA) and the bridge that moves KV blocks to match.

Everything a prompt can draw on beyond its fixed layers is an *item*: a line
spilled by :func:`contextkit.prompt.synthesize_for_budget`, a memory-graph node,
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
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import math
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from contextkit._extras import require
from contextkit.prompt import SpilledLine, SpilloverQueue
from gpu_cache import BlockStateError, Tier, TQGPUCache, UnknownBlockError

if TYPE_CHECKING:
    from memory_graph import GraphBlockReserver, ReservationResult

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
    "ThresholdPolicy",
    "ThresholdSuggestion",
    "Thresholds",
    "TierCacheBridge",
    "TierItem",
    "TierManagerConfig",
]

logger = logging.getLogger(__name__)


class ContextTier(enum.IntEnum):
    """Where an item stands in the context (not where its bytes are)."""

    PROMPT = 0  # in the prompt; KV in the device tier
    WORKING = 1  # working memory; KV in the host (DDR) tier
    ARCHIVE = 2  # archived; no KV kept


class ItemKind(enum.Enum):
    """What an item is."""

    SPILLED_LINE = "spilled_line"
    MEMORY = "memory"
    RESERVATION = "reservation"
    SEGMENT = "segment"


_KINDS = tuple(ItemKind)
_KIND_CODE = {kind: code for code, kind in enumerate(_KINDS)}


class Action(enum.Enum):
    """A tier change. Promote: one tier up; demote: 0 -> 1; archive: 1 -> 2."""

    PROMOTE = "promote"
    DEMOTE = "demote"
    ARCHIVE = "archive"


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Score thresholds, ``0 <= archive < demote < promote <= 1``."""

    promote: float = 0.6
    demote: float = 0.35
    archive: float = 0.15

    def __post_init__(self) -> None:
        if not 0.0 <= self.archive < self.demote < self.promote <= 1.0:
            raise ValueError(f"thresholds must satisfy 0 <= archive < demote < promote <= 1, "
                             f"got {self}")


@dataclass(frozen=True, slots=True)
class ThresholdPolicy:
    """How DDR occupancy moves the thresholds (one ``step`` per cycle).

    Below ``low_water`` the host tier has room: the promotion threshold drops (so
    more items come back from the archive into working memory) and the demotion
    and archive thresholds relax toward their configured values. Above
    ``high_water`` the demotion threshold rises, and the archive threshold with it
    so that working memory sheds blocks from DDR; the promotion threshold relaxes
    toward its configured value. In between nothing changes.
    """

    low_water: float = 0.5
    high_water: float = 0.8
    step: float = 0.05
    min_promote: float = 0.3
    max_demote: float = 0.55
    min_gap: float = 0.05

    def __post_init__(self) -> None:
        if not 0.0 <= self.low_water < self.high_water <= 1.0 or self.step <= 0:
            raise ValueError(f"need 0 <= low_water < high_water <= 1 and step > 0, got {self}")

    def suggest(self, current: Thresholds, base: Thresholds,
                host_occupancy: float) -> tuple[Thresholds, str] | None:
        """The thresholds for the next cycle and why, or None inside the band."""
        gap, step = self.min_gap, self.step
        if host_occupancy < self.low_water:
            archive = (current.archive if current.archive <= base.archive
                       else max(base.archive, current.archive - step))
            demote = (current.demote if current.demote <= base.demote
                      else max(base.demote, current.demote - step, archive + gap))
            promote = min(current.promote, max(self.min_promote, demote + gap,
                                               current.promote - step))
            why = f"host tier {host_occupancy:.0%} full < {self.low_water:.0%}: lower promotion"
        elif host_occupancy > self.high_water:
            promote = (current.promote if current.promote >= base.promote
                       else min(base.promote, current.promote + step))
            demote = max(current.demote, min(self.max_demote, promote - gap,
                                             current.demote + step))
            archive = max(current.archive, min(demote - gap, current.archive + step))
            why = f"host tier {host_occupancy:.0%} full > {self.high_water:.0%}: raise demotion"
        else:
            return None
        return Thresholds(round(promote, 6), round(demote, 6), round(archive, 6)), why


@dataclass(frozen=True, slots=True)
class ThresholdSuggestion:
    """Thresholds the bridge suggested after a cycle, and whether they were applied."""

    host_occupancy: float
    before: Thresholds
    after: Thresholds
    reason: str
    applied: bool


@dataclass(frozen=True, slots=True)
class TierManagerConfig:
    """Settings of a :class:`ContextTierManager`; defaults live here only.

    Args:
        interval_s: seconds between scheduled cycles.
        misfire_grace_s: how late a scheduled cycle may still run.
        frequency_weight: weight of the access-frequency term of the score (the three
            weights sum to 1).
        recency_weight: weight of the recency term.
        relevance_weight: weight of the relevance term.
        recency_half_life_s: idle time that halves the recency term.
        frequency_half_life_s: time that halves the access count.
        frequency_scale: access count that gives ``1 - 1/e`` of the frequency term.
        thresholds: initial (and base) thresholds.
        max_prompt_items: most items in tier 0 (``None``: no limit).
        max_moves_per_cycle: most decisions per cycle, largest margins first.
        max_spill_drain: most spilled lines taken per cycle.
        spilled_line_tier: tier of newly spilled lines.
        history: cycles kept by :meth:`ContextTierManager.metrics`.
    """

    interval_s: float = 60.0
    misfire_grace_s: float = 30.0
    frequency_weight: float = 0.4
    recency_weight: float = 0.35
    relevance_weight: float = 0.25
    recency_half_life_s: float = 600.0
    frequency_half_life_s: float = 1800.0
    frequency_scale: float = 3.0
    thresholds: Thresholds = field(default_factory=Thresholds)
    max_prompt_items: int | None = None
    max_moves_per_cycle: int | None = 10_000
    max_spill_drain: int = 10_000
    spilled_line_tier: ContextTier = ContextTier.WORKING
    history: int = 256

    def __post_init__(self) -> None:
        weights = (self.frequency_weight, self.recency_weight, self.relevance_weight)
        if min(weights) < 0 or not math.isclose(sum(weights), 1.0, abs_tol=1e-6):
            raise ValueError(f"score weights must be >= 0 and sum to 1, got {weights}")
        if min(self.interval_s, self.recency_half_life_s, self.frequency_half_life_s,
               self.frequency_scale) <= 0:
            raise ValueError("interval_s, half-lives and frequency_scale must be > 0")
        if self.history < 1 or self.max_spill_drain < 0:
            raise ValueError("history must be >= 1 and max_spill_drain >= 0")


@dataclass(frozen=True, slots=True)
class TierItem:
    """A snapshot of one item."""

    item_id: str
    kind: ItemKind
    tier: ContextTier
    tenant: str
    block_ids: tuple[int, ...]
    relevance: float
    frequency: float
    last_access: float
    score: float
    payload: object = None


class Decision(NamedTuple):
    """One tier change decided by a cycle (a named tuple: cycles make thousands)."""

    item_id: str
    kind: ItemKind
    action: Action
    from_tier: ContextTier
    to_tier: ContextTier
    score: float
    threshold: float
    block_ids: tuple[int, ...] = ()
    tenant: str = "default"
    payload: object = None

    @property
    def reason(self) -> str:
        op = ">=" if self.action is Action.PROMOTE else "<"
        return (f"{self.action.value} {self.item_id} tier {int(self.from_tier)}->"
                f"{int(self.to_tier)}: score {self.score:.3f} {op} {self.action.value} "
                f"threshold {self.threshold:.3f}")


@dataclass(frozen=True, slots=True)
class BlockSkip:
    """A block the bridge left alone. ``reason``: pinned, in_use, gone, tier_full, error."""

    block_id: int
    item_id: str
    action: Action
    reason: str
    detail: str = ""


@dataclass(slots=True)
class ActReport:
    """What the bridge did with one cycle's decisions."""

    warmed: list[int] = field(default_factory=list)
    spilled: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    gone: list[int] = field(default_factory=list)  # freed by someone else meanwhile
    skipped: list[BlockSkip] = field(default_factory=list)
    reservations: list[str] = field(default_factory=list)
    bytes_moved: int = 0
    bytes_freed: int = 0


@dataclass(frozen=True, slots=True)
class CycleMetrics:
    """Measurements of one OODA cycle (JSON-able through :meth:`to_dict`)."""

    cycle: int
    started_at: float
    duration_s: float
    phase_ms: dict[str, float]
    num_items: int
    items_by_tier: dict[str, int]
    actions: dict[str, int]
    blocks_moved: dict[str, int]
    blocks_skipped: dict[str, int]
    bytes_moved: int
    bytes_freed: int
    spilled_lines: int
    accesses_observed: int
    host_occupancy: float | None
    device_occupancy: float | None
    thresholds_before: Thresholds
    thresholds_after: Thresholds
    threshold_reason: str = ""

    @property
    def num_blocks_moved(self) -> int:
        return sum(self.blocks_moved.values())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class CycleReport:
    """Everything one cycle produced: metrics, decisions, the bridge's report."""

    metrics: CycleMetrics
    decisions: tuple[Decision, ...]
    act: ActReport
    suggestion: ThresholdSuggestion | None


class TierCacheBridge:
    """Moves an item's KV blocks when its context tier changes.

    Promotion warms blocks (DDR -> VRAM), demotion spills them (VRAM -> DDR),
    archiving frees them. Pinned blocks and blocks in use (``ref_count > 0``) are
    never touched; neither are blocks freed meanwhile; each is recorded as a
    :class:`BlockSkip`. A full tier is not an error: what fits moves, the rest is
    skipped as ``tier_full``. Block moves run under ``cache.locked()`` so readers
    never see a half-applied cycle. With ``cache=None`` the bridge does nothing.

    Args:
        cache: the tiered cache, or None.
        reserver: when given, reservation items are warmed and released through it
            (their blocks are held by the reserver, so they are never moved directly).
        policy: how DDR occupancy moves the thresholds.
        apply_thresholds: apply suggestions automatically; False only records them.
    """

    def __init__(self, cache: TQGPUCache | None, *, reserver: GraphBlockReserver | None = None,
                 policy: ThresholdPolicy | None = None, apply_thresholds: bool = True) -> None:
        self.cache = cache
        self.reserver = reserver
        self.policy = policy or ThresholdPolicy()
        self.apply_thresholds = apply_thresholds

    def occupancy(self, tier: Tier) -> float | None:
        """Used fraction of a cache tier (None without a cache or capacity)."""
        if self.cache is None or self.cache.capacity(tier) == 0:
            return None
        return self.cache.num_used(tier) / self.cache.capacity(tier)

    def suggest_thresholds(self, current: Thresholds,
                           base: Thresholds) -> ThresholdSuggestion | None:
        """Thresholds for the next cycle from the DDR occupancy (None: no change)."""
        occupancy = self.occupancy(Tier.HOST)
        if occupancy is None:
            return None
        suggested = self.policy.suggest(current, base, occupancy)
        if suggested is None:
            return None
        after, why = suggested
        if after == current:  # already at the bound: nothing to suggest
            return None
        return ThresholdSuggestion(occupancy, current, after, why, self.apply_thresholds)

    def act(self, decisions: Sequence[Decision]) -> ActReport:
        """Apply ``decisions`` to the cache: frees first, then spills, then warms."""
        report = ActReport()
        cache = self.cache
        if cache is None or not decisions:
            return report
        groups: dict[Action, list[Decision]] = {a: [] for a in Action}
        routed: list[Decision] = []
        for d in decisions:
            if (d.kind is ItemKind.RESERVATION and self.reserver is not None
                    and d.action is not Action.DEMOTE and d.payload is not None):
                routed.append(d)
            elif d.block_ids:
                groups[d.action].append(d)
        with cache.locked():
            self._free(self._select(groups[Action.ARCHIVE], None, report), report)
            self._move(self._select(groups[Action.DEMOTE], Tier.HOST, report),
                       cache.spill_blocks, report.spilled, report)
            self._move(self._select(groups[Action.PROMOTE], Tier.DEVICE, report),
                       cache.warm_blocks, report.warmed, report)
        # The reserver takes its own lock, then the cache's: call it outside ours.
        for d in routed:
            self._act_reservation(d, report)
        report.bytes_moved = (len(report.warmed) + len(report.spilled)) * cache.bytes_per_block
        report.bytes_freed = len(report.removed) * cache.bytes_per_block
        return report

    def _select(self, decisions: list[Decision], target: Tier | None,
                report: ActReport) -> list[tuple[Decision, list[int]]]:
        """Blocks of each decision that need to move to ``target`` (None: be freed)."""
        assert self.cache is not None
        metadata = self.cache.metadata
        out = []
        for d in decisions:
            ids = []
            for bid in d.block_ids:
                try:
                    meta = metadata.get(bid)
                except UnknownBlockError:
                    report.gone.append(bid)
                    continue
                if meta.tier is target:
                    continue
                if meta.pinned or meta.ref_count:
                    reason = "pinned" if meta.pinned else "in_use"
                    report.skipped.append(BlockSkip(bid, d.item_id, d.action, reason))
                    continue
                ids.append(bid)
            if ids:
                out.append((d, ids))
        return out

    def _move(self, groups: list[tuple[Decision, list[int]]],
              move: Callable[[Sequence[int]], list[int] | None], moved: list[int],
              report: ActReport) -> None:
        """One bulk move; when it does not fit (None), item by item, skipping what won't."""
        every = [bid for _, ids in groups for bid in ids]
        if not every:
            return
        try:
            done = move(every)
        except (UnknownBlockError, BlockStateError):  # cannot happen under the lock; be safe
            done = None
        if done is not None:
            moved.extend(done)
            return
        for d, ids in groups:
            try:
                done = move(ids)
            except (UnknownBlockError, BlockStateError) as exc:
                report.skipped.extend(BlockSkip(b, d.item_id, d.action, "error", str(exc))
                                      for b in ids)
                continue
            if done is None:
                report.skipped.extend(BlockSkip(b, d.item_id, d.action, "tier_full")
                                      for b in ids)
            else:
                moved.extend(done)

    def _free(self, groups: list[tuple[Decision, list[int]]], report: ActReport) -> None:
        assert self.cache is not None
        every = [bid for _, ids in groups for bid in ids]
        if not every:
            return
        try:
            self.cache.remove_blocks(every)
            report.removed.extend(every)
            return
        except (UnknownBlockError, BlockStateError):
            pass  # remove_blocks checks before it frees: nothing changed; go one by one
        for d, ids in groups:
            for bid in ids:
                try:
                    self.cache.remove_blocks([bid])
                except UnknownBlockError:
                    report.gone.append(bid)
                except BlockStateError as exc:
                    report.skipped.append(BlockSkip(bid, d.item_id, d.action, "error", str(exc)))
                else:
                    report.removed.append(bid)

    def _act_reservation(self, d: Decision, report: ActReport) -> None:
        assert self.reserver is not None
        rid = str(d.payload)
        try:
            if d.action is Action.ARCHIVE:
                res = self.reserver.release(rid)
            elif d.to_tier is ContextTier.PROMPT:
                res = self.reserver.warm_reservation(rid)
            else:
                return
        except KeyError as exc:  # UnknownReservationError: forgotten by the reserver
            report.reservations.append(f"{d.action.value} {rid}: {exc}")
            return
        note = f" ({res.reason})" if res.reason else ""
        report.reservations.append(f"{d.action.value} {rid}: {res.state.value}{note}")


class _ItemTable:
    """Columnar item store: numpy columns for scoring, lists for the rest."""

    def __init__(self, capacity: int = 1024) -> None:
        self.size = 0  # rows in use, alive or free
        self.row_of: dict[str, int] = {}
        self.ids: list[str | None] = []
        self.tenant: list[str] = []
        self.blocks: list[tuple[int, ...]] = []
        self.payload: list[object] = []
        self.free_rows: list[int] = []
        self.alive = np.zeros(capacity, dtype=bool)
        self.kind = np.zeros(capacity, dtype=np.int8)
        self.tier = np.zeros(capacity, dtype=np.int8)
        self.relevance = np.zeros(capacity)
        self.freq = np.zeros(capacity)
        self.hits = np.zeros(capacity)
        self.last_access = np.zeros(capacity)
        self.score = np.zeros(capacity)

    _COLUMNS = ("alive", "kind", "tier", "relevance", "freq", "hits", "last_access", "score")

    def new_row(self) -> int:
        if self.free_rows:
            return self.free_rows.pop()
        if self.size == self.alive.shape[0]:
            for name in self._COLUMNS:
                col = getattr(self, name)
                grown = np.zeros(col.shape[0] * 2, dtype=col.dtype)
                grown[: col.shape[0]] = col
                setattr(self, name, grown)
        self.ids.append(None)
        self.tenant.append("")
        self.blocks.append(())
        self.payload.append(None)
        self.size += 1
        return self.size - 1

    def snapshot(self, row: int) -> TierItem:
        item_id = self.ids[row]
        assert item_id is not None
        return TierItem(item_id, _KINDS[int(self.kind[row])], ContextTier(int(self.tier[row])),
                        self.tenant[row], self.blocks[row], float(self.relevance[row]),
                        float(self.freq[row] + self.hits[row]), float(self.last_access[row]),
                        float(self.score[row]), self.payload[row])


def spilled_line_id(line: SpilledLine) -> str:
    """Stable item id of a spilled line (the same line spilled again is the same item)."""
    digest = hashlib.sha256(f"{line.layer}\0{line.text}".encode()).hexdigest()[:16]
    return f"line:{line.layer}:{digest}"


class _Prometheus:
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
    and :meth:`close` (or ``with``) to stop. Thread-safe.
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
            t = self._table
            row = self._row(item_id)
            item = t.snapshot(row)
            for bid in t.blocks[row]:
                self._owner.pop(bid, None)
            del t.row_of[item_id]
            t.ids[row], t.blocks[row], t.payload[row] = None, (), None
            t.alive[row] = False
            t.free_rows.append(row)
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
        t3 = time.perf_counter()
        act = self.bridge.act(decisions)
        if act.removed or act.gone:
            with self._lock:
                self._forget_blocks(act.removed + act.gone)
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

    def _forget_blocks(self, block_ids: Iterable[int]) -> None:
        t = self._table
        for bid in block_ids:
            row = self._owner.pop(bid, None)
            if row is not None:
                t.blocks[row] = tuple(b for b in t.blocks[row] if b != bid)

    def _orient(self, now: float) -> None:
        """Score every row: weighted frequency, recency and relevance."""
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
