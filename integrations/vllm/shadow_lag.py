"""Shadow accounting of the connector's store: bytes shadowed and the shadow lag.

:class:`ShadowAccounting` keeps, under its own lock (it never waits for a save), the
keys stored but not yet in a committed manifest, oldest first, and the bytes shadows
wrote since they were last taken. :class:`~integrations.vllm.store.ConnectorStore`
tells it what each save stored and evicted, and shows it each pool's shadow; the
store's metrics read it back. Free of vLLM imports.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence

from integrations.vllm.pools import Pool
from shadow import CacheShadow

__all__ = ["ShadowAccounting"]


class ShadowAccounting:
    """Shadow bytes written and the age of the oldest stored block not shadowed yet."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._unshadowed: dict[bytes, float] = {}  # key -> monotonic time stored, oldest first
        self._bytes = 0

    def saved(self, stored: Sequence[bytes], removed: Sequence[bytes], at: float) -> None:
        """Record a save: ``stored`` keys wait for a shadow since ``at``; ``removed``
        keys (evicted) no longer wait."""
        with self._lock:
            for key in stored:
                self._unshadowed[key] = at
            for key in removed:
                self._unshadowed.pop(key, None)

    def note(self, pool: Pool, shadow: CacheShadow) -> None:
        """Count a pool's last shadow result once, and clear the keys its manifest holds."""
        result, manifest = shadow.last_result, shadow.manifest
        with self._lock:
            if result is not None and result is not pool.counted_result:
                pool.counted_result = result
                self._bytes += result.bytes_written + result.manifest_bytes
            if manifest is not None and manifest is not pool.seen_manifest:
                pool.seen_manifest = manifest
                if self._unshadowed:
                    for record in manifest.blocks:
                        if record.key is not None:
                            self._unshadowed.pop(bytes.fromhex(record.key), None)

    def take(self, pools: Iterable[Pool], now: float | None = None) -> tuple[int, float]:
        """Shadow bytes written since the last call, and the shadow lag in seconds.

        The lag is the age of the oldest stored block that no committed manifest holds
        yet (0 when none is pending or no pool of ``pools`` has a shadow). Each
        shadowed pool's last result is counted first (see :meth:`note`).
        """
        shadowed = False
        for pool in pools:
            shadow = pool.shadow
            if shadow is not None:
                shadowed = True
                self.note(pool, shadow)
        now = time.monotonic() if now is None else now
        with self._lock:
            nbytes, self._bytes = self._bytes, 0
            if not shadowed or not self._unshadowed:
                return nbytes, 0.0
            oldest = next(iter(self._unshadowed.values()))
        return nbytes, max(0.0, now - oldest)
