"""The tier manager's look-ahead: prompt segments per agent, who is due next, prefetch.

Many agents share one cache too small for all of them. The pipeline registers each
call's blocks as prompt *segments* (:meth:`register_segments`), the scheduler says
how many steps each agent is from its next turn (:meth:`set_lookahead`, KVFlow's
steps-to-execution), and between turns :meth:`prefetch` makes room on the device
tier by spilling first the blocks no agent is due to read, then the lowest
effective priority (the agent due furthest among equals), archives host blocks the
same way when the host tier must make room for those spills, and warms the due
agent's host blocks so its turn finds them on the device. Orient adds a due term
to the score (:meth:`_due_term_locked`), so scheduled cycles keep the next agents'
items promoted and let the never-due ones sink.

:class:`Lookahead` is a part of :class:`contextkit.loop.tiers.ContextTierManager`, which
owns one and delegates its public methods to it (their public docs are the manager's);
it works on the manager's :class:`~contextkit.loop.table.ItemStore`, handed to it with
the manager's locks.
"""

from __future__ import annotations

import hashlib
import logging
import operator
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

from contextkit.loop.table import ItemStore
from contextkit.loop.tier_types import (
    KINDS,
    Action,
    BlockSkip,
    ContextTier,
    ItemKind,
    PrefetchReport,
    SegmentInfo,
    TierManagerConfig,
)
from gpu_cache import Tier, TQGPUCache, UnknownBlockError, validate_name, validate_tenant

__all__: list[str] = []

logger = logging.getLogger(__name__)

#: Blocks archived beyond the net need when both tiers are full, so that spills and
#: warms can alternate in chunks of this size instead of one block at a time.
_SWAP_BUFFER = 16


def segment_id(tenant: str, block_ids: Iterable[int]) -> str:
    """Item id of a prompt segment: ``seg:<tenant>:<sha256 of the block ids>[:16]``."""
    digest = hashlib.sha256(",".join(map(str, block_ids)).encode()).hexdigest()[:16]
    return f"seg:{tenant}:{digest}"


class _Candidate(NamedTuple):
    """One tracked item with blocks, as the prefetch planner sees it."""

    item_id: str
    blocks: tuple[int, ...]
    layer: str | None  # the segment's layer; None: each block's source_layer
    importance: float
    due: int | None  # steps until the first of its agents is due; None: never


def _victim_order(cache: TQGPUCache, items: Sequence[_Candidate], tier: Tier,
                  action: Action, skipped: list[BlockSkip],
                  keep: frozenset[int] = frozenset()) -> list[int]:
    """Movable blocks of ``items`` in ``tier``, first to go first.

    Blocks no agent is due to read go first: those no agent's latest call holds, those
    of agents the look-ahead does not expect, and volatile segments (replaced since the
    agent's previous call: they change before they are read again). Then, as the
    cache's own semantic eviction, the lowest *effective* layer priority (at most that
    of the blocks before it in its prompt, :meth:`gpu_cache.BlockMetadataTable.chain`:
    a prompt goes tail first and what stays is a prefix); among equals the agent due
    furthest, then the newest block, then the lowest importance. Pinned and in-use
    blocks are recorded in ``skipped``; blocks in ``keep`` (the ones the coming turn
    reuses) are never victims.
    """
    metadata = cache.metadata
    keyed: list[tuple[tuple[float, ...], int]] = []
    for c in items:
        for bid in c.blocks:
            if bid in keep:
                continue
            try:
                meta = metadata.get(bid)
            except UnknownBlockError:
                continue
            if meta.tier is not tier:
                continue
            if meta.pinned or meta.ref_count:
                reason = "pinned" if meta.pinned else "in_use"
                skipped.append(BlockSkip(bid, c.item_id, action, reason))
                continue
            priority, importance = metadata.effective(bid)
            if c.due is None:
                keyed.append(((0.0, priority, 0.0, -bid, importance), bid))
            else:
                keyed.append(((1.0, priority, 1.0 / (1.0 + c.due), -bid, importance), bid))
    keyed.sort(key=operator.itemgetter(0))
    return [bid for _, bid in keyed]


