"""Counters a worker's background threads record between engine steps, published to
the API server's /metrics without waiting for the next step.

vLLM carries a connector's stats only with an engine step, so what the shared tier's
upload thread counted after a turn would reach /metrics at the server's next request.
The worker keeps those counters in a :class:`Ledger` instead: running totals in a small
JSON file, replaced atomically after each change and named by vLLM's ``instance_id``
(the same in the API server and the engine) and the engine's index. A
:class:`LedgerReader` in the API server
(:class:`~integrations.vllm.metrics.ContextKitPromMetrics`) polls those files and
records what changed, so an upload shows on /metrics within a poll.

The files live in a per-user directory (mode 0700) under the system's temporary
directory and are removed when the worker stops.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

__all__ = ["Ledger", "LedgerReader", "default_ledger_dir", "ledger_path"]

logger = logging.getLogger(__name__)


def default_ledger_dir() -> Path:
    """``$TMPDIR/contextkit-ledgers-<uid>``: private to the user running vLLM."""
    return Path(tempfile.gettempdir()) / f"contextkit-ledgers-{os.getuid()}"


def _private_dir(directory: Path) -> bool:
    """Create ``directory`` (0700) if needed; False when it is not this user's own."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = directory.stat()
    except OSError as exc:
        logger.warning("no metrics ledger in %s (%s): shared-tier uploads reach /metrics "
                       "with the next engine step", directory, exc)
        return False
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        logger.warning("no metrics ledger: %s is not private to this user; remove it, or "
                       "set TMPDIR elsewhere (uploads reach /metrics with the next engine "
                       "step)", directory)
        return False
    return True


def _file_prefix(instance_id: str) -> str:
    """The start of a server's ledger file names: its ``instance_id``, made safe."""
    return (re.sub(r"[^A-Za-z0-9_.-]", "_", instance_id) or "default") + "-engine"


def ledger_path(instance_id: str, engine: int, directory: Path | None = None) -> Path:
    """The ledger file of one engine of one vLLM server."""
    return (directory or default_ledger_dir()) / f"{_file_prefix(instance_id)}{int(engine)}.json"


def _empty() -> dict[str, Any]:
    return {"counters": {}, "by_layer": {}, "gauges": {}}


class Ledger:
    """Running totals of counters and gauges, published to ``path`` by :meth:`publish`.
    ``path=None`` keeps them in memory only.

    Args:
        path: the file (see :func:`ledger_path`), or None.
        counters: the counter names it takes (:data:`integrations.vllm.metrics.COUNTERS`).
        gauges: the gauge names it takes.

    Same ``count`` / ``set_gauge`` calls as :class:`~integrations.vllm.metrics.StatsRecorder`;
    thread-safe."""

    def __init__(self, path: Path | None, counters: Collection[str],
                 gauges: Collection[str]) -> None:
        self.path = path if path is not None and _private_dir(path.parent) else None
        self.counters, self.gauges = frozenset(counters), frozenset(gauges)
        self._lock = threading.Lock()
        self._data = _empty()
        self._dirty = False

    def count(self, name: str, n: float = 1) -> None:
        if name not in self.counters:
            raise KeyError(f"unknown counter {name!r}; known: {sorted(self.counters)}")
        if n:
            with self._lock:
                counters = self._data["counters"]
                counters[name] = counters.get(name, 0) + n
                self._dirty = True

    def set_gauge(self, name: str, value: float) -> None:
        if name not in self.gauges:
            raise KeyError(f"unknown gauge {name!r}; known: {sorted(self.gauges)}")
        with self._lock:
            self._data["gauges"][name] = float(value)
            self._dirty = True

    def totals(self) -> dict[str, Any]:
        """The totals so far (``{"counters": ..., "gauges": ...}``)."""
        with self._lock:
            return {"counters": dict(self._data["counters"]),
                    "gauges": dict(self._data["gauges"])}

    def publish(self) -> None:
        """Write the totals if they changed since the last call (never raises)."""
        with self._lock:
            if self.path is None or not self._dirty:
                return
            self._dirty = False
            text = json.dumps({"counters": self._data["counters"],
                               "gauges": self._data["gauges"]})
            tmp = self.path.with_name(f".{self.path.name}.{threading.get_ident()}")
            try:
                tmp.write_text(text)
                os.replace(tmp, self.path)
            except OSError as exc:
                logger.warning("metrics ledger %s not written: %s", self.path, exc)

    def close(self) -> None:
        """Remove the file (the worker stops: nothing is left behind)."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)


class LedgerReader:
    """The API server's side: what each engine's ledger gained since the last read."""

    def __init__(self, instance_id: str, directory: Path | None = None) -> None:
        self.directory = directory or default_ledger_dir()
        self._prefix = _file_prefix(instance_id)
        self._seen: dict[int, Mapping[str, Any]] = {}

    def changes(self) -> dict[int, dict[str, Any]]:
        """Per engine: counter increments and changed gauges since the last call, in
        the stats-data format :meth:`ContextKitPromMetrics.observe` takes."""
        out: dict[int, dict[str, Any]] = {}
        for path in self.directory.glob(f"{self._prefix}*.json"):
            try:
                engine = int(path.stem[len(self._prefix):])
                now = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # replaced or removed while read: the next poll sees it
            if not isinstance(now, Mapping):
                continue
            data = _difference(self._seen.get(engine), now)
            self._seen[engine] = now
            if data["counters"] or data["gauges"]:
                out[engine] = data
        return out


def _difference(before: Mapping[str, Any] | None, now: Mapping[str, Any]) -> dict[str, Any]:
    before = before or {}
    was_c, was_g = before.get("counters") or {}, before.get("gauges") or {}
    data = _empty()
    for name, n in (now.get("counters") or {}).items():
        if isinstance(n, int | float):
            delta = n - was_c.get(name, 0)
            if delta < 0:  # a new worker under the same name: its totals restart
                delta = n
            if delta > 0:
                data["counters"][name] = delta
    for name, x in (now.get("gauges") or {}).items():
        if isinstance(x, int | float) and was_g.get(name) != x:
            data["gauges"][name] = x
    return data
