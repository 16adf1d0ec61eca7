"""The connector's side of the live shared tier (:mod:`shadow.shared`), free of vLLM imports.

Scheduler side, :class:`SharedLookups`: when the DDR tier's prefix of a prompt ends
before the prompt does, the chunks that follow are looked up in the shared tier (HEADs
in doubling parallel batches, on a helper thread), and beside them the spans the chunk
index lacks; vLLM is told "not yet" (``None``) until the answers are in, or the
deadline passes (then the DDR hit stands and the rest is computed).

Worker side, :class:`SharedWriter`:

- before a load, :meth:`SharedWriter.bring_in` GETs the load's chunks in parallel,
  verifies each (MAC, name, tenant, model) and imports their blocks into the
  DDR tier; what is refused, missing or late is recomputed by vLLM
  (``kv_load_failure_policy = "recompute"``);
- after a save, :meth:`SharedWriter.saved` queues the chunks the save completed; a
  writer thread exports them from the DDR tier and uploads each unless the tier holds
  it (write-behind: a bounded queue, dropped uploads counted, the lag measured);
- the same thread renews this writer's lease (the chunks whose blocks it holds, which
  collection keeps) and, with ``shared_gc_interval_s``, collects the tier.

The writer's counters go to a :class:`~integrations.vllm.ledger.Ledger`, published as
they change: its uploads finish after the step that saved them, and /metrics shows
them without waiting for the server's next request.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from integrations.vllm.ledger import Ledger
from integrations.vllm.metrics import COUNTERS, GAUGES, StatsRecorder
from shadow.shared.objects import SpanRecord
from shadow.shared.retention import collect
from shadow.shared.tier import FoundSpan, SharedTier, default_writer_id

if TYPE_CHECKING:
    from gpu_cache import CacheIdentity
    from integrations.vllm.chunk_planning import ChunkLoad, SpanShare
    from integrations.vllm.config import ConnectorConfig
    from integrations.vllm.planning import LoadSpec, SaveSpec
    from integrations.vllm.store import ConnectorStore

__all__ = ["SharedLookups", "SharedWriter", "open_shared_tier", "record_counters"]

#: Called with the keys a chunk import brought in and the keys it evicted for them.
Imported = Callable[[list[bytes], list[bytes]], None]

logger = logging.getLogger(__name__)

#: The shared tier's counters, as the connector's metrics name them.
_COUNTER_NAMES = {"heads": "shared_heads", "gets": "shared_gets", "puts": "shared_puts",
                  "bytes_down": "shared_bytes_down", "bytes_up": "shared_bytes_up",
                  "deduplicated": "shared_deduplicated", "errors": "shared_errors",
                  "deadline_misses": "shared_deadline_misses"}


def open_shared_tier(config: ConnectorConfig, identity: CacheIdentity, role: str
                     ) -> SharedTier:
    """The shared tier as one role of the connector sees it: its writer id names the
    session, the role (``lookups``, ``writer``) and the host."""
    return SharedTier(identity, config.shared_tier(), mac_key=config.shared_tier_key(),
                      writer=f"{config.session_id}-{role}-{default_writer_id()}")


def record_counters(tier: SharedTier, stats: StatsRecorder | Ledger) -> None:
    """Move the tier's counters since the last call into the connector's stats."""
    for name, n in tier.take_counters().items():
        if name.startswith("refused_"):
            stats.count("shared_refused", n)
        elif name in _COUNTER_NAMES:
            stats.count(_COUNTER_NAMES[name], n)


@dataclass(slots=True)
class _Probe:
    first_chunk: int
    future: cf.Future[int]
    started: float
    waited: float | None = None  # seconds until its answer was first seen


@dataclass(slots=True)
class _SpanProbe:
    contents: tuple[bytes, ...]
    future: cf.Future[dict[bytes, FoundSpan]] | None  # None: nothing to look up


class SharedLookups:
    """Scheduler side: asynchronous lookups of a prompt's chunks past the DDR hit."""

    def __init__(self, tier: SharedTier, chunk_blocks: int,
                 stats: StatsRecorder | None = None) -> None:
        self.tier = tier
        self.chunk_blocks = chunk_blocks
        self.stats = stats
        self._probes: dict[str, _Probe] = {}
        self._span_probes: dict[str, _SpanProbe] = {}
        self._exec = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="contextkit-probe")

    def lookup(self, req_id: str, tenant: str, keys: Sequence[bytes], local_end: int
               ) -> int | None:
        """The end block of the prompt's prefix held by the DDR tier (``local_end``)
        and then the shared tier; None while the lookup is in flight.

        ``keys``: the request's keys a load may cover. Only whole chunks count: chunk
        ``j`` is blocks ``j*C .. j*C+C-1``, named by the last one's key.
        """
        c = self.chunk_blocks
        first = local_end // c
        last = len(keys) // c  # chunks first .. last-1 lie within the keys
        if last <= first:
            return local_end
        probe = self._probes.get(req_id)
        if probe is None or probe.first_chunk != first:
            names = [keys[(j + 1) * c - 1] for j in range(first, last)]
            probe = _Probe(first, self._exec.submit(self.tier.probe, tenant, names),
                           time.monotonic())
            self._probes[req_id] = probe
        if not probe.future.done():
            return None
        if probe.waited is None:
            probe.waited = time.monotonic() - probe.started
            if self.stats is not None:
                self.stats.count("shared_lookup_seconds", probe.waited)
        try:
            found = probe.future.result()
        except Exception:
            logger.exception("shared tier lookup of request %s failed", req_id)
            found = 0
        return max(local_end, (first + found) * c)

    def spans(self, req_id: str, tenant: str, contents: Sequence[bytes]
              ) -> dict[bytes, FoundSpan] | None:
        """The span objects the tier holds among ``contents`` (the content keys of the
        request's spans the chunk index lacks), by content key; None while the
        lookup (headers read in parallel, on a helper thread) is in flight. A lookup
        of more contents for the request answers too (the scheduler asks for the
        spans past the DDR hit while the prefix lookup runs; those past the final
        hit are among them)."""
        probe = self._span_probes.get(req_id)
        if probe is None or not set(contents) <= set(probe.contents):
            probe = _SpanProbe(tuple(contents), self._exec.submit(
                self.tier.find_spans, tenant, contents) if contents else None)
            self._span_probes[req_id] = probe
        if not contents or probe.future is None:
            return {}
        if not probe.future.done():
            return None
        try:
            found = probe.future.result()
        except Exception:
            logger.exception("shared tier span lookup of request %s failed", req_id)
            return {}
        return {c: found[c] for c in contents if c in found}

    def looking_up_spans(self, req_id: str) -> bool:
        """Whether a span lookup of the request was begun (and not forgotten)."""
        return req_id in self._span_probes

    def forget(self, req_id: str) -> None:
        """The request was allocated or finished: its next lookup asks again."""
        self._probes.pop(req_id, None)
        self._span_probes.pop(req_id, None)

    def close(self) -> None:
        self._exec.shutdown(wait=False, cancel_futures=True)
        self.tier.close()


