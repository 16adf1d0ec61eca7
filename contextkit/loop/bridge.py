"""The Act hook of the tier manager: move an item's KV blocks when its tier changes.

:class:`TierCacheBridge` is re-exported by :mod:`contextkit.loop.tiers`, its public path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from contextkit.loop.tier_types import (
    Action,
    ActReport,
    BlockSkip,
    ContextTier,
    Decision,
    ItemKind,
    ThresholdPolicy,
    Thresholds,
    ThresholdSuggestion,
)
from gpu_cache import BlockStateError, Tier, TQGPUCache, UnknownBlockError

if TYPE_CHECKING:
    from memory_graph import GraphBlockReserver

__all__ = ["TierCacheBridge"]


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

