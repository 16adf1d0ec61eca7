"""The tier manager's OODA phases over its item store, run by
:meth:`ContextTierManager.run_once <contextkit.loop.tiers.ContextTierManager.run_once>`
under the manager's lock: Observe's intake (:func:`ingest`), Orient's scores
(:func:`orient`) and Decide's tier changes (:func:`decide`). Act is the bridge's
(:mod:`contextkit.loop.bridge`)."""

from __future__ import annotations

import hashlib

import numpy as np

from contextkit.loop.table import ItemStore, ItemTable
from contextkit.loop.tier_types import (
    KINDS,
    Action,
    ContextTier,
    Decision,
    ItemKind,
    Thresholds,
    TierManagerConfig,
)
from contextkit.prompt.markup import SpilledLine

__all__: list[str] = []


def spilled_line_id(line: SpilledLine) -> str:
    """Stable item id of a spilled line (the same line spilled again is the same item)."""
    digest = hashlib.sha256(f"{line.layer}\0{line.text}".encode()).hexdigest()[:16]
    return f"line:{line.layer}:{digest}"


def ingest(items: ItemStore, lines: list[SpilledLine], blocks: tuple[np.ndarray, np.ndarray],
           spilled_line_tier: ContextTier) -> int:
    """Fold observations into the table: spilled lines become items (or accesses of the
    same line's item), attended blocks accesses of their owners. Returns the accesses
    observed.

    Args:
        items: the manager's items.
        lines: the spilled lines drained this cycle.
        blocks: ``(block ids, last_attended)`` of every cached block.
        spilled_line_tier: the tier a new spilled line's item starts in.
    """
    t = items.table
    accesses = 0
    for line in lines:
        item_id = spilled_line_id(line)
        row = t.row_of.get(item_id)
        if row is None:
            items.add(item_id, ItemKind.SPILLED_LINE, spilled_line_tier, "default", (),
                      min(1.0, max(0.0, line.importance)), line, line.spilled_at)
        else:  # spilled again: in demand
            t.hits[row] += 1
            t.last_access[row] = max(t.last_access[row], line.spilled_at)
            t.relevance[row] = max(t.relevance[row], min(1.0, line.importance))
            accesses += 1
    ids, attended = blocks
    owner = items.owner
    if not owner:
        return accesses
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
    if int(np.count_nonzero(mine)) < len(owner) and items.cache is not None:
        # Owned blocks missing from the snapshot: freed by someone else, or added
        # after it; only the ones gone from the cache now are forgotten.
        present = set(ids[mine].tolist())
        gone = [b for b in owner if b not in present and b not in items.cache.metadata]
        items.forget_blocks(gone)
    return accesses


def orient(t: ItemTable, cfg: TierManagerConfig, now: float, elapsed: float,
           due: np.ndarray | None) -> None:
    """Score every row: weighted frequency, recency, relevance, and ``due`` (the look-ahead's
    term, :meth:`~contextkit.loop.lookahead.Lookahead.due_term_locked`) when given.

    Args:
        t: the item table (its ``freq``, ``hits`` and ``score`` columns are updated).
        cfg: the weights and half-lives.
        now: the cycle's wall-clock time; elapsed: seconds since the previous cycle.
        due: the look-ahead's term per row, or ``None``.
    """
    n = t.size
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
    if due is not None:  # the agents due next keep their items up
        score += due


def decide(t: ItemTable, cfg: TierManagerConfig,
           th: Thresholds) -> tuple[list[Decision], dict[str, int]]:
    """Promote / demote / archive lists, applied to the table's tiers.

    Returns:
        The decisions, and how many of each action (by :class:`Action` value) the
        thresholds asked for.
    """
    n = t.size
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
    actions = {a.value: int(n) for a, n in zip(Action, counts, strict=True) if n}
    if rows.size == 0:
        return [], actions
    from_tier = tier[rows].copy()
    to_tier = np.where(codes == 0, from_tier - 1, from_tier + 1).astype(np.int8)
    tier[rows] = to_tier
    by_code = (Action.PROMOTE, Action.DEMOTE, Action.ARCHIVE)
    tiers = tuple(ContextTier)
    ids, kinds, blocks, tenants, payloads = t.ids, t.kind, t.blocks, t.tenant, t.payload
    return [
        Decision(ids[r] or "", KINDS[k], by_code[c], tiers[f], tiers[to], s, lim,
                 blocks[r], tenants[r], payloads[r])
        for r, k, c, f, to, s, lim in zip(
            rows.tolist(), kinds[rows].tolist(), codes.tolist(), from_tier.tolist(),
            to_tier.tolist(), score[rows].tolist(), limits.tolist(), strict=True)
    ], actions
