"""Scheduler side of chunk reuse on vLLM: which labelled spans after a request's prefix
hit are stored elsewhere, and what the worker must place and compute (vLLM-free).

Every labelled span of a finished request (a prompt layer, a document, a conversation
turn; ``kv_transfer_params`` spans, see :mod:`contextkit.pipeline.served.wire`) is
registered in a :class:`gpu_cache.chunks.ChunkIndex` under its content key (tenant,
model identity, label, token ids), naming the stored blocks that hold it. A later
request of the same tenant finds its spans there wherever they were computed. The
connector then reports as matched every token up to the block boundary after the last
reused chunk: vLLM skips them, and the worker materializes them before the forward
(:class:`ChunkLoad`): it moves the chunks into place and computes the rest of that
range (the changed spans, the template between spans, each chunk's first
``repair_first`` tokens: its seam, unless what precedes it here preceded it where it
was computed: the chunk before it in the same stored run, or the same ``seam_lead``
tokens). A span the prefix hit ends inside continues the hit exactly when
it was computed at the same position after the same first block: its rest is reused
with no seam. What cannot be materialized is reported as a load error and vLLM
recomputes it.

Blocks holding moved K/V are approximations: the planner saves them under
:func:`moved_key` (a key no prefix lookup computes, so only chunk lookups find them,
as sources of their spans), and marks them with their ``hops``: the moves between their
K/V and a full computation, the source entry's plus one (:meth:`ChunkIndex.taint`), so
that drift stays bounded (``max_hops``). K/V computed here, over moved chunks, are a
computation, not a move (as in the embedded engine): a conversation's new turns do not
drift one hop further every turn.
Only requests that opted in (a ``cache_salt`` ending in
:data:`~contextkit.pipeline.served.wire.CHUNKS_SALT_SUFFIX`) reuse chunks: vLLM's own
prefix cache then keys their blocks apart from every request that did not opt in.

With a shared tier, each registered span is also published there as a span object
(:class:`SpanShare`, named by its content key), and a span the local index lacks is
looked up there (:meth:`ChunkPlanner.misses`, then the found headers passed to
:meth:`ChunkPlanner.plan`): a replica reuses a chunk another replica computed, at
another position; the worker brings its blocks in before placing it
(:attr:`MovedChunk.shared`).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from contextkit.pipeline.served.wire import WireSpan
from gpu_cache.chunks import ChunkEntry, ChunkIndex
from gpu_cache.hashing import BlockHash
from shadow.shared.objects import MAX_SPAN_BLOCKS, SpanRecord
from shadow.shared.tier import FoundSpan

__all__ = ["ChunkLoad", "ChunkPlanner", "MovedChunk", "SpanShare", "block_taints", "continues",
           "lead_digest", "moved_key", "tail_key"]


def moved_key(key: bytes) -> bytes:
    """The store key of a block whose K/V were moved in (chunk reuse), from its exact
    chained key: a prefix lookup never computes it."""
    return hashlib.sha256(b"contextkit-moved-v1" + key).digest()


def tail_key(key: bytes) -> bytes:
    """The store key of a prompt's last, partial block, from its chained key over the
    tokens it holds: a prefix lookup never computes it (prefix hits are whole blocks),
    only the chunk entries of the spans that end in it name it."""
    return hashlib.sha256(b"contextkit-tail-v1" + key).digest()


def block_taints(token_taints: Sequence[tuple[int, int, int]], block_size: int
                 ) -> list[tuple[int, int, int]]:
    """``(first block, end block, hops)`` of the blocks each ``(position, end, hops)``
    token range lands in (:meth:`ChunkLoad.token_taints`)."""
    return [(start // block_size, (end - 1) // block_size + 1, hops)
            for start, end, hops in token_taints]


def lead_digest(token_ids: Sequence[int], start: int, window: int) -> bytes | None:
    """A digest of the ``window`` tokens before ``start`` (fewer at a prompt's start),
    or None when ``window`` is 0: a chunk placed after the tokens it was computed after
    needs no seam (its first tokens see the text they saw there; what lies further
    back differs for them as for every later token of the chunk)."""
    if window <= 0:
        return None
    lead = [int(t) for t in token_ids[max(0, start - window):start]]
    return hashlib.sha256(struct.pack(f"<I{len(lead)}i", len(lead), *lead)).digest()


@dataclass(slots=True)
class MovedChunk:
    """One chunk a request reuses: where its K/V are stored and where they go."""

    source_keys: list[bytes]  # stored blocks holding it, in order
    offset: int  # its first token's slot in the first of them
    source_position: int  # where it was computed
    position: int  # where it goes in this request
    length: int
    label: str
    #: the content key of the span object its blocks come from (the shared tier; the
    #: worker imports them first), or None: the DDR tier holds them
    shared: bytes | None = None
    hops: int = 0  # its entry's moves from a full computation (one more once moved here)
    #: its first tokens the worker recomputes (its seam; 0 where what precedes it here
    #: is what preceded it where it was computed)
    repair: int = 0
    #: it continues this request's own prefix hit at the position it was computed at:
    #: its K/V are what a full computation gives here (no seam, no hop)
    exact: bool = False


def continues(prev: MovedChunk, chunk: MovedChunk) -> bool:
    """Whether ``chunk`` was computed right after ``prev``'s tokens, as it sits after
    them here: adjacent here and where computed, and one stored block holds ``prev``'s
    end and ``chunk``'s start (a chained key: the same prompt up to there). Its first
    tokens then saw what they see here, so it needs no seam of its own."""
    return (prev.position + prev.length == chunk.position
            and prev.source_position + prev.length == chunk.source_position
            and prev.source_keys[-1] == chunk.source_keys[0])


@dataclass(frozen=True, slots=True)
class SpanShare:
    """Worker instruction: publish a registered span to the shared tier (its blocks,
    read from the DDR tier, as a span object named by its content key)."""

    tenant: str
    span: SpanRecord  # its content key (the object's name), label, position, length, hops
    block_keys: list[bytes]


@dataclass(slots=True)
class ChunkLoad:
    """Worker instruction: materialize tokens ``start .. end-1`` of a request whose
    prefix ``0 .. start-1`` is in its pages (vLLM's hit, or this step's loads)."""

    req_id: str
    tenant: str
    start: int
    end: int
    chunks: list[MovedChunk]
    compute: list[int]  # positions the connector computes, ascending
    range_ids: list[int]  # the request's token ids ``start .. end-1``
    block_ids: list[int] = field(default_factory=list)  # the request's first end/N blocks
    #: moved tokens the worker also recomputes, picked where their K/V deviate most
    #: (CacheBlend's selection; 0: the seams only)
    selected: int = 0
    #: the entries of its chunks found in the shared tier (:meth:`ChunkPlanner.adopt`)
    found: list[tuple[bytes, ChunkEntry]] = field(default_factory=list)

    def taints(self, block_size: int) -> list[tuple[int, int, int]]:
        """``(first block, end block, hops)`` of the blocks each moved chunk lands in:
        its entry's hops plus this move (none for an exact one)."""
        return block_taints(self.token_taints(), block_size)

    def token_taints(self) -> list[tuple[int, int, int]]:
        """``(position, end, hops)`` of each moved chunk's tokens here, as
        :meth:`taints` counts them: a span computed here beside one (in a block it
        ends in) is not counted as moved."""
        return [(c.position, c.position + c.length, c.hops + (0 if c.exact else 1))
                for c in self.chunks]

    @property
    def compute_ids(self) -> list[int]:
        """The token ids at :attr:`compute`."""
        return [self.range_ids[p - self.start] for p in self.compute]

    @property
    def reused_tokens(self) -> int:
        """Tokens moved in and not recomputed."""
        return self.end - self.start - len(self.compute) - self.selected

    @property
    def computed_tokens(self) -> int:
        """Tokens the worker computes: :attr:`compute` and the selected ones."""
        return len(self.compute) + self.selected


class ChunkPlanner:
    """The chunk index and the per-request plans.

    Args:
        identity_digest: the cache identity's digest (salts every chunk key).
        block_size: tokens per block.
        min_tokens: spans shorter than this are computed, not looked up.
        repair_first: each moved chunk's first tokens are recomputed (its seam), unless
            it continues the chunk before it as computed (:func:`continues`) or sits
            after the ``seam_lead`` tokens it was computed after (:func:`lead_digest`).
        seam_lead: tokens before a chunk that, unchanged, spare it its seam (0: only
            a chunk continuing the one before it is spared).
        max_hops: chunks this many moves from a full computation are not reused.
        min_share: a request reuses chunks only when they cover at least this share
            of the range the connector would materialize.
        repair_ratio: the share of the moved tokens the worker also recomputes
            (CacheBlend's selection, ``chunk_repair_ratio``).
        layers: labels that may be reused (None: all).
    """

    def __init__(self, identity_digest: bytes, block_size: int, *, min_tokens: int = 16,
                 repair_first: int = 4, max_hops: int = 4, min_share: float = 0.2,
                 repair_ratio: float = 0.0, layers: frozenset[str] | None = None,
                 seam_lead: int = 16) -> None:
        self.index = ChunkIndex(identity_digest)
        self.block_size = block_size
        self.min_tokens = min_tokens
        self.repair_first = repair_first
        self.seam_lead = seam_lead
        self.max_hops = max_hops
        self.min_share = min_share
        self.repair_ratio = repair_ratio
        self.layers = layers

    def eligible(self, span: WireSpan) -> bool:
        return (span.end - span.start >= self.min_tokens
                and (self.layers is None or span.source_layer in self.layers))

    def _local(self, key: bytes, tenant: str, length: int,
               held: Callable[[bytes], bool]) -> ChunkEntry | None:
        """The index's usable entry under ``key`` (an entry naming a block the store no
        longer holds is dropped)."""
        entry = self.index.get(key, tenant)
        if entry is None or entry.length != length or entry.hops >= self.max_hops:
            return None
        if not all(held(k) for k in entry.block_keys):
            self.index.discard(key)
            return None
        return entry

    def _candidates(self, tenant: str, token_ids: Sequence[int], num_prompt: int,
                    spans: Sequence[WireSpan], prefix_end: int
                    ) -> list[tuple[WireSpan, bytes, list[int]]]:
        """The spans a plan may reuse, each with its key and ids: those after the prefix
        hit, and one the hit ends inside (its rest)."""
        limit = max(0, num_prompt - 1) // self.block_size * self.block_size
        out = []
        for span in sorted(spans, key=lambda s: s.start):
            if span.end <= prefix_end or span.start >= limit or not self.eligible(span):
                continue
            ids = list(token_ids[span.start:span.end])
            out.append((span, self.index.key(tenant, span.source_layer, ids), ids))
        return out

    def misses(self, tenant: str, token_ids: Sequence[int], num_prompt: int,
               spans: Sequence[WireSpan], prefix_end: int,
               held: Callable[[bytes], bool]) -> list[bytes]:
        """The content keys of the spans :meth:`plan` would move in but the local index
        has no usable entry for (to look up in the shared tier)."""
        return [key for span, key, ids in self._candidates(tenant, token_ids, num_prompt,
                                                           spans, prefix_end)
                if span.start >= prefix_end
                and self._local(key, tenant, len(ids), held) is None]

    def plan(self, req_id: str, tenant: str, token_ids: Sequence[int], num_prompt: int,
             spans: Sequence[WireSpan], prefix_end: int,
             held: Callable[[bytes], bool],
             found: Mapping[bytes, FoundSpan] | None = None,
             prefix_keys: Sequence[bytes] = ()) -> ChunkLoad | None:
        """The chunk load of a request whose first ``prefix_end`` tokens are found by
        prefix, or None when no chunk after it is worth reusing.

        Args:
            held: whether the store holds a block key (an entry naming a block it no
                longer holds is dropped).
            found: span objects the shared tier holds, by content key
                (:meth:`misses`); used where the local index has no entry.
            prefix_keys: the request's own keys of its prefix-hit blocks (a span the
                hit ends inside continues it exactly where its entry starts with one
                of them).
        """
        bs = self.block_size
        limit = max(0, num_prompt - 1) // bs * bs  # vLLM computes at least one token
        moved: list[MovedChunk] = []
        found_entries: list[tuple[bytes, ChunkEntry]] = []
        for span, key, ids in self._candidates(tenant, token_ids, num_prompt, spans,
                                               prefix_end):
            entry = self._local(key, tenant, len(ids), held)
            if span.start < prefix_end:
                rest = self._continuation(span, entry, prefix_end, prefix_keys)
                if rest is not None:
                    moved.append(rest)
                continue
            shared = None
            if entry is None and found and key in found:
                entry, shared = self._remote(tenant, span, found[key], len(ids)), key
            if entry is None:
                continue
            chunk = MovedChunk([bytes(k) for k in entry.block_keys], entry.offset,
                               entry.position, span.start, len(ids), span.source_layer,
                               shared, entry.hops, repair=self.repair_first)
            if (moved and continues(moved[-1], chunk)) or (
                    entry.lead is not None
                    and entry.lead == lead_digest(token_ids, span.start, self.seam_lead)):
                chunk.repair = 0
            moved.append(chunk)
            if shared is not None:
                found_entries.append((key, entry))
        if not moved:
            return None
        # to the block boundary after the last chunk: it is reused to its end, and the
        # connector computes the few tokens after it that share its last block
        end = min(limit, -(-(moved[-1].position + moved[-1].length) // bs) * bs)
        kept = []
        for chunk in moved:  # the last ones may end past the end (the prompt's last block)
            if chunk.position + chunk.repair >= end:
                continue
            chunk.length = min(chunk.length, end - chunk.position)
            kept.append(chunk)
        if not kept:
            return None
        covered = [False] * (end - prefix_end)
        for chunk in kept:
            for p in range(chunk.position + chunk.repair, chunk.position + chunk.length):
                covered[p - prefix_end] = True
        compute = [prefix_end + i for i, c in enumerate(covered) if not c]
        reused = len(covered) - len(compute)
        if end <= prefix_end or reused < self.min_share * len(covered):
            return None
        return ChunkLoad(req_id, tenant, prefix_end, end, kept, compute,
                         [int(t) for t in token_ids[prefix_end:end]],
                         selected=round(self.repair_ratio * reused), found=found_entries)

    def _continuation(self, span: WireSpan, entry: ChunkEntry | None, prefix_end: int,
                      prefix_keys: Sequence[bytes]) -> MovedChunk | None:
        """The rest of a span the prefix hit ends inside, when its entry was computed at
        this very position after this request's own blocks (its first block is one of
        the hit's): K/V a full computation gives, reused with no seam and no hop."""
        bs = self.block_size
        first = span.start // bs
        if (entry is None or entry.position != span.start or first >= len(prefix_keys)
                or bytes(entry.block_keys[0]) != bytes(prefix_keys[first])):
            return None
        skip = prefix_end // bs - first
        return MovedChunk([bytes(k) for k in entry.block_keys[skip:]], 0, prefix_end,
                          prefix_end, span.end - prefix_end, span.source_layer,
                          hops=entry.hops, exact=True)

    def _remote(self, tenant: str, span: WireSpan, found: FoundSpan, length: int
                ) -> ChunkEntry | None:
        """The entry of a span object the shared tier holds (its reader checked that its
        blocks cover the span); None when it is of another label or length (its name is
        its content key, so only a writer with the deployment's key running other code
        could cause that) or too many hops away."""
        rec = found.span
        if rec.label != span.source_layer or rec.length != length or rec.hops >= self.max_hops:
            return None
        return ChunkEntry(tenant, rec.label, tuple(BlockHash(k) for k in found.block_keys),
                          rec.position % self.block_size, rec.position, length, rec.hops)

    def register(self, tenant: str, token_ids: Sequence[int], spans: Sequence[WireSpan],
                 keys: Sequence[bytes], stored_blocks: int, held: Callable[[bytes], bool],
                 *, materialized: int | None = None,
                 moved: Sequence[tuple[int, int, int]] = (),
                 stored_tokens: int | None = None) -> list[SpanShare]:
        """Register a request's spans held by its first ``stored_blocks`` blocks
        (``keys``: the keys they are stored under; the last may be partial, holding
        tokens up to ``stored_tokens``). ``held``: whether the store holds a block key.
        A span inherits the most hops of the moved K/V it holds: in blocks before
        ``materialized`` (the first token of the request's chunk load, if any;
        block-aligned), the hops its blocks were tainted with; from there on,
        those of the ``moved`` token ranges (:meth:`ChunkLoad.token_taints`) it
        overlaps (tokens computed here, beside a moved chunk in one block, are 0).
        Returns the spans newly registered (or now held elsewhere), as shared-tier
        publications (those short enough for a span object)."""
        bs = self.block_size
        limit = stored_blocks * bs if stored_tokens is None else min(stored_tokens,
                                                                      stored_blocks * bs)
        shares = []
        for span in spans:
            if not self.eligible(span) or span.end > limit:
                continue
            first, last = span.start // bs, (span.end - 1) // bs
            block_keys = tuple(BlockHash(k) for k in keys[first:last + 1])
            if materialized is None:
                span_hops = self.index.hops_of(block_keys)
            else:
                before = block_keys[:max(0, materialized // bs - first)]
                span_hops = max([self.index.hops_of(before)] + [
                    hops for a, b, hops in moved if a < span.end and span.start < b])
            ids = list(token_ids[span.start:span.end])
            key = self.index.key(tenant, span.source_layer, ids)
            old = self.index.get(key, tenant)
            entry = ChunkEntry(tenant, span.source_layer, block_keys, span.start % bs,
                               span.start, len(ids), span_hops,
                               lead_digest(token_ids, span.start, self.seam_lead))
            # a still-stored entry fewer hops from a full computation is kept
            keep = (old if old is not None and old.hops < span_hops
                    and all(held(bytes(k)) for k in old.block_keys) else None)
            if (self.index.put(key, entry, keep=keep) and entry != old
                    and len(block_keys) <= MAX_SPAN_BLOCKS):
                shares.append(SpanShare(tenant, SpanRecord(key, span.source_layer, span.start,
                                                           len(ids), span_hops),
                                        [bytes(k) for k in block_keys]))
        return shares

    def adopt(self, load: ChunkLoad) -> None:
        """A planned load's chunks from the shared tier into the local index (found
        locally once the worker has imported their blocks), their blocks' hops kept."""
        for key, entry in load.found:
            self.index.put(key, entry)
            self.index.taint(entry.block_keys, entry.hops)

    def taint(self, keys: Sequence[bytes], hops: int) -> None:
        """These blocks hold moved K/V ``hops`` moves from a full computation."""
        if hops > 0 and keys:
            self.index.taint([BlockHash(k) for k in keys], hops)