@dataclass(slots=True)
class _Upload:
    tenant: str
    keys: list[bytes]
    saved_at: float
    span: SpanRecord | None = None  # a span object's (named by its content key)


class SharedWriter:
    """Worker side: loads from and write-behind uploads to the shared tier.

    Args:
        tier: the shared tier.
        store: the connector's store (export and import of blocks).
        max_pending: uploads queued at most; more are dropped (counted). Default:
            the tier's ``max_pending_bytes`` in chunks of the key format.
        gc_interval_s: collect the tier this often (0: never).
        log_path: append one JSON line per upload (``"shared_upload"``: name, bytes,
            lag) for benchmarks; empty: none.
        on_shared: called (writer thread) with the keys of each chunk the tier holds
            once its upload is done (or found there): the connector's KV events.
        ledger_path: where its counters are published (:func:`~integrations.vllm.
            ledger.ledger_path`); None: kept in memory (``ledger.totals()``).
    """

    def __init__(self, tier: SharedTier, store: ConnectorStore, *, max_pending: int | None = None,
                 gc_interval_s: float = 0.0, log_path: str = "",
                 on_shared: Callable[[list[bytes]], None] | None = None,
                 ledger_path: Path | None = None) -> None:
        self.tier = tier
        self.store = store
        self.ledger = Ledger(ledger_path, COUNTERS, GAUGES)
        self.chunk_blocks = tier.config.chunk_blocks
        chunk_bytes = self.chunk_blocks * store.identity.bytes_per_block
        self.max_pending = (max(1, tier.config.max_pending_bytes // chunk_bytes)
                            if max_pending is None else max_pending)
        self.gc_interval_s = gc_interval_s
        self.on_shared = on_shared
        self._log = Path(log_path) if log_path else None
        self._queue: collections.deque[_Upload] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False
        self._warm: tuple[int, Imported] | None = None
        #: name -> (last key, tenant) of the chunks whose blocks this replica holds
        self._held_chunks: dict[str, tuple[bytes, str]] = {}
        self._held_lock = threading.Lock()  # the loader and the writer threads add to it
        self._next_lease = 0.0
        self._next_gc = time.monotonic() + gc_interval_s if gc_interval_s else float("inf")
        self._thread = threading.Thread(target=self._run, name="contextkit-shared-upload",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ loads
    def bring_in(self, spec: LoadSpec) -> tuple[list[bytes], list[bytes]]:
        """Import the load's shared chunks whose keys it needs and the DDR tier lacks.
        Returns the keys imported (what is missing after it is recomputed) and the keys
        evicted to make room for them. Never raises (vLLM's forward waits on it): a
        failure refuses the chunk there (``shared_refused``), and the rest recomputes."""
        imported: list[bytes] = []
        removed: list[bytes] = []
        try:
            self._bring_in(spec, imported, removed)
        except Exception:
            self.ledger.count("shared_refused")
            logger.exception("shared tier load of request %s failed; its blocks recompute",
                             spec.req_id)
        self._record_soon()
        return imported, removed

    def _bring_in(self, spec: LoadSpec, imported: list[bytes], removed: list[bytes]) -> None:
        if not spec.shared:
            return
        missing = self.store.missing(spec.keys)
        todo = [chunk for chunk in spec.shared if any(k in missing for k in chunk)]
        if not todo:
            return
        got = self.tier.fetch(spec.tenant, [chunk[-1] for chunk in todo])
        for chunk, expect in zip(got, todo, strict=False):
            if chunk.keys != list(expect):
                self.ledger.count("shared_refused")
                logger.error("shared tier object %s holds other blocks than its name says; "
                             "refused", chunk.path)
                break
            held, gone = self.store.import_chunk(chunk, [k for k in expect if k in missing])
            self.ledger.count("shared_imported_blocks", len(held))
            imported += held
            removed += gone
            self._hold(chunk.path, expect[-1], spec.tenant)

    def bring_in_spans(self, load: ChunkLoad) -> tuple[list[bytes], list[bytes]]:
        """Import the blocks of the load's chunks found in the shared tier
        (:attr:`~integrations.vllm.chunk_planning.MovedChunk.shared`) that the DDR tier
        lacks. Returns the keys imported and the keys evicted for them. Never raises: an
        object missing, late or refused (or holding other blocks than the plan's) is
        counted and its blocks stay missing, so the chunk load fails and vLLM recomputes
        the range."""
        imported: list[bytes] = []
        removed: list[bytes] = []
        try:
            todo = [(c, c.shared, missing) for c in load.chunks if c.shared is not None
                    and (missing := self.store.missing(c.source_keys))]
            got = self.tier.fetch_spans(load.tenant, [content for _, content, _ in todo])
        except Exception:
            self.ledger.count("shared_refused")
            logger.exception("shared tier spans of request %s refused; its range "
                             "recomputes", load.req_id)
            todo, got = [], {}
        for chunk, content, missing in todo:
            obj = got.get(content)
            if obj is None:
                continue
            try:
                if (obj.keys != chunk.source_keys or obj.span is None
                        or obj.span.position != chunk.source_position):
                    self.ledger.count("shared_refused")
                    logger.error("shared tier span %s holds other blocks than its lookup "
                                 "found (rewritten since); refused", obj.path)
                    continue
                # import_chunk skips what an earlier chunk of this load brought in
                held, gone = self.store.import_chunk(obj, [k for k in chunk.source_keys
                                                           if k in missing])
                self.ledger.count("shared_imported_blocks", len(held))
                imported += held
                removed += gone
                self._hold(obj.path, chunk.source_keys[-1], load.tenant)
            except Exception:
                self.ledger.count("shared_refused")
                logger.exception("shared tier span of request %s refused; its range "
                                 "recomputes", load.req_id)
        self._record_soon()
        return imported, removed

    def _record_soon(self) -> None:
        try:  # counted here; the writer thread writes the ledger, off the forward's path
            record_counters(self.tier, self.ledger)
        except Exception:
            logger.exception("shared tier counters lost")
        with self._cond:
            self._cond.notify()

    # ------------------------------------------------------------------ start
    def warm(self, max_bytes: int, on_imported: Imported) -> int:
        """Warm the DDR tier from the shared tier: the chunks live replicas lease (what
        their DDR tiers hold), newest lease first, until the store holds ``max_bytes``
        (the startup recovery of a replica that joins or restarts; runs on the writer
        thread, beside serving). ``on_imported`` gets the keys brought in and the keys
        evicted for them. Returns the blocks imported."""
        total = 0
        for path, tenant, last_key in self.tier.leased():
            if self._closed or self.store.held_bytes() >= max_bytes:
                break
            with self._held_lock:
                if path in self._held_chunks:
                    continue
            for chunk in self.tier.fetch(tenant, [last_key]):
                try:
                    keys, removed = self.store.import_chunk(chunk, chunk.keys)
                except Exception:  # one object's failure stops no warm-up
                    self.ledger.count("shared_refused")
                    logger.exception("shared tier object %s refused", chunk.path)
                    continue
                self.ledger.count("shared_imported_blocks", len(keys))
                if keys or removed:
                    on_imported(keys, removed)
                if keys:
                    self._hold(path, last_key, tenant)
                    total += len(keys)
        self._record()
        if total:
            logger.info("warmed the DDR tier with %d blocks from the shared tier", total)
        return total

    def start_warm(self, max_bytes: int, on_imported: Imported) -> None:
        """:meth:`warm` on the writer thread, before the first upload."""
        with self._cond:
            self._warm = (max_bytes, on_imported)
            self._cond.notify()

    # ------------------------------------------------------------------ saves
    def saved(self, spec: SaveSpec, held: set[bytes]) -> None:
        """Queue the chunks ``spec``'s save completed (every block of them held)."""
        c = self.chunk_blocks
        keys = list(spec.lead_keys) + list(spec.keys)
        start = spec.first_block - len(spec.lead_keys)  # a multiple of c
        now = time.monotonic()
        jobs = []
        for j0 in range(0, len(keys) - c + 1, c):
            chunk = keys[j0:j0 + c]
            # completed by this save: its last block is one of the save's
            if start + j0 + c - 1 < spec.first_block or not all(
                    k in held for k in chunk[max(0, len(spec.lead_keys) - j0):]):
                continue
            jobs.append(_Upload(spec.tenant, chunk, now))
        if not jobs:
            return
        with self._cond:
            room = self.max_pending - len(self._queue)
            if room < len(jobs):  # the busy writer thread publishes it after its job
                self.ledger.count("shared_dropped", len(jobs) - max(room, 0))
                jobs = jobs[:max(room, 0)]
            self._queue.extend(jobs)
            self._cond.notify()

    def share(self, spec: SpanShare) -> None:
        """Queue the upload of a registered span as a span object (its blocks read
        from the DDR tier when the writer thread gets to it; dropped, counted, if they
        are gone by then or the queue is full)."""
        job = _Upload(spec.tenant, list(spec.block_keys), time.monotonic(), spec.span)
        with self._cond:
            if len(self._queue) >= self.max_pending:
                self.ledger.count("shared_dropped")
                return
            self._queue.append(job)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue and not self._closed and self._warm is None:
                    self._cond.wait(timeout=self._next_chore())
                if self._closed and not self._queue:
                    return
                warm, self._warm = self._warm, None
                job = self._queue.popleft() if self._queue and warm is None else None
                self._busy = job is not None or warm is not None
            try:
                if warm is not None:
                    self.warm(*warm)
                if job is not None:
                    self._upload(job)
                self._chores()
                self._record()
            except Exception:
                logger.exception("shared tier upload failed")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _next_chore(self) -> float:
        lease = self._next_lease if self._held_chunks else float("inf")
        return max(0.05, min(lease, self._next_gc, time.monotonic() + 60) - time.monotonic())

    def _upload(self, job: _Upload) -> None:
        name = (self.tier.path(job.tenant, job.keys[-1]) if job.span is None
                else self.tier.span_path(job.tenant, job.span.content))
        if job.span is not None and self.tier.holds(name):  # no export for a known span
            self.ledger.count("shared_deduplicated")
            self._hold(name, job.keys[-1], job.tenant)
            return
        chunk = self.store.export_chunk(job.keys, job.tenant, name)
        if chunk is None:  # evicted between its save and now
            self.ledger.count("shared_dropped")
            return
        chunk.span = job.span
        uploaded = self.tier.put(chunk)
        lag = time.monotonic() - job.saved_at
        if job.span is not None:
            self.ledger.count("shared_spans_published", int(uploaded))
        elif self.on_shared is not None and (uploaded or self.tier.holds(name)):
            self.on_shared(job.keys)
        self._hold(name, job.keys[-1], job.tenant)
        self.ledger.set_gauge("shared_lag_seconds", lag)
        if self._log is not None:
            with self._log.open("a") as f:
                f.write(json.dumps({"event": "shared_upload", "name": name,
                                    "uploaded": uploaded, "lag_s": round(lag, 6),
                                    "at": time.time()}) + "\n")

    def _chores(self) -> None:
        now = time.monotonic()
        if self._held_chunks and now >= self._next_lease:
            self._next_lease = now + self.tier.config.lease_s / 3
            held = set(self.store.keys())
            with self._held_lock:
                self._held_chunks = {n: v for n, v in self._held_chunks.items()
                                     if v[0] in held}
                lease = {n: tenant for n, (_, tenant) in self._held_chunks.items()}
            self.tier.write_lease(lease)
        if now >= self._next_gc:
            self._next_gc = now + self.gc_interval_s
            report = collect(self.tier)
            logger.info("shared tier collected: %s", report.as_dict())

    def _hold(self, name: str, last_key: bytes, tenant: str) -> None:
        with self._held_lock:
            self._held_chunks[name] = (last_key, tenant)

    def _record(self) -> None:
        """Move the tier's counters into the ledger and publish it."""
        record_counters(self.tier, self.ledger)
        self.ledger.publish()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued upload is done (tests, shutdown); False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._queue and not self._busy and self._warm is None, timeout)

    def close(self) -> None:
        """Stop the thread and release this writer's lease (a clean stop holds nothing)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=30)
        self.tier.release_lease()
        self.tier.close()
        self.ledger.close()