def _plan_and_move(cache: TQGPUCache, mine: Sequence[_Candidate],
                   others: Sequence[_Candidate], need_blocks: int, horizon: int,
                   report: PrefetchReport, reuse: Sequence[int] = ()) -> None:
    """Spill, archive and warm for :meth:`Lookahead.prefetch`; hold the cache lock.

    Every move goes into free slots, so the cache itself never evicts anything here:
    warms fill free device slots and free host slots, spills fill free host slots and
    free device slots, alternately. Host blocks are archived only for the net room
    the spills need beyond what the warms give back (plus a small swap buffer when
    both tiers are full).
    """
    metadata = cache.metadata
    keep = frozenset(reuse)
    warm: list[tuple[str, int]] = []  # (item id, block) of the agent's host blocks, prompt order
    listed: set[int] = set()
    for c in [_Candidate("reuse", tuple(reuse), None, 1.0, 0), *mine]:
        for bid in c.blocks:
            if bid in listed:
                continue
            listed.add(bid)
            try:
                meta = metadata.get(bid)
            except UnknownBlockError:
                continue
            if meta.tier is not Tier.HOST:
                continue
            if meta.pinned or meta.ref_count:
                reason = "pinned" if meta.pinned else "in_use"
                report.skipped.append(BlockSkip(bid, c.item_id, Action.PROMOTE, reason))
                continue
            warm.append((c.item_id, bid))
    device_free, host_free = cache.num_free(Tier.DEVICE), cache.num_free(Tier.HOST)
    deficit = need_blocks + len(warm) - device_free
    spill: list[int] = []
    if deficit > 0:
        spill = _victim_order(cache, others, Tier.DEVICE, Action.DEMOTE,
                              report.skipped, keep)[:deficit]
    if spill:
        short = len(spill) - len(warm) - host_free
        if warm:  # swaps alternate through the free slots of both tiers: keep a chunk
            short = max(short, min(_SWAP_BUFFER, len(spill), len(warm))
                        - host_free - device_free)
        if short > 0:
            archivable = [c for c in others if c.due is None or c.due > horizon]
            free = _victim_order(cache, archivable, Tier.HOST, Action.ARCHIVE, [],
                                 keep)[:short]
            if free:
                cache.remove_blocks(free)
                report.removed.extend(free)
    wi = si = 0
    while wi < len(warm) or si < len(spill):
        k = min(len(warm) - wi, cache.num_free(Tier.DEVICE))
        if k:
            report.warmed.extend(cache.warm_blocks([b for _, b in warm[wi:wi + k]]) or ())
            wi += k
        n = min(len(spill) - si, cache.num_free(Tier.HOST))
        if n:
            report.spilled.extend(cache.spill_blocks(spill[si:si + n]) or ())
            si += n
        if not k and not n:
            break
    report.skipped.extend(BlockSkip(bid, item_id, Action.PROMOTE, "tier_full")
                          for item_id, bid in warm[wi:])


