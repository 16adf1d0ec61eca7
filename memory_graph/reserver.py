"""GraphBlockReserver: host-tier ("DDR") KV blocks reserved for the nodes a query found.

Sits between :meth:`MemoryGraph.hybrid_query` and the tiered cache:

1. ``reserve(hits)`` estimates each node's tokens with a real tokenizer and
   allocates host blocks (source layer ``memories``). Reserved blocks hold a
   reference in the cache so eviction cannot take them.
2. An optional ``prefill(texts, block_ids)`` callable computes the nodes' KV into
   those blocks on a background thread (speculative prefill).
3. ``warm_reservation(id)`` promotes the blocks to the device tier; the blocks stay
   protected until ``release(id)`` frees them.
4. Reservations that are never warmed expire after ``ttl_s`` (checked lazily on
   every call and by :meth:`GraphBlockReserver.sweep`) and their blocks are freed.

A caller that computes the KV itself, at the positions its prompt will use (a
positional background prefill of keyed blocks), hands the blocks over with
``adopt(block_ids, ...)``; a turn that reuses them ends the reservation with
``consume(id)``, which drops the reservation's references and leaves the blocks
cached as ordinary keyed blocks.

Out of room never raises from the hot path: the result is ``PARTIAL`` or ``EMPTY``
with the reason.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from gpu_cache import BlockAnnotation, RequestBlockManager, Tier, TQGPUCache
from memory_graph._errors import UnknownReservationError
from memory_graph._reservation_types import ACTIVE_STATES as _ACTIVE
from memory_graph._reservation_types import WARMABLE_STATES as _WARMABLE
from memory_graph._reservation_types import (
    NodeBlocks,
    PrefillFn,
    ReservationResult,
    ReservationState,
    ReserverConfig,
    ReserverStats,
)
from memory_graph.graph import DEFAULT_TENANT, MemoryGraph, Node, QueryHit

__all__ = [
    "GraphBlockReserver",
    "NodeBlocks",
    "PrefillFn",
    "ReservationResult",
    "ReservationState",
    "ReserverConfig",
    "ReserverStats",
]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Reservation:
    reservation_id: str
    tenant: str
    spans: list[NodeBlocks]
    texts: list[str]
    estimated_tokens: int
    expires_at: float
    state: ReservationState
    reason: str
    skipped: list[str]
    prefill: Future[None] | None = None
    prefilled: bool = False
    blocks_held: bool = False
    block_ids: list[int] = field(default_factory=list)
    key: str = ""
    node_ids: list[str] | None = None  # adopt(): the nodes named (no per-node spans)


class GraphBlockReserver:
    """Reserve host-tier KV blocks for memory-graph nodes, then warm or release them.

    Args:
        cache: the tiered cache.
        count_tokens: real tokenizer token count of a text.
        graph: used by :meth:`reserve_query` (optional).
        config: ttl and limits.
        prefill: optional callable run on a background thread after each
            reservation with the reserved nodes' texts and blocks.
        clock: monotonic seconds; injectable for tests.
    """

    def __init__(
        self,
        cache: TQGPUCache,
        count_tokens: Callable[[str], int],
        *,
        graph: MemoryGraph | None = None,
        config: ReserverConfig | None = None,
        prefill: PrefillFn | Callable[[list[str], list[list[int]]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache = cache
        self._blocks = RequestBlockManager(cache)
        self.count_tokens = count_tokens
        self.graph = graph
        self.config = config or ReserverConfig()
        self.clock = clock
        self._prefill = prefill
        self._executor: ThreadPoolExecutor | None = (
            ThreadPoolExecutor(self.config.prefill_workers, thread_name_prefix="mg-prefill")
            if prefill is not None else None
        )
        self._lock = threading.RLock()
        self._reservations: dict[str, _Reservation] = {}
        self._expiry: list[tuple[float, str]] = []  # heap; stale entries skipped
        self._closed = False
        self._finished: deque[str] = deque()
        self._n = dict.fromkeys(("reserved", "partial", "empty", "warmed", "released",
                                 "expired", "prefills_done", "prefills_failed",
                                 "bytes_reserved", "bytes_warmed"), 0)

    # ------------------------------------------------------------------ reserve
    def reserve_query(self, query: str, *, tenant: str = DEFAULT_TENANT, k: int = 10,
                      hops: int = 1) -> ReservationResult:
        """:meth:`MemoryGraph.hybrid_query` then :meth:`reserve` of its hits."""
        if self.graph is None:
            raise ValueError("reserve_query needs a graph; pass graph= to GraphBlockReserver")
        return self.reserve(self.graph.hybrid_query(query, k, hops, tenant), tenant=tenant)

    def reserve(self, hits: Sequence[QueryHit | Node], *, tenant: str = DEFAULT_TENANT,
                ttl_s: float | None = None) -> ReservationResult:
        """Allocate host blocks for the nodes of ``hits``, best first.

        Nodes that do not fit are skipped (smaller later ones may still fit); the
        result is ``RESERVED``, ``PARTIAL`` or ``EMPTY`` with the reason.

        Raises:
            ValueError: a hit of another tenant (a broken contract, not "no room").
            RuntimeError: the reserver is closed.
        """
        nodes = [h.node if isinstance(h, QueryHit) else h for h in hits]
        importance = [min(1.0, max(0.0, h.similarity)) if isinstance(h, QueryHit) else 0.5
                      for h in hits]
        for node in nodes:
            if node.tenant != tenant:
                raise ValueError(f"node {node.node_id} belongs to tenant {node.tenant!r}, not "
                                 f"{tenant!r}; reserve each tenant's hits separately")
        # Tokenize outside the locks: it is the slow part.
        tokens = [max(1, int(self.count_tokens(n.text))) for n in nodes]
        self.sweep()
        bs = self.cache.block_size
        cap = self.config.max_blocks_per_reservation
        spans: list[NodeBlocks] = []
        texts: list[str] = []
        skipped: list[str] = []
        used = 0
        with self._lock:
            if self._closed:
                raise RuntimeError("GraphBlockReserver is closed; create a new one")
            for node, num_tokens, imp in zip(nodes, tokens, importance, strict=True):
                need = -(-num_tokens // bs)
                if cap is not None and used + need > cap:
                    skipped.append(node.node_id)
                    continue
                got = self._blocks.allocate(
                    need, tenant, tier=Tier.HOST, source_layer=self.config.source_layer,
                    importance=imp, hold=True, annotations=[
                        BlockAnnotation(token_range=(j * bs, min((j + 1) * bs, num_tokens)),
                                        num_tokens=min(bs, num_tokens - j * bs))
                        for j in range(need)])
                if got is None:
                    skipped.append(node.node_id)
                    continue
                spans.append(NodeBlocks(node.node_id, tuple(got.block_ids), num_tokens))
                texts.append(node.text)
                used += need
            res = self._new_reservation(tenant, spans, texts, skipped, ttl_s, used)
            if res.blocks_held and self._executor is not None:
                self._start_prefill(res)
            return self._snapshot(res)

    def adopt(self, block_ids: Sequence[int], *, tenant: str = DEFAULT_TENANT,
              node_ids: Sequence[str] = (), key: str = "",
              ttl_s: float | None = None) -> ReservationResult:
        """A reservation over blocks that already hold KV (computed and keyed by the caller).

        The caller holds one reference on each block (e.g. a background prefill run with
        ``hold=True``); the reservation takes it over. The result is ``RESERVED`` with
        ``prefilled=True``; expiry and :meth:`release` free the blocks like those of
        :meth:`reserve`, :meth:`consume` leaves them cached. An empty ``block_ids``
        gives an ``EMPTY`` result (nothing held).

        Raises:
            ValueError: a block of another tenant, or one the caller holds no reference
                on (a broken contract: nothing is taken over).
            RuntimeError: the reserver is closed.
        """
        ids = [int(b) for b in block_ids]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate block ids in {ids}; adopt each block once")
        self.sweep()
        bs = self.cache.block_size
        with self._lock:
            if self._closed:
                raise RuntimeError("GraphBlockReserver is closed; create a new one")
            with self.cache.locked():
                for bid in ids:
                    if bid not in self.cache.metadata:
                        raise ValueError(f"block {bid} is not in the cache; adopt only blocks "
                                         "you computed and still hold a reference on")
                    meta = self.cache.metadata.get(bid)
                    if meta.tenant_slug != tenant:
                        raise ValueError(f"block {bid} belongs to tenant {meta.tenant_slug!r}, "
                                         f"not {tenant!r}; adopt each tenant's blocks separately")
                    if meta.ref_count < 1:
                        raise ValueError(f"block {bid} holds no reference; acquire it (or "
                                         "prefill with hold=True) before adopting it")
            if not ids:
                res = self._new_reservation(tenant, [], [], [], ttl_s, 0)
            else:
                res = self._new_reservation(tenant, [NodeBlocks(key, tuple(ids), len(ids) * bs)],
                                            [], [], ttl_s, len(ids))
                res.spans, res.prefilled = [], True  # the blocks are one prompt range
            res.key, res.node_ids = key, [str(n) for n in node_ids]
            return self._snapshot(res)

    def consume(self, reservation_id: str, *, tenant: str | None = None) -> ReservationResult:
        """A hit: drop the reservation's references but keep its blocks cached.

        The blocks become ordinary cache blocks (found by their keys, evicted like any
        other); the state is ``WARMED`` (counted in ``stats().warmed`` once, also after
        :meth:`warm_reservation`). On a
        reservation that is no longer live (consumed, expired, released, empty) it
        changes nothing and returns its snapshot with the reason.

        Raises:
            UnknownReservationError: an id never issued (or of another tenant).
        """
        res = self._settled(reservation_id, tenant)
        with self._lock:
            if res.state not in _ACTIVE or not res.blocks_held:
                detail = f" ({res.reason})" if res.reason else ""
                return self._snapshot(res, f"reservation is {res.state.value}{detail}; "
                                           "nothing to consume")
            with self.cache.locked():
                self.cache.release(res.block_ids)
                self.cache.metadata.touch(res.block_ids, time.time())
            res.blocks_held = False
            if res.state is not ReservationState.WARMED:  # warm_reservation() counted it
                res.state = ReservationState.WARMED
                self._n["warmed"] += 1
                self._n["bytes_warmed"] += len(res.block_ids) * self.cache.bytes_per_block
            self._retire(res)
            return self._snapshot(res)

    def _new_reservation(self, tenant: str, spans: list[NodeBlocks], texts: list[str],
                         skipped: list[str], ttl_s: float | None, used: int) -> _Reservation:
        free = self.cache.num_free(Tier.HOST)
        if not spans:
            state = ReservationState.EMPTY
            reason = ("nothing to reserve" if not skipped else
                      f"host (DDR) tier full: none of {len(skipped)} nodes fit "
                      f"({free} blocks free); release or warm reservations, or grow "
                      "num_host_blocks")
            if skipped and self.config.max_blocks_per_reservation is not None:
                reason += f" (cap {self.config.max_blocks_per_reservation} blocks)"
        elif skipped:
            state = ReservationState.PARTIAL
            reason = (f"host (DDR) tier full: reserved {len(spans)} of "
                      f"{len(spans) + len(skipped)} nodes ({used} blocks; {free} free)")
        else:
            state, reason = ReservationState.RESERVED, ""
        res = _Reservation(
            reservation_id=uuid.uuid4().hex, tenant=tenant, spans=spans, texts=texts,
            estimated_tokens=sum(s.num_tokens for s in spans),
            expires_at=self.clock() + (self.config.ttl_s if ttl_s is None else ttl_s),
            state=state, reason=reason, skipped=skipped, blocks_held=bool(spans),
            block_ids=[b for s in spans for b in s.block_ids],
        )
        self._reservations[res.reservation_id] = res
        key = {ReservationState.EMPTY: "empty", ReservationState.PARTIAL: "partial"}.get(state)
        if key:
            self._n[key] += 1
        if not spans:
            self._retire(res)
        if spans:
            self._n["reserved"] += 1
            self._n["bytes_reserved"] += len(res.block_ids) * self.cache.bytes_per_block
            heapq.heappush(self._expiry, (res.expires_at, res.reservation_id))
        return res

    # ------------------------------------------------------------------ prefill
    def _start_prefill(self, res: _Reservation) -> None:
        assert self._executor is not None and self._prefill is not None
        fn = self._prefill
        texts = list(res.texts)
        blocks = [list(s.block_ids) for s in res.spans]
        fut = self._executor.submit(fn, texts, blocks)
        res.prefill = fut
        rid = res.reservation_id
        fut.add_done_callback(lambda f: self._prefill_done(rid, f))

    def _prefill_done(self, reservation_id: str, fut: Future[None]) -> None:
        with self._lock:
            res = self._reservations.get(reservation_id)
            if fut.cancelled():
                pass
            elif fut.exception() is not None:
                self._n["prefills_failed"] += 1
                logger.warning("speculative prefill of reservation %s failed: %s",
                               reservation_id, fut.exception())
            else:
                self._n["prefills_done"] += 1
                if res is not None:
                    res.prefilled = True
            # a release/expiry that came while the prefill ran left the blocks to us
            if res is not None and res.state not in _ACTIVE and res.blocks_held:
                self._free(res)

    def wait_prefill(self, reservation_id: str, timeout: float | None = None) -> bool:
        """Block until the reservation's background prefill ends; True if it succeeded."""
        with self._lock:
            fut = self._get(reservation_id, None).prefill
        if fut is None:
            return False
        try:
            fut.result(timeout)
        except Exception:  # reported through stats and the log
            return False
        return True

    # ------------------------------------------------------------------ warm / release
    def warm_reservation(self, reservation_id: str, *,
                         tenant: str | None = None) -> ReservationResult:
        """Promote a reservation's blocks to the device tier and mark them ``memories``.

        A background prefill that has not started is cancelled; one that is
        running is waited for (its writes must land before the blocks move).
        An expired, released or empty reservation, or a full device tier, gives
        the unchanged result with the reason; nothing raises for "no room".

        Raises:
            UnknownReservationError: an id never issued (or of another tenant).
        """
        res = self._settled(reservation_id, tenant)
        with self._lock:
            if res.state not in _WARMABLE:
                why = {ReservationState.WARMED: "already warmed",
                       ReservationState.EMPTY: "empty reservation: nothing to warm"}
                detail = f" ({res.reason})" if res.reason else ""
                return self._snapshot(res, why.get(
                    res.state, f"reservation is {res.state.value}{detail}; reserve again"))
            if self.clock() >= res.expires_at:
                self._expire(res)
                return self._snapshot(res)
            moved = self.cache.warm_blocks(res.block_ids)
            if moved is None:
                return self._snapshot(res, "device tier full: nothing evictable; release "
                                           "other reservations or grow num_device_blocks")
            now = time.time()
            for span in res.spans:
                for bid in span.block_ids:
                    self.cache.metadata.annotate(bid, source_layer=self.config.source_layer)
                self.cache.metadata.touch(span.block_ids, now)
            res.state = ReservationState.WARMED
            self._n["warmed"] += 1
            self._n["bytes_warmed"] += len(res.block_ids) * self.cache.bytes_per_block
            return self._snapshot(res)

    def release(self, reservation_id: str, *, tenant: str | None = None) -> ReservationResult:
        """Free a reservation's blocks (whatever tier they are in); idempotent.

        Raises:
            UnknownReservationError: an id never issued (or of another tenant).
        """
        with self._lock:
            res = self._get(reservation_id, tenant)
            if res.state in _ACTIVE and res.blocks_held:  # not consume()d
                res.state = ReservationState.RELEASED
                self._n["released"] += 1
                self._free(res)
            return self._snapshot(res)

    def expire_now(self, reservation_id: str | None = None) -> int:
        """Expire one unwarmed reservation, or every unwarmed one; returns how many."""
        with self._lock:
            if reservation_id is not None:
                targets = [self._get(reservation_id, None)]
            else:
                targets = list(self._reservations.values())
            count = 0
            for res in targets:
                if res.state in _WARMABLE:
                    self._expire(res)
                    count += 1
            return count

    def sweep(self) -> int:
        """Expire the unwarmed reservations whose ttl has passed; returns how many."""
        now = self.clock()
        count = 0
        with self._lock:
            while self._expiry and self._expiry[0][0] <= now:
                _, rid = heapq.heappop(self._expiry)
                res = self._reservations.get(rid)
                if res is not None and res.state in _WARMABLE:
                    self._expire(res)
                    count += 1
        return count

    def _expire(self, res: _Reservation) -> None:
        res.state = ReservationState.EXPIRED
        res.reason = "not warmed before its ttl; blocks returned to the host tier"
        self._n["expired"] += 1
        self._free(res)

    def _free(self, res: _Reservation) -> None:
        """Give the blocks back unless a running prefill still writes them."""
        if not res.blocks_held:
            return
        fut = res.prefill
        if fut is not None and not fut.done():
            if not fut.cancel():
                return  # running: _prefill_done frees the blocks when it ends
            if not res.blocks_held:
                return  # cancel() ran _prefill_done, which freed them
        with self.cache.locked():  # allocate+acquire / release+remove stay atomic
            self.cache.release(res.block_ids)
            # A keyed (adopted) block another reader holds or pins stays cached for it.
            free = [b for b in res.block_ids if not (
                (m := self.cache.metadata.get(b)).ref_count or m.pinned)]
            self.cache.remove_blocks(free)
        res.blocks_held = False
        self._retire(res)

    def _retire(self, res: _Reservation) -> None:
        """Remember a finished reservation; forget the oldest beyond ``keep_finished``."""
        self._finished.append(res.reservation_id)
        while len(self._finished) > self.config.keep_finished:
            old = self._reservations.get(self._finished.popleft())
            if old is not None and not old.blocks_held:
                del self._reservations[old.reservation_id]

    # ------------------------------------------------------------------ queries
    def _settled(self, reservation_id: str, tenant: str | None) -> _Reservation:
        """Expire what is due, then the reservation with its background prefill
        cancelled if it has not started, or waited for if it is running (its writes
        must land before the blocks change hands)."""
        self.sweep()
        with self._lock:
            res = self._get(reservation_id, tenant)
            fut = res.prefill
        if fut is not None and not fut.cancel():
            with contextlib.suppress(Exception):  # a failed prefill is counted in stats
                fut.result()
        return res

    def _get(self, reservation_id: str, tenant: str | None) -> _Reservation:
        res = self._reservations.get(reservation_id)
        if res is None or (tenant is not None and res.tenant != tenant):
            who = "" if tenant is None else f" for tenant {tenant!r}"
            raise UnknownReservationError(
                f"no reservation {reservation_id!r}{who}; use the id returned by reserve() "
                f"(finished ones are forgotten after {self.config.keep_finished} more)")
        return res

    def get(self, reservation_id: str, *, tenant: str | None = None) -> ReservationResult:
        """The current state of a reservation (expiring it if its ttl passed)."""
        self.sweep()
        with self._lock:
            return self._snapshot(self._get(reservation_id, tenant))

    def active(self, tenant: str = DEFAULT_TENANT) -> list[ReservationResult]:
        """Reservations of ``tenant`` that still hold blocks."""
        self.sweep()
        with self._lock:
            return [self._snapshot(r) for r in self._reservations.values()
                    if r.tenant == tenant and r.state in _ACTIVE and r.blocks_held]

    def _snapshot(self, res: _Reservation, reason: str | None = None) -> ReservationResult:
        return ReservationResult(
            reservation_id=res.reservation_id, tenant=res.tenant,
            node_ids=tuple(s.node_id for s in res.spans) if res.node_ids is None
            else tuple(res.node_ids), block_ids=tuple(res.block_ids),
            estimated_tokens=res.estimated_tokens, expires_at=res.expires_at, state=res.state,
            reason=res.reason if reason is None else reason, spans=tuple(res.spans),
            skipped_node_ids=tuple(res.skipped),
            num_bytes=len(res.block_ids) * self.cache.bytes_per_block,
            prefilled=res.prefilled, key=res.key,
        )

    def stats(self) -> ReserverStats:
        with self._lock:
            held = [r for r in self._reservations.values() if r.blocks_held]
            blocks = sum(len(r.block_ids) for r in held)
            n = self._n
            return ReserverStats(
                reserved=n["reserved"], partial=n["partial"], empty=n["empty"],
                warmed=n["warmed"], released=n["released"], expired=n["expired"],
                active=sum(r.state in _ACTIVE and r.blocks_held
                           for r in self._reservations.values()),
                blocks_held=blocks, bytes_held=blocks * self.cache.bytes_per_block,
                bytes_reserved=n["bytes_reserved"], bytes_warmed=n["bytes_warmed"],
                prefills_done=n["prefills_done"], prefills_failed=n["prefills_failed"],
                hit_rate=n["warmed"] / n["reserved"] if n["reserved"] else 0.0,
            )

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop the prefill thread and free every block still held (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for res in list(self._reservations.values()):
                if res.state in _ACTIVE and res.blocks_held:
                    res.state = ReservationState.RELEASED
                    self._n["released"] += 1
                if res.blocks_held:
                    self._free(res)

    def __enter__(self) -> GraphBlockReserver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
