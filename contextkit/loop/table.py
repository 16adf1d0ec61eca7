"""The tier manager's columnar item store: numpy columns for scoring, lists for the rest."""

from __future__ import annotations

import numpy as np

from contextkit.loop.tier_types import _KINDS, ContextTier, TierItem

__all__: list[str] = []


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
