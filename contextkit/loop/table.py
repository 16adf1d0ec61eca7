"""The tier manager's items: a columnar table (numpy columns for scoring, lists for the
rest) and the :class:`ItemStore` over it (which row owns each cached block, the agents
of each segment row, and how rows come and go), shared by the manager and its
look-ahead."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from contextkit.loop.tier_types import KIND_CODE, KINDS, ContextTier, ItemKind, TierItem
from gpu_cache import TQGPUCache

__all__ = ["ItemStore", "ItemTable"]


class ItemTable:
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
        return TierItem(item_id, KINDS[int(self.kind[row])], ContextTier(int(self.tier[row])),
                        self.tenant[row], self.blocks[row], float(self.relevance[row]),
                        float(self.freq[row] + self.hits[row]), float(self.last_access[row]),
                        float(self.score[row]), self.payload[row])


class ItemStore:
    """The manager's items and the cached blocks they own (hold the manager's lock).

    Args:
        cache: the cache whose blocks items own; ``None``: items own no blocks the
            store can check.

    Attributes:
        table: the items, one row each.
        owner: block id -> the row of the item that owns it (a block has one owner).
        row_agents: row -> the agents whose latest call holds it (rows with agents only).
    """

    def __init__(self, cache: TQGPUCache | None) -> None:
        self.cache = cache
        self.table = ItemTable()
        self.owner: dict[int, int] = {}
        self.row_agents: dict[int, frozenset[str]] = {}

    def add(self, item_id: str, kind: ItemKind, tier: ContextTier, tenant: str,
            block_ids: tuple[int, ...], relevance: float, payload: object,
            last_access: float) -> None:
        """Track a new item that owns ``block_ids``.

        Raises:
            ValueError: a known ``item_id``, a relevance outside ``[0, 1]``, or a block
                another item already owns.
        """
        t = self.table
        if item_id in t.row_of:
            raise ValueError(f"item {item_id!r} is already tracked; remove_item() it first")
        if not 0.0 <= relevance <= 1.0:
            raise ValueError(f"relevance must be within [0, 1], got {relevance}")
        taken = [b for b in block_ids if b in self.owner]
        if taken:
            raise ValueError(f"blocks {taken} already belong to another item; an item's "
                             "blocks are its own")
        row = t.new_row()
        t.row_of[item_id] = row
        t.ids[row], t.tenant[row], t.blocks[row], t.payload[row] = (
            item_id, tenant, block_ids, payload)
        t.alive[row], t.kind[row], t.tier[row] = True, KIND_CODE[kind], int(tier)
        t.relevance[row], t.freq[row], t.hits[row] = relevance, 0.0, 0.0
        t.last_access[row], t.score[row] = last_access, 0.0
        for bid in block_ids:
            self.owner[bid] = row

    def row(self, item_id: str) -> int:
        """The row of a tracked item.

        Raises:
            KeyError: an unknown item.
        """
        try:
            return self.table.row_of[item_id]
        except KeyError:
            raise KeyError(f"item {item_id!r} is not tracked; add_item() it first") from None

    def drop_row(self, row: int) -> None:
        """Stop tracking a row's item; its blocks lose their owner (they stay cached)."""
        t = self.table
        for bid in t.blocks[row]:
            self.owner.pop(bid, None)
        item_id = t.ids[row]
        if item_id is not None:
            del t.row_of[item_id]
        t.ids[row], t.blocks[row], t.payload[row] = None, (), None
        t.alive[row] = False
        t.free_rows.append(row)
        self.row_agents.pop(row, None)

    def forget_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop blocks from their owners; a segment left without blocks is dropped."""
        t = self.table
        emptied = set()
        for bid in block_ids:
            row = self.owner.pop(bid, None)
            if row is not None:
                t.blocks[row] = tuple(b for b in t.blocks[row] if b != bid)
                if not t.blocks[row]:
                    emptied.add(row)
        segment = KINDS.index(ItemKind.SEGMENT)
        for row in emptied:
            if t.alive[row] and t.kind[row] == segment:
                self.drop_row(row)

    def reconcile(self) -> None:
        """Forget owned blocks the cache no longer holds (evicted or freed by others)."""
        if self.cache is None or not self.owner:
            return
        metadata = self.cache.metadata
        gone = [b for b in self.owner if b not in metadata]
        if gone:
            self.forget_blocks(gone)