class Lookahead:
    """Segments, look-ahead and prefetch of a
    :class:`~contextkit.loop.tiers.ContextTierManager` (see the module doc).

    Args:
        items: the manager's items (read and changed under ``lock``).
        config: the manager's settings (``lookahead_weight``, ``protect_horizon``).
        clock: the manager's wall clock (a segment's last access).
        lock: the manager's item lock; never held while taking the cache lock.
        cycle_lock: the manager's cycle lock: a prefetch runs one at a time with cycles.
    """

    def __init__(self, items: ItemStore, config: TierManagerConfig, clock: Callable[[], float],
                 lock: threading.Lock, cycle_lock: threading.Lock) -> None:
        self.items = items
        self.config = config
        self.clock = clock
        self._lock = lock
        self._cycle_lock = cycle_lock
        self._lookahead: dict[str, int | None] = {}
        self._agent_items: dict[str, list[str]] = {}  # item ids of an agent's latest call
        self._agent_tenant: dict[str, str] = {}  # from set_lookahead(tenants=)
        self._volatile: set[str] = set()  # segments that replaced the agent's previous ones
        self._prefetch_counts: Counter[str] = Counter()  # since the last cycle

    # ------------------------------------------------------------------ segments
    def register_segments(self, agent: str, tenant: str,
                          segments: Sequence[tuple[str, float, Sequence[int]]]) -> list[str]:
        """See :meth:`ContextTierManager.register_segments
        <contextkit.loop.tiers.ContextTierManager.register_segments>`."""
        validate_name(agent, "agent")
        validate_tenant(tenant)
        parsed = []
        for layer, importance, block_ids in segments:
            if not 0.0 <= importance <= 1.0:
                raise ValueError(f"importance of segment {layer!r} must be within [0, 1], "
                                 f"got {importance}")
            parsed.append((str(layer), float(importance), [int(b) for b in block_ids]))
        items = self.items
        metadata = None if items.cache is None else items.cache.metadata
        now = self.clock()
        with self._lock:
            items.reconcile()
            t, owner, row_agents = items.table, items.owner, items.row_agents
            touched: dict[str, None] = {}  # an ordered set
            new: set[str] = set()
            for layer, importance, block_ids in parsed:
                unowned: dict[int, None] = {}
                for bid in block_ids:
                    row = owner.get(bid)
                    if row is not None:
                        touched.setdefault(t.ids[row] or "", None)
                    elif metadata is None or bid in metadata:
                        unowned.setdefault(bid, None)
                if not unowned:
                    continue
                item_id = segment_id(tenant, unowned)
                row = t.row_of.get(item_id)
                if row is None:
                    items.add(item_id, ItemKind.SEGMENT, ContextTier.PROMPT, tenant,
                              tuple(unowned), importance, SegmentInfo(layer), now)
                    new.add(item_id)
                else:  # the same blocks again (after a failed call): adopt them
                    t.blocks[row] += tuple(unowned)
                    for bid in unowned:
                        owner[bid] = row
                touched.setdefault(item_id, None)
            for item_id in touched:
                row = t.row_of[item_id]
                if item_id not in new:
                    t.hits[row] += 1
                    t.last_access[row] = max(t.last_access[row], now)
                self._set_agents_locked(row, row_agents.get(row, frozenset()) | {agent})
            before = [t.payload[t.row_of[i]] for i in self._agent_items.get(agent, ())
                      if i in t.row_of]
            seen = {info.layer for info in before if isinstance(info, SegmentInfo)}
            self._volatile.update(i for i in new if getattr(t.payload[t.row_of[i]], "layer",
                                                            None) in seen)
            if len(self._volatile) > 2 * len(t.row_of) + 64:
                self._volatile.intersection_update(t.row_of)
            for item_id in self._agent_items.get(agent, ()):
                row = t.row_of.get(item_id)
                if item_id not in touched and row is not None:
                    self._set_agents_locked(row, row_agents.get(row, frozenset()) - {agent})
            self._agent_items[agent] = list(touched)
        return list(touched)

    def _set_agents_locked(self, row: int, agents: frozenset[str]) -> None:
        if agents:
            self.items.row_agents[row] = agents
        else:
            self.items.row_agents.pop(row, None)
        info = self.items.table.payload[row]
        if isinstance(info, SegmentInfo) and info.agents != agents:
            self.items.table.payload[row] = SegmentInfo(info.layer, agents)

    def agent_items(self, agent: str) -> list[str]:
        """Ids of the items of ``agent``'s latest registered call, in prompt order."""
        with self._lock:
            return [i for i in self._agent_items.get(agent, ())
                    if i in self.items.table.row_of]

    # ------------------------------------------------------------------ look-ahead
    def set_lookahead(self, due: Mapping[str, int | None], *,
                      tenants: Mapping[str, str] | None = None) -> None:
        """See :meth:`ContextTierManager.set_lookahead
        <contextkit.loop.tiers.ContextTierManager.set_lookahead>`."""
        clean: dict[str, int | None] = {}
        for agent, steps in due.items():
            validate_name(agent, "agent")
            if steps is not None:
                if isinstance(steps, bool):
                    raise ValueError(f"steps of agent {agent!r} must be an integer >= 0 or "
                                     f"None, got {steps!r}")
                try:
                    steps = operator.index(steps)
                except TypeError:
                    raise ValueError(f"steps of agent {agent!r} must be an integer >= 0 or "
                                     f"None, got {steps!r}") from None
                if steps < 0:
                    raise ValueError(f"steps of agent {agent!r} must be >= 0, got {steps}")
            clean[agent] = steps
        homes = {a: validate_tenant(t) for a, t in (tenants or {}).items()}
        with self._lock:
            self._lookahead = clean
            self._agent_tenant.update(homes)

    def lookahead(self) -> dict[str, int | None]:
        """The look-ahead set by :meth:`set_lookahead` (a copy)."""
        with self._lock:
            return dict(self._lookahead)

    def due_term_locked(self, n: int) -> np.ndarray | None:
        """``lookahead_weight / steps`` per row (of ``n``) for items of a due agent, else 0;
        ``None`` when no agent is due (hold the lock)."""
        weight = self.config.lookahead_weight
        if not self._lookahead or weight == 0:
            return None
        row_of = self.items.table.row_of
        inverse = np.zeros(n)
        for agent, steps in self._lookahead.items():
            if steps is None:
                continue
            rows = [r for i in self._agent_items.get(agent, ())
                    if (r := row_of.get(i)) is not None]
            if rows:
                idx = np.array(rows, dtype=np.int64)
                inverse[idx] = np.maximum(inverse[idx], 1.0 / max(steps, 1))
        return inverse * weight

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, agent: str, need_blocks: int, blocks: Sequence[int]) -> PrefetchReport:
        """See :meth:`ContextTierManager.prefetch
        <contextkit.loop.tiers.ContextTierManager.prefetch>` (which checks the arguments
        and that the manager is open)."""
        report = PrefetchReport(agent, started_at=time.perf_counter())
        cache = self.items.cache
        if cache is not None:
            with self._cycle_lock:
                with self._lock:
                    self.items.reconcile()
                    mine, others = self._candidates_locked(agent)
                    if blocks:  # exactly what the turn reuses: the rest of the agent's
                        # last call (its volatile tail) will not be read again
                        others += [c._replace(due=None) for c in mine]
                        mine = []
                with cache.locked():
                    before = cache.stats.bytes_moved
                    _plan_and_move(cache, mine, others, need_blocks,
                                   self.config.protect_horizon, report, blocks)
                    report.bytes_moved = cache.stats.bytes_moved - before
                with self._lock:
                    self.items.forget_blocks(report.removed)
                    self._prefetch_counts.update(
                        calls=1, warmed=len(report.warmed), spilled=len(report.spilled),
                        removed=len(report.removed))
        report.finished_at = time.perf_counter()
        report.duration_s = report.finished_at - report.started_at
        logger.debug("prefetch %s: warmed %d, spilled %d, removed %d blocks, skipped %d, "
                     "%.2f ms", agent, len(report.warmed), len(report.spilled),
                     len(report.removed), len(report.skipped), report.duration_s * 1e3)
        return report

    def _candidates_locked(self, agent: str) -> tuple[list[_Candidate], list[_Candidate]]:
        """The agent's items in prompt order, and every other item with blocks."""
        t, lookahead, row_agents = self.items.table, self._lookahead, self.items.row_agents
        reservation = KINDS.index(ItemKind.RESERVATION)
        mine_ids = self._agent_items.get(agent, [])
        mine_rows = {t.row_of[i] for i in mine_ids if i in t.row_of}
        # agents not seen yet may reuse any block of their tenant (its shared layers)
        unseen: dict[str, int] = {}
        for name, due in lookahead.items():
            home = self._agent_tenant.get(name)
            if due is not None and home is not None and name not in self._agent_items:
                unseen[home] = min(due, unseen.get(home, due))
        by_row: dict[int, _Candidate] = {}
        for row in np.flatnonzero(t.alive[: t.size]).tolist():
            blocks = t.blocks[row]
            if not blocks or t.kind[row] == reservation:  # the reserver holds those
                continue
            agents = row_agents.get(row, frozenset())
            steps = [s for a in agents if (s := lookahead.get(a)) is not None]
            if t.tenant[row] in unseen:
                steps.append(unseen[t.tenant[row]])
            if t.ids[row] in self._volatile:
                steps = []  # changes before it is read again: as good as never due
            info = t.payload[row]
            by_row[row] = _Candidate(
                t.ids[row] or "", blocks, info.layer if isinstance(info, SegmentInfo) else None,
                float(t.relevance[row]), min(steps) if steps else None)
        mine = [by_row[t.row_of[i]] for i in mine_ids
                if i in t.row_of and t.row_of[i] in by_row]
        others = [c for row, c in by_row.items()
                  if row not in mine_rows and agent not in row_agents.get(row, ())]
        return mine, others

    def take_prefetch_counts_locked(self) -> dict[str, int]:
        """The prefetch counts since the last call (hold the lock; a cycle takes them)."""
        counts = dict(self._prefetch_counts)
        self._prefetch_counts.clear()
        return counts
