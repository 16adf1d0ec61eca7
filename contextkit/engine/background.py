"""Background prefill that never delays a request.

While a person reads a reply and types the next message the engine is idle. A
caller (e.g. :class:`contextkit.loop.reservations.MemoryReservations`) can use that time
to compute the K/V of what the next prompt is likely to start with, so the next
request reuses it instead of computing it.

- :func:`prefill_prefix` computes and registers the full blocks of a token prefix
  exactly where a request would put them (same keys, positions, sink), in chunks.
  Each chunk opens its own sequence under the engine lock and closes it again, so
  between chunks the job holds no block and no lock: a request arriving then finds
  the finished chunks already registered and the whole device tier free to use.
- **Foreground first**: :meth:`Engine.generate` and :meth:`Engine.score` announce
  themselves (:func:`~contextkit.engine.runner.foreground`) before they wait for the
  engine lock; a running prefill checks at every layer boundary and gives the lock up
  within one layer's compute, discarding the interrupted chunk. The request's wait is recorded in
  ``Engine.last_foreground_wait_ms``.
- :class:`BackgroundPrefiller` runs such jobs one at a time on a daemon thread, and
  can be held off while a measured request runs.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from contextkit.engine.chunks import ChunkReuse, register_chunks
from contextkit.engine.runner import ForegroundGate, ModelRunner, PrefillPreempted
from contextkit.engine.sequence import close_sequence, open_sequence
from contextkit.engine.types import CacheFullError, TokenSpan
from gpu_cache import Tier, validate_tenant

__all__ = ["BackgroundPrefiller", "GateHolder", "PrefillOutcome", "prefill_prefix"]

logger = logging.getLogger(__name__)


class GateHolder(Protocol):
    """What a :class:`BackgroundPrefiller` watches: an engine or a model runner."""

    @property
    def foreground_gate(self) -> ForegroundGate: ...

T = TypeVar("T")


@dataclass(frozen=True)
class PrefillOutcome:
    """What one :func:`prefill_prefix` did.

    Attributes:
        prompt_tokens: ``len(token_ids)`` given.
        reused_tokens: full blocks' tokens found cached (any tier) when it started.
        computed_tokens: tokens past those now registered by key (``block_ids``'
            tokens; a multiple of the block size).
        block_ids: those blocks, in prompt order (the newly computed ones).
        tier: ``"device"`` or ``"host"``: where ``block_ids`` ended.
        preempted: a foreground request (or ``should_stop``) interrupted it; the
            chunks finished before are registered, the interrupted one discarded.
        cpu_s: process CPU time spent while the job held the engine (torch's worker
            threads included; no foreground request runs meanwhile).
        wall_s: wall time of the whole call.
        reason: ``""``, or why nothing or less was done.
    """

    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    block_ids: tuple[int, ...]
    tier: str
    preempted: bool
    cpu_s: float
    wall_s: float
    reason: str = ""


class _JobLocal(threading.local):
    """Per-thread tally a :class:`BackgroundPrefiller` job reads back."""

    cpu_s: float | None = None
    preempted: bool = False


_job = _JobLocal()


def prefill_prefix(runner: ModelRunner, token_ids: Sequence[int], *, tenant: str,
                   chunk_reuse: ChunkReuse, spans: Sequence[TokenSpan] | None = None,
                   to_host: bool = False,
                   hold: bool = False, should_stop: Callable[[], bool] | None = None,
                   chunk: int = 256) -> PrefillOutcome:
    """Compute and register the K/V of the full blocks of ``token_ids``.

    The blocks get the keys, positions and labels a :meth:`Engine.generate` of a
    prompt starting with ``token_ids`` would give them, so that request reuses them.
    Cached blocks are reused; the rest is computed ``chunk`` tokens at a time, each
    chunk under the engine lock.

    Args:
        runner: the model runner whose cache receives the blocks.
        token_ids: the prefix; a partial last block is left out.
        tenant: whose blocks these are (keys are salted with it).
        chunk_reuse: the engine's chunk reuse (registers the spans' chunks when on).
        spans: semantic labels of token ranges, as for :meth:`Engine.generate`.
        to_host: move the computed blocks to the host tier at the end (they stay on
            the device when it cannot take them; ``reason`` says so).
        hold: leave one reference on each block of ``block_ids`` (protects them from
            eviction); the caller releases it with ``runner.cache.release``.
        should_stop: polled before each chunk and layer; ``True`` stops the job
            (as a waiting foreground request does).
        chunk: tokens per forward step (rounded down to whole blocks, at least one).

    Returns:
        A :class:`PrefillOutcome`; a full device tier is reported in ``reason``.

    Raises:
        ValueError: ``chunk < 1`` or an over-long prefix.
        TokenIdError: a token id outside the vocabulary (a ValueError).
        InvalidNameError: a tenant that breaks :func:`gpu_cache.validate_tenant`.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    validate_tenant(tenant)
    ids = runner.check_token_ids(token_ids)
    cache = runner.cache
    bs = cache.block_size
    step = max(bs, min(chunk, runner.prefill_chunk) // bs * bs)
    n = len(ids) // bs * bs
    if n:
        runner.check_prompt(ids[:n], 0)
    wall0 = time.perf_counter()
    gate = runner.foreground_gate

    def stop() -> bool:
        return gate.waiting > 0 or (should_stop is not None and bool(should_stop()))

    reused: int | None = None
    done = 0  # tokens of ids[:n] registered by this call or found cached
    cpu = 0.0
    preempted = False
    reason = "" if n else f"fewer than {bs} tokens: no full block to prefill"
    while n and done < n:
        if stop():
            preempted = True
            break
        with runner.locked():
            c0 = time.process_time()
            try:
                outcome = _one_chunk(runner, ids, n, step, tenant, spans, stop, chunk_reuse)
            except CacheFullError as exc:
                reason = f"device tier full: {exc}"
                break
            finally:
                cpu += time.process_time() - c0
        cached, reached, preempted = outcome
        reused = cached if reused is None else reused
        done = reached
        if preempted:
            break
    if reused is None:
        reused = 0
        reason = reason or "preempted before it started"
    mine, tier, note = _finish(runner, ids, done, reused, tenant, to_host, hold)
    reason = reason or note
    if _job.cpu_s is not None:
        _job.cpu_s += cpu
    _job.preempted = _job.preempted or preempted
    result = PrefillOutcome(
        prompt_tokens=len(ids), reused_tokens=reused, computed_tokens=len(mine) * bs,
        block_ids=tuple(mine), tier=tier, preempted=preempted, cpu_s=cpu,
        wall_s=time.perf_counter() - wall0, reason=reason)
    logger.debug("prefill_prefix tenant=%s: %s", tenant, result)
    return result


def _one_chunk(runner: ModelRunner, ids: list[int], n: int, step: int, tenant: str,
               spans: Sequence[TokenSpan] | None, stop: Callable[[], bool],
               chunk_reuse: ChunkReuse) -> tuple[int, int, bool]:
    """Open a sequence over the cached part plus up to ``step`` more tokens, compute
    them, close it (registering what was computed). Runner lock held.

    Returns:
        ``(cached, reached, preempted)``: tokens found cached, tokens now registered
        from the start (``cached`` when preempted), whether it was interrupted.
    """
    cache = runner.cache
    bs = cache.block_size
    cached = len(cache.lookup(cache.block_keys(ids[:n], tenant), tenant)) * bs
    end = min(n, cached + step)
    seq = open_sequence(cache, ids[:end], 0, tenant, spans, True)
    cached = written = seq.cached_tokens
    preempted = False
    try:
        if cached < end:
            runner.prefill_into(seq, ids[:end], should_stop=stop)
        written = end
    except PrefillPreempted:
        preempted = True
    finally:
        close_sequence(cache, seq, ids[:end], written)
    if spans and chunk_reuse.enabled and not preempted:
        # what the background computed is found by content too (a reserved memory
        # neighborhood's lines, when the turn's prefix differs from the reservation's)
        register_chunks(cache, ids[:end], spans, seq.keys, tenant, chunk_reuse)
    return cached, written, preempted


def _finish(runner: ModelRunner, ids: list[int], done: int, reused: int, tenant: str,
            to_host: bool, hold: bool) -> tuple[list[int], str, str]:
    """The blocks past ``reused`` now registered; spilled and/or held as asked."""
    cache = runner.cache
    bs = cache.block_size
    with runner.locked(), cache.locked():
        found = cache.lookup(cache.block_keys(ids[:done], tenant), tenant) if done else []
        mine = found[reused // bs:]
        note = ""
        if to_host and mine:
            movable = [b for b in mine if not _stuck(cache, b)]
            if len(movable) < len(mine):
                note = (f"{len(mine) - len(movable)} blocks are pinned or in use and stay on "
                        "the device tier")
            if movable and cache.spill_blocks(movable) is None:
                note = (f"host tier full: {len(movable)} blocks stay on the device tier; "
                        "raise num_host_blocks")
        if hold and mine:
            cache.acquire(mine)
        on_host = bool(mine) and all(cache.metadata.get(b).tier is Tier.HOST for b in mine)
    return mine, "host" if on_host else "device", note


def _stuck(cache: Any, block_id: int) -> bool:
    meta = cache.metadata.get(block_id)
    return bool(meta.pinned or meta.ref_count)


@dataclass
class _Job:
    fn: Callable[[Callable[[], bool]], Any]
    future: Future[Any]
    label: str
    stop: threading.Event


#: Prefillers whose worker may still run: closed at interpreter exit, before daemon
#: threads are torn down (a worker that ran torch aborted the process otherwise).
_LIVE: weakref.WeakSet[BackgroundPrefiller] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for prefiller in list(_LIVE):
        prefiller.close(timeout=5.0)


class BackgroundPrefiller:
    """One daemon thread running background jobs in submission order.

    A job is ``fn(should_stop)``: it polls ``should_stop()`` (true when the job is
    cancelled, the prefiller is held or closed, or a foreground request waits for
    the engine) and returns early when it is. Use as a context manager or call
    :meth:`close`.

    Args:
        engine: the engine (or model runner) the jobs run on (its waiting foreground
            requests stop them); ``None`` for jobs that use no engine.
    """

    def __init__(self, engine: GateHolder | None = None, *,
                 name: str = "contextkit-prefill") -> None:
        self.engine = engine
        self._cv = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._running: _Job | None = None
        self._held = 0
        self._closed = False
        self._done = self._preempted = self._cancelled = self._failed = 0
        self._cpu_s = 0.0
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()
        _LIVE.add(self)

    # ------------------------------------------------------------------ API
    def submit(self, fn: Callable[[Callable[[], bool]], T], *, label: str = "") -> Future[T]:
        """Queue ``fn(should_stop)``; its future gets the return value or exception.

        Raises:
            RuntimeError: the prefiller is closed (build a new one).
        """
        fut: Future[T] = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("this BackgroundPrefiller is closed; build a new one")
            self._queue.append(_Job(fn, fut, label, threading.Event()))
            self._cv.notify_all()
        return fut

    def cancel_pending(self) -> int:
        """Cancel the queued jobs (not the running one); how many were cancelled."""
        with self._cv:
            jobs = list(self._queue)
            self._queue.clear()
            for job in jobs:
                job.future.cancel()
            self._cancelled += len(jobs)
            self._cv.notify_all()
        return len(jobs)

    def stop_running(self) -> None:
        """Ask the running job, if any, to stop (it returns at its next check)."""
        with self._cv:
            if self._running is not None:
                self._running.stop.set()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or running; False if ``timeout`` s passed
        first (queued jobs do not run while held)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and self._running is None,
                                     timeout)

    @contextmanager
    def held(self) -> Iterator[None]:
        """No job starts inside this block; a running one is stopped and waited for
        on entry (so a measured request never overlaps background work)."""
        with self._cv:
            self._held += 1
            if self._running is not None:
                self._running.stop.set()
                if threading.current_thread() is not self._thread:
                    self._cv.wait_for(lambda: self._running is None)
        try:
            yield
        finally:
            with self._cv:
                self._held -= 1
                self._cv.notify_all()

    def stats(self) -> dict[str, float | int]:
        """Cumulative ``jobs_done`` (finished, preempted ones included),
        ``jobs_preempted``, ``jobs_cancelled``, ``jobs_failed`` and ``cpu_s``."""
        with self._cv:
            return {"jobs_done": self._done, "jobs_preempted": self._preempted,
                    "jobs_cancelled": self._cancelled, "jobs_failed": self._failed,
                    "cpu_s": self._cpu_s}

    def close(self, timeout: float | None = 30.0) -> None:
        """Cancel queued jobs, stop the running one and end the thread (idempotent)."""
        with self._cv:
            self._closed = True
            if self._running is not None:
                self._running.stop.set()
            self._cv.notify_all()
        self.cancel_pending()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __enter__(self) -> BackgroundPrefiller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ worker
    def _should_stop(self, job: _Job) -> bool:
        if job.stop.is_set() or self._closed or self._held:
            return True
        return self.engine is not None and self.engine.foreground_gate.waiting > 0

    def _work(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closed or (self._queue and not self._held))
                if self._closed:
                    return
                job = self._queue.popleft()
                if not job.future.set_running_or_notify_cancel():
                    continue
                self._running = job
            self._run(job)

    def _run(self, job: _Job) -> None:
        asked = False

        def should_stop() -> bool:
            nonlocal asked
            asked = asked or self._should_stop(job)
            return asked

        _job.cpu_s, _job.preempted = 0.0, False
        t0 = time.thread_time()
        failed = False
        try:
            job.future.set_result(job.fn(should_stop))
        except BaseException as exc:  # the future carries it to the caller
            failed = True
            logger.warning("background job %r failed: %s", job.label, exc)
            job.future.set_exception(exc)
        # prefill_prefix reports the CPU of torch's threads too; other jobs, this thread's
        cpu = _job.cpu_s if _job.cpu_s else time.thread_time() - t0
        preempted = _job.preempted or asked
        _job.cpu_s = None
        with self._cv:
            self._running = None
            self._done += 1
            self._failed += failed
            self._preempted += bool(preempted and not failed)
            self._cpu_s += cpu
            self._cv.notify_all()
