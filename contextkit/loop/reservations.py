"""Memory neighborhoods reserved and prefilled between turns (the pipeline's
``reservations=``; see :class:`MemoryReservations`).

After each reply, while the user reads and types, two kinds of background work run on
a :class:`~contextkit.engine.background.BackgroundPrefiller` (foreground requests always
first: a job yields at the next layer boundary when one arrives):

1. *extend*: the KV of the prompt the next turn will start with if its memories do not
   change (the main system message and the whole conversation, the exchange just
   finished included), into the device tier;
2. *reserve*: for the best candidates of ``predict(history)`` (the memory
   neighborhoods the conversation is heading to, predicted from the conversation so
   far and the agent's graph), the same prompt with the memories layer replaced by the
   candidate, computed at the positions the pipeline will emit, TQ4, spilled to the
   host ("DDR") tier and held by a :class:`~memory_graph.GraphBlockReserver`
   reservation (:meth:`~memory_graph.GraphBlockReserver.adopt`).

Before the next turn, :meth:`MemoryReservations.before_turn` stops the background
work; when the turn's memories layer is a reserved candidate's, the reservation is
consumed (its blocks stay cached and the turn reuses them), every other reservation
of the tenant expires (its blocks are freed). With a tier manager on the pipeline,
each live reservation is an item of kind ``RESERVATION`` the OODA cycle sees.

Attach it to a pipeline whose engine is embedded::

    from contextkit import CacheAwareContextPipeline, Engine, MemoryReservations
    from memory_graph import GraphBlockReserver

    engine = Engine.from_pretrained()
    reserver = GraphBlockReserver(engine.cache, engine.count_tokens, graph=graph)
    reservations = MemoryReservations(engine, reserver, predict)  # predict(history)
    pipeline = CacheAwareContextPipeline(engine, reservations=reservations)

``predict(history)`` returns :class:`MemoryCandidate` objects, best first: memories
layers the next turn may use, built from the conversation so far and the agent's own
graph (:meth:`contextkit.workloads.replay.AgentReplay.memory_candidates` is the
replay's). :class:`ReservationStats` counts what happened.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

from contextkit.engine.background import BackgroundPrefiller, PrefillOutcome
from contextkit.engine.types import TokenSpan
from contextkit.prompt.chatml import ChatML
from contextkit.prompt.markup import PromptLine, PromptSection, StructuredPrompt

if TYPE_CHECKING:
    from contextkit.engine.engine import Engine
    from contextkit.loop.tiers import ContextTierManager
    from contextkit.pipeline.hooks import TurnPipeline
    from contextkit.pipeline.reports import BuiltPrompt
    from memory_graph import GraphBlockReserver

__all__ = ["MemoryCandidate", "MemoryReservations", "ReservationStats"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryCandidate:
    """A memories layer the next turn may use.

    Attributes:
        key: its name in reports (e.g. a topic).
        lines: the layer's lines as ``(text, importance)``, exactly as the agent will
            put them into the memories layer (same lines, same tokens).
        hits: the graph's query hits (or nodes) the lines came from.
        score: the prediction's score (higher first).
    """

    key: str
    lines: tuple[tuple[str, float], ...]
    hits: tuple[Any, ...] = ()
    score: float = 0.0

    @property
    def node_ids(self) -> tuple[str, ...]:
        out = []
        for h in self.hits:
            node = getattr(h, "node", h)
            nid = getattr(node, "node_id", None)
            if nid is not None:
                out.append(str(nid))
        return tuple(out)


@dataclass
class ReservationStats:
    """What :class:`MemoryReservations` did (cumulative).

    Attributes:
        made: reservations adopted (prefilled blocks held in DDR).
        hits: turns whose memories layer was a reserved candidate's (consumed).
        misses: turns whose memories layer changed and matched no reservation.
        expired: reservations freed unused.
        extensions: history extensions prefilled; extension_tokens: their tokens.
        reserved_tokens: tokens of the reserved blocks.
        background_cpu_s: CPU seconds of the background jobs (prediction included).
        preempted: prefills a foreground request (or a turn) interrupted.
        cancelled: jobs dropped before they started.
        last_hit_key: the key of the last hit.
    """

    made: int = 0
    hits: int = 0
    misses: int = 0
    expired: int = 0
    extensions: int = 0
    extension_tokens: int = 0
    reserved_tokens: int = 0
    background_cpu_s: float = 0.0
    preempted: int = 0
    cancelled: int = 0
    last_hit_key: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Live:
    reservation_id: str
    tenant: str
    key: str
    text: str  # the memories section text the candidate renders to
    tokens: int
    tiers: Any = None
    item_id: str | None = None
    block_ids: tuple[int, ...] = field(default_factory=tuple)


class MemoryReservations:
    """Reserve and prefill the next turn's likely prompts between turns (the pipeline's
    :class:`~contextkit.pipeline.hooks.TurnHooks`).

    Args:
        engine: the pipeline's engine (its cache holds the blocks).
        reserver: holds the reserved blocks (on ``engine.cache``); expiry frees them.
        predict: ``history -> candidates``, best first, from what the agent has seen
            (never a scripted future).
        max_candidates: candidates prefilled after each reply.
        ttl_s: seconds a reservation lives unused.
        layer: the layer the candidates replace.
        extend_history: also prefill the prompt with unchanged memories.
        prefiller: the background worker (default: one of this engine's own, closed
            by :meth:`close`).
        stop_timeout_s: how long :meth:`before_turn` waits for a stopped job to end.
    """

    def __init__(self, engine: Engine, reserver: GraphBlockReserver,
                 predict: Callable[[Sequence[tuple[str, str]]], Sequence[MemoryCandidate]],
                 *, max_candidates: int = 2, ttl_s: float = 600.0, layer: str = "memories",
                 extend_history: bool = True, prefiller: BackgroundPrefiller | None = None,
                 stop_timeout_s: float = 30.0) -> None:
        if max_candidates < 0 or ttl_s <= 0:
            raise ValueError(f"max_candidates must be >= 0 and ttl_s > 0, got "
                             f"{max_candidates} and {ttl_s}")
        if reserver.cache is not engine.cache:
            raise ValueError("the reserver must hold blocks of the engine's cache: build it "
                             "with GraphBlockReserver(engine.cache, engine.count_tokens)")
        self.engine = engine
        self.reserver = reserver
        self.predict = predict
        self.max_candidates = max_candidates
        self.ttl_s = ttl_s
        self.layer = layer
        self.extend_history = extend_history
        self.stop_timeout_s = stop_timeout_s
        self._own = prefiller is None
        self.prefiller = prefiller if prefiller is not None else BackgroundPrefiller(engine)
        self._lock = threading.Lock()
        self._live: dict[str, _Live] = {}
        self._seen: dict[str, str | None] = {}  # tenant -> memories text of the last reply
        self._stats = ReservationStats()
        self._tl = threading.local()

    # ------------------------------------------------------------------ after a reply
    def after_reply(self, pipeline: TurnPipeline,
                    history: Sequence[tuple[str, str]], *, tenant: str,
                    built: BuiltPrompt) -> list[Future[Any]]:
        """Queue the background work for the next turn (returns its futures).

        ``history`` is the conversation including the exchange just finished.
        """
        with self._lock:
            self._seen[tenant] = built.section_texts.get(self.layer)
        if pipeline.engine is None:
            return []
        turns = list(history)
        futures: list[Future[Any]] = []
        jobs: list[tuple[Callable[..., Any], str]] = []
        if self.extend_history:
            jobs.append((self._extend, "extend"))
        if self.max_candidates:
            jobs.append((self._reserve, "reserve"))
        for fn, label in jobs:
            def job(stop: Callable[[], bool], fn: Callable[..., Any] = fn) -> Any:
                return self._job(fn, pipeline, turns, tenant, built, stop)

            try:
                futures.append(self.prefiller.submit(job, label=label))
            except RuntimeError as exc:  # a closed prefiller: the reply stands regardless
                logger.warning("no background %s after this reply: %s", label, exc)
        return futures

    def _job(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a job, accounting its CPU: this thread's outside the prefills (prediction,
        tokenization) plus the prefills' own (torch's threads included)."""
        self._tl.cpu = 0.0
        t0 = time.thread_time()
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._stats.background_cpu_s += time.thread_time() - t0 + self._tl.cpu

    def _prefill(self, ids: list[int], spans: list[TokenSpan], tenant: str,
                 stop: Callable[[], bool], *, reserve: bool) -> PrefillOutcome:
        t0 = time.thread_time()
        out = self.engine.prefill_prefix(ids, tenant=tenant, spans=spans, to_host=reserve,
                                         hold=reserve, should_stop=stop)
        self._tl.cpu += out.cpu_s - (time.thread_time() - t0)
        with self._lock:
            self._stats.preempted += int(out.preempted)
        return out

    def _cut(self, pipeline: TurnPipeline, history: Sequence[tuple[str, str]],
             tenant: str, built: BuiltPrompt) -> tuple[list[int], list[TokenSpan]]:
        """The next turn's prompt up to where it will differ (the trailing message or,
        without one, the next user message), with its spans."""
        ids, spans, _ = pipeline.assemble(None, history, tenant=tenant, built=built)
        if built.trailing:
            cut = spans[built.num_spans(built.main) + len(history)].start - \
                len(self.engine.encode(ChatML.open("system")))
        else:
            cut = len(ids) - len(self.engine.encode(ChatML.open("assistant")))
        kept = [replace(s, end=min(s.end, cut)) for s in spans if s.start < cut]
        return ids[:cut], kept

    def _extend(self, pipeline: TurnPipeline, history: Sequence[tuple[str, str]],
                tenant: str, built: BuiltPrompt, stop: Callable[[], bool]) -> PrefillOutcome | None:
        if stop():
            return None
        ids, spans = self._cut(pipeline, history, tenant, built)
        out = self._prefill(ids, spans, tenant, stop, reserve=False)
        with self._lock:
            self._stats.extensions += 1
            self._stats.extension_tokens += out.computed_tokens
        return out

    def preview_for(self, pipeline: TurnPipeline, built: BuiltPrompt,
                    candidate: MemoryCandidate, *, tenant: str) -> BuiltPrompt:
        """``built`` with the memories layer replaced by ``candidate``, laid out as the
        next :meth:`~contextkit.pipeline.pipeline.CacheAwareContextPipeline.build` would (the
        layer and the trailing layers counted as changed), without side effects."""
        name = pipeline.config.get(self.layer).name
        new = PromptSection(name, tuple(PromptLine(t, i) for t, i in candidate.lines))
        sections = [*built.main, *built.trailing]
        names = [s.layer for s in sections]
        if name in names:
            sections[names.index(name)] = new
        else:  # place it among the main layers by the configured order
            order = {spec.name: i for i, spec in enumerate(pipeline.config)}
            at = next((i for i, s in enumerate(built.main) if order[s.layer] > order[name]),
                      len(built.main))
            sections.insert(at, new)
        changed = [name, *(s.layer for s in built.trailing)]
        return pipeline.preview(StructuredPrompt(tuple(sections)), tenant=tenant,
                                changed=changed)

    def _reserve(self, pipeline: TurnPipeline, history: Sequence[tuple[str, str]],
                 tenant: str, built: BuiltPrompt, stop: Callable[[], bool]) -> list[str]:
        """Predict, then prefill and adopt the best candidates; their reservation ids."""
        if stop():
            return []
        candidates = sorted(self.predict(history), key=lambda c: -c.score)
        current = built.section_texts.get(self.layer)
        made: list[str] = []
        tried: set[str] = set()
        for cand in candidates:
            if len(tried) >= self.max_candidates or stop():
                break
            preview = self.preview_for(pipeline, built, cand, tenant=tenant)
            text = preview.section_texts.get(self.layer)
            if text is None or text == current or text in tried:
                continue
            tried.add(text)
            with self._lock:
                if any(x.tenant == tenant and x.text == text for x in self._live.values()):
                    continue
            ids, spans = self._cut(pipeline, history, tenant, preview)
            out = self._prefill(ids, spans, tenant, stop, reserve=True)
            rid = self._adopt(pipeline, cand, out, tenant, text)
            if rid is not None:
                made.append(rid)
            if out.preempted:
                break
        return made

    def _adopt(self, pipeline: TurnPipeline, cand: MemoryCandidate,
               out: PrefillOutcome, tenant: str, text: str) -> str | None:
        if not out.block_ids:
            return None
        try:
            res = self.reserver.adopt(out.block_ids, tenant=tenant, node_ids=cand.node_ids,
                                      key=cand.key, ttl_s=self.ttl_s)
        except (ValueError, RuntimeError) as exc:  # closed reserver, or blocks gone
            logger.warning("reservation %r not made: %s", cand.key, exc)
            with self.engine.cache.locked():
                held = [b for b in out.block_ids if b in self.engine.cache.metadata]
                self.engine.cache.release(held)
            return None
        live = _Live(res.reservation_id, tenant, cand.key, text,
                     len(res.block_ids) * self.engine.cache.block_size,
                     block_ids=res.block_ids)
        # A pipeline's tier registry that reservations meet is the loop's manager.
        tiers = cast("ContextTierManager | None", pipeline.tiers)
        if tiers is not None:
            try:
                live.item_id, live.tiers = tiers.track_reservation(res), tiers
            except ValueError as exc:  # blocks another item owns already
                logger.info("reservation %r not tracked by the tier manager: %s", cand.key, exc)
        with self._lock:
            self._live[res.reservation_id] = live
            self._stats.made += 1
            self._stats.reserved_tokens += live.tokens
        return res.reservation_id

    # ------------------------------------------------------------------ before a turn
    def before_turn(self, built: BuiltPrompt, *, tenant: str) -> str | None:
        """Stop the background work, then consume the reservation whose candidate is
        ``built``'s memories layer (returns its key) and expire the tenant's others."""
        from memory_graph import ReservationState, UnknownReservationError

        cancelled = self.prefiller.cancel_pending()
        self.prefiller.stop_running()
        if not self.prefiller.wait_idle(self.stop_timeout_s):
            logger.warning("background prefill did not stop within %.1f s", self.stop_timeout_s)
        text = built.section_texts.get(self.layer)
        with self._lock:
            self._stats.cancelled += cancelled
            mine = [x for x in self._live.values() if x.tenant == tenant]
            for x in mine:
                del self._live[x.reservation_id]
            seen = self._seen.get(tenant)
        hit: str | None = None
        expired = 0
        for x in mine:
            self._untrack(x)
            try:
                if hit is None and text is not None and x.text == text and \
                        self.reserver.consume(x.reservation_id, tenant=tenant).state is \
                        ReservationState.WARMED:
                    hit = x.key
                    continue
                if self.reserver.expire_now(x.reservation_id) or self.reserver.get(
                        x.reservation_id).state is ReservationState.EXPIRED:
                    expired += 1
                else:
                    self.reserver.release(x.reservation_id)  # warmed by the tier bridge
            except UnknownReservationError:  # long forgotten: its blocks are long freed
                expired += 1
        with self._lock:
            self._stats.expired += expired
            if hit is not None:
                self._stats.hits += 1
                self._stats.last_hit_key = hit
            elif tenant in self._seen and text != seen:
                self._stats.misses += 1
        return hit

    @staticmethod
    def _untrack(x: _Live) -> None:
        if x.tiers is not None and x.item_id is not None:
            with contextlib.suppress(KeyError):
                x.tiers.remove_item(x.item_id)

    # ------------------------------------------------------------------ the rest
    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """No background job starts while inside (a running one is asked to stop)."""
        with self.prefiller.held():
            yield

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the queued background work is done; False on timeout."""
        return self.prefiller.wait_idle(timeout)

    def live(self, tenant: str | None = None) -> list[str]:
        """Keys of the live reservations (of ``tenant``)."""
        with self._lock:
            return [x.key for x in self._live.values() if tenant in (None, x.tenant)]

    def stats(self) -> ReservationStats:
        with self._lock:
            return replace(self._stats)

    def close(self) -> None:
        """Stop the background work and expire every live reservation (idempotent)."""
        self.prefiller.cancel_pending()
        self.prefiller.stop_running()
        self.prefiller.wait_idle(self.stop_timeout_s)
        if self._own:
            self.prefiller.close()
        with self._lock:
            live = list(self._live.values())
            self._live.clear()
        for x in live:
            self._untrack(x)
            with contextlib.suppress(KeyError, RuntimeError):
                self._stats.expired += self.reserver.expire_now(x.reservation_id)

    def __enter__(self) -> MemoryReservations:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
