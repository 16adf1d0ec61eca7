"""Reuse beyond the prefix: a request finds its later layers and turns cached at other
positions, moves their K/V to its own, and recomputes only the tokens that need it.

A prompt's prefix is reused by chained block keys (:mod:`contextkit.engine.sequence`);
everything after the first changed layer used to be recomputed. Each labelled span of
a prompt (a layer, a conversation turn: the :class:`~contextkit.engine.types.TokenSpan`
the pipeline gives) is also registered by content in the cache's
:class:`gpu_cache.chunks.ChunkIndex`. A later request:

1. **finds** its spans after the cached prefix in the index (:func:`find_chunks`): the
   same tenant, model identity, label and tokens, whose blocks are still cached;
2. **moves** their K/V into its own blocks (:func:`copy_chunks`): values as stored,
   keys re-rotated by the position delta (RoPE is a rotation by position, so a key
   computed at ``p`` and rotated by ``q - p`` is the key at ``q``); tq4 keys are decoded,
   rotated and re-encoded;
3. **repairs the seams** (:mod:`contextkit.engine.blend`): a reused chunk's K/V were
   computed after other text, so the first layers run over every token, the tokens
   whose K/V deviate most there from the cached ones (read where the chunk lies,
   :func:`copy_chunks` with ``read_at``) plus each chunk's first tokens are picked
   (:func:`select_repair`), and only they and the new tokens run through the rest.

A span whose text changed a little since it was cached (a status line whose figures
moved: a new key) is **aligned** against the earlier versions of it the index keeps
(same tenant, label and first tokens, :meth:`~gpu_cache.chunks.ChunkIndex.versions`):
the runs of tokens the two share are moved in like chunks of their own, the changed
tokens are computed, and the repair treats the token after each change as a seam.

Spans inside the float residual window or the attention sink are always computed.
An entry computed in full context has 0 hops; K/V reused from an ``n``-hop entry
(repaired or not) are ``n + 1`` hops away, and entries past ``max_hops`` are not
reused: re-rotating and re-encoding does not accumulate without bound.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from contextkit.engine.attention import rotate
from contextkit.engine.kv import read_slots, slots_of, write_slots
from contextkit.engine.types import TokenSpan
from gpu_cache import Tier, TQGPUCache
from gpu_cache.chunks import ChunkEntry
from gpu_cache.hashing import BlockHash

if TYPE_CHECKING:
    from contextkit.engine.llama import LlamaModel

__all__ = ["DEVIATION_AT", "REPAIR_RULES", "ChunkHit", "ChunkReuse", "ChunkSource",
           "ChunkUse", "copy_chunks", "find_chunks", "kv_deviation", "register_chunks",
           "select_repair", "shared_runs"]

#: How the tokens of reused chunks that are recomputed are picked: "deviation" (the
#: largest K/V deviation at the selection layer, CacheBlend's rule), "first" (each
#: chunk's first tokens only), "both" (the union).
REPAIR_RULES = ("deviation", "first", "both")

#: What a reused token's fresh K/V at the selection layer are measured against:
#: "source" (the K/V as the chunk's source blocks hold them, the fresh keys rotated
#: back to the cached positions) or "moved" (the K/V after the move; on tq4 the moved
#: keys carry a second quantization, noise that then takes part in the pick).
DEVIATION_AT = ("source", "moved")


@dataclass(frozen=True, slots=True)
class ChunkReuse:
    """When and how a request reuses chunks past its cached prefix.

    Args:
        enabled: look chunks up and register them (``False``: prefix reuse only).
        labels: the span labels (layers, ``"user_turn"``) that may be reused; ``None``:
            every label. Registration covers every label all the same.
        min_tokens: shorter spans are computed, not looked up.
        repair_ratio: share of a request's reused chunk tokens recomputed (the ones
            picked by ``repair_rule``), in ``[0, 1]``.
        repair_first: each reused chunk's first this-many tokens are recomputed too
            (rules "first" and "both").
        repair_rule: one of :data:`REPAIR_RULES`.
        select_layer: model layers ``0..select_layer`` run over every token; the
            deviation at ``select_layer`` picks the repaired ones.
        deviation_at: one of :data:`DEVIATION_AT`.
        max_hops: entries this many reuses away from a full computation are not reused.
        min_share: a request reuses chunks only when they cover at least this share of
            the tokens after its cached prefix (below it the first layers over every
            token and the moves cost about what the chunks save: a plain prefill).
        edits: align a span that is not cached as it is against earlier versions of
            it and reuse the runs of tokens they share.
        edit_signature: the first this-many tokens name a span's versions (a version
            must start the same way).
        edit_min_run: shared runs shorter than this are computed.
        edit_min_share: a version is used only when the runs reused cover at least
            this share of the span.
        edit_repair_first: the first this-many tokens of each run after a change are
            recomputed (rules "first" and "both"; at most ``repair_first``).
    """

    enabled: bool = True
    labels: tuple[str, ...] | None = None
    min_tokens: int = 16
    repair_ratio: float = 0.15
    repair_first: int = 4
    repair_rule: str = "both"
    select_layer: int = 1
    deviation_at: str = "source"
    max_hops: int = 4
    min_share: float = 0.2
    edits: bool = True
    edit_signature: int = 4
    edit_min_run: int = 3
    edit_min_share: float = 0.5
    edit_repair_first: int = 1

    def __post_init__(self) -> None:
        if self.repair_rule not in REPAIR_RULES:
            raise ValueError(f"repair_rule must be one of {REPAIR_RULES}, got "
                             f"{self.repair_rule!r}")
        if self.deviation_at not in DEVIATION_AT:
            raise ValueError(f"deviation_at must be one of {DEVIATION_AT}, got "
                             f"{self.deviation_at!r}")
        for name in ("repair_ratio", "min_share", "edit_min_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("min_tokens", "repair_first", "select_layer", "max_hops",
                     "edit_signature", "edit_min_run", "edit_repair_first"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.labels is not None:
            object.__setattr__(self, "labels", tuple(self.labels))

    def versioned(self, tokens: int) -> bool:
        """Whether a span of ``tokens`` tokens keeps versions to align edits against."""
        return self.edits and 1 <= self.edit_signature < tokens

    def eligible(self, span: TokenSpan) -> bool:
        """Whether ``span`` may be reused by content."""
        return (span.end - span.start >= max(1, self.min_tokens)
                and (self.labels is None or span.source_layer in self.labels))


@dataclass(slots=True)
class ChunkHit:
    """One run of tokens a request reuses: where it goes and where its K/V are (the
    source blocks hold one reference until the request lets them go). A span cached as
    it is is one run; an edited span is a run per stretch it shares with its version.

    Attributes:
        start, length: the run's place in the request.
        label: its span's label.
        entry: where the run's K/V lie (its first token at ``entry.offset``,
            computed at ``entry.position``).
        src_blocks: the blocks of ``entry``.
        span_start, span_length: the span the run is part of.
        first: its first tokens recomputed under the rules "first" and "both".
        edit: the span was aligned against an earlier version.
    """

    start: int
    length: int
    label: str
    entry: ChunkEntry
    src_blocks: list[int]
    span_start: int = -1
    span_length: int = 0
    first: int = 0
    edit: bool = False

    def __post_init__(self) -> None:
        if self.span_start < 0:
            self.span_start, self.span_length = self.start, self.length


@dataclass(slots=True)
class ChunkUse:
    """What one request did with chunks (for its result and report), per span reused
    (as it was cached, or edited).

    Attributes:
        reused_tokens: chunk tokens whose K/V came from the cache and were not
            recomputed.
        repaired_tokens: chunk tokens found but recomputed (the seams).
        chunks: labels of the reused spans, in prompt order.
        starts: their positions in the prompt.
        lengths: their tokens.
        moved: per span, its tokens moved in and not recomputed.
        hops: per span, the hops of its K/V now (entry's + 1).
        edits: the starts of the spans reused by aligning an earlier version.
        edited_tokens: tokens of those spans computed because they changed.
    """

    reused_tokens: int = 0
    repaired_tokens: int = 0
    chunks: list[str] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    moved: list[int] = field(default_factory=list)
    hops: list[int] = field(default_factory=list)
    edits: list[int] = field(default_factory=list)
    edited_tokens: int = 0

    def taint(self, cache: TQGPUCache, keys: Sequence[BlockHash]) -> None:
        """Record the hops of the blocks (of the prompt's full blocks ``keys``) that
        now hold reused K/V."""
        bs = cache.block_size
        for start, length, hops in zip(self.starts, self.lengths, self.hops, strict=True):
            b0, b1 = start // bs, min(len(keys), (start + length - 1) // bs + 1)
            cache.chunks.taint(keys[b0:b1], hops)


def find_chunks(cache: TQGPUCache, ids: Sequence[int], spans: Sequence[TokenSpan],
                tenant: str, lo: int, hi: int, cfg: ChunkReuse,
                only: Sequence[int] | None = None,
                edits: Sequence[int] = ()) -> list[ChunkHit]:
    """The eligible spans inside positions ``[lo, hi)`` cached by content for
    ``tenant``, or aligned against a cached version (``cfg.edits``); their source
    blocks are acquired and on the device tier. ``only``: just the spans starting
    there, and ``edits``: of those, the ones to align (to replay a request's path).

    A stale entry (a block of it gone) is dropped; a chunk whose blocks cannot be
    brought to the device tier is left to compute.
    """
    hits: list[ChunkHit] = []
    with cache.locked():
        for span in sorted(spans, key=lambda s: s.start):
            if span.start < lo or span.end > hi or not cfg.eligible(span) or (
                    only is not None and span.start not in only):
                continue
            if hits and span.start < hits[-1].span_start + hits[-1].span_length:
                continue  # overlapping spans: the first wins
            tokens = ids[span.start : span.end]
            found: list[ChunkHit] | None = None
            if only is None or span.start not in edits:
                found = _exact(cache, span, tokens, tenant, cfg)
            if found is None and cfg.edits and (only is None or span.start in edits):
                found = _edited(cache, span, tokens, tenant, cfg)
            hits.extend(found or ())
    return hits


def _sources(cache: TQGPUCache, key: bytes, tenant: str,
             cfg: ChunkReuse) -> tuple[ChunkEntry, list[int]] | None:
    """The entry under ``key`` and its blocks, acquired and on the device tier; ``None``
    when it is gone, too many hops away, or cannot be brought up."""
    index = cache.chunks
    entry = index.get(key, tenant)
    if entry is None or entry.hops >= cfg.max_hops:
        return None
    bids = cache.lookup(entry.block_keys, tenant)
    if len(bids) < len(entry.block_keys):
        index.discard(key)
        return None
    cache.acquire(bids)
    host = [b for b in bids if cache.metadata.get(b).tier is Tier.HOST]
    if host and cache.warm_blocks(host) is None:
        cache.release(bids)
        return None
    return entry, bids


def _exact(cache: TQGPUCache, span: TokenSpan, tokens: Sequence[int], tenant: str,
           cfg: ChunkReuse) -> list[ChunkHit] | None:
    """``span`` cached as it is: one run."""
    src = _sources(cache, cache.chunks.key(tenant, span.source_layer, tokens), tenant, cfg)
    if src is None:
        return None
    entry, bids = src
    return [ChunkHit(span.start, span.end - span.start, span.source_layer, entry, bids,
                     first=cfg.repair_first)]


def shared_runs(old: Sequence[int], new: Sequence[int], min_run: int) -> list[tuple[int, int, int]]:
    """The runs of tokens ``old`` and ``new`` share, in order, as ``(i, j, n)``:
    ``old[i:i+n] == new[j:j+n]``, ``n >= min_run`` (difflib's longest matching blocks)."""
    matcher = difflib.SequenceMatcher(None, list(old), list(new), autojunk=False)
    return [(b.a, b.b, b.size) for b in matcher.get_matching_blocks()
            if b.size >= max(1, min_run)]


def _edited(cache: TQGPUCache, span: TokenSpan, tokens: Sequence[int], tenant: str,
            cfg: ChunkReuse) -> list[ChunkHit] | None:
    """``span`` aligned against the cached version of it sharing the most tokens: a
    run per stretch they share."""
    tokens, n = tuple(tokens), len(tokens)
    if not cfg.versioned(n):
        return None
    index = cache.chunks
    sig = index.signature(tenant, span.source_layer, tokens[: cfg.edit_signature])
    best: tuple[int, list[tuple[int, int, int]], bytes] | None = None
    for old, key in index.versions(sig, tenant):
        if old == tokens:
            continue  # itself: reused as it is or not at all
        runs = shared_runs(old, tokens, cfg.edit_min_run)
        shared = sum(r[2] for r in runs)
        if shared >= cfg.edit_min_share * n and (best is None or shared > best[0]):
            best = (shared, runs, key)
    if best is None:
        return None
    src = _sources(cache, best[2], tenant, cfg)
    if src is None:
        return None
    entry, bids = src
    hits = []
    for r, (i, j, size) in enumerate(best[1]):
        if r:
            cache.acquire(bids)  # one reference per run: each is released on its own
        first = cfg.repair_first if j == 0 else min(cfg.repair_first, cfg.edit_repair_first)
        hits.append(ChunkHit(span.start + j, size, span.source_layer,
                             replace(entry, offset=entry.offset + i,
                                     position=entry.position + i, length=size),
                             bids, span.start, n, first, True))
    return hits


def release_chunks(cache: TQGPUCache, hits: Sequence[ChunkHit]) -> None:
    """Let the source blocks of ``hits`` go."""
    with cache.locked():
        for hit in hits:
            cache.release(hit.src_blocks)


def _rope_delta(model: LlamaModel, deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[n, 1, D]`` rotating a key by ``deltas`` positions."""
    cos, sin = model.rope(deltas)
    scaling = float(getattr(model.rotary, "attention_scaling", 1.0) or 1.0)
    if scaling != 1.0:  # the table scales cos/sin; a delta rotation must not scale twice
        cos, sin = cos / scaling, sin / scaling
    return cos.float(), sin.float()


def kv_deviation(k: torch.Tensor, v: torch.Tensor, ref_k: torch.Tensor,
                 ref_v: torch.Tensor) -> torch.Tensor:
    """``[n]``: the squared distance of K/V ``[n, Hkv, D]`` rows from reference rows."""
    return (((k.float() - ref_k) ** 2).sum(dim=(1, 2))
            + ((v.float() - ref_v) ** 2).sum(dim=(1, 2)))


@dataclass(slots=True)
class ChunkSource:
    """The reused rows' K/V at one layer as their source blocks hold them (read before
    the blocks are let go), to measure a request's fresh K/V against.

    Attributes:
        k: keys ``[n, Hkv, D]``, centered as the cache stores them, at the cached
            positions.
        v: values ``[n, Hkv, D]``.
        cos, sin: ``[n, 1, D]``, the rotation by each row's position delta.
    """

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    def deviation(self, k: torch.Tensor, v: torch.Tensor,
                  offset: torch.Tensor | None) -> torch.Tensor:
        """``[n]``: how far fresh ``k`` (uncentered, at the new positions) and ``v`` are
        from the cached rows; the keys are rotated back to the cached positions, so
        the comparison carries the cache's one quantization, not a move's second."""
        back = rotate(k.float(), self.cos, -self.sin)
        if offset is not None:
            back = back - offset
        return kv_deviation(back, v, self.k, self.v)


def copy_chunks(cache: TQGPUCache, model: LlamaModel, hits: Sequence[ChunkHit],
                dst_table: torch.Tensor, layers: range,
                read_at: int | None = None) -> ChunkSource | None:
    """Write the K/V of ``hits`` at their new positions (``dst_table``: the request's
    block table) for ``layers``: values as stored, keys rotated by the position delta.

    Returns:
        With ``read_at``, the K/V of ``hits`` at that layer as their source blocks hold
        them (:class:`ChunkSource`), else ``None``.
    """
    if not hits:
        return None
    bs = cache.block_size
    src, dst, delta = [], [], []
    for hit in hits:
        src.append(slots_of(cache.block_table(hit.src_blocks).long(),
                            torch.arange(hit.length) + hit.entry.offset, bs))
        dst.append(slots_of(dst_table, torch.arange(hit.start, hit.start + hit.length), bs))
        delta.append(torch.full((hit.length,), hit.start - hit.entry.position))
    src_slots = torch.cat(src).to(cache.device)
    dst_slots = torch.cat(dst).to(cache.device)
    cos, sin = _rope_delta(model, torch.cat(delta).to(model.device))
    source = None
    if read_at is not None:
        k, v = read_slots(cache, read_at, src_slots)
        assert v is not None
        source = ChunkSource(k.to(model.device), v.to(model.device), cos, sin)
    cos, sin = cos.to(cache.device), sin.to(cache.device)
    native = cache.identity.codec == "native"
    for layer in layers:
        offset = None if native else cache.key_offset(layer)
        k, _ = read_slots(cache, layer, src_slots, values=False)
        view = cache.layer_view(layer)
        if offset is not None:
            k = k + offset
        write_slots(cache, layer, dst_slots, rotate(k, cos, sin), None)
        # values carry no position: the stored bytes move as they are
        for name in ("v_packed", "v_norms"):
            t = getattr(view, name)
            if t.numel() == 0:  # native blocks keep no norms
                continue
            flat = t.view(-1, *t.shape[2:])
            flat.index_copy_(0, dst_slots, flat.index_select(0, src_slots))
    return source


def select_repair(deviation: torch.Tensor, chunk_rows: Sequence[tuple[int, int]],
                  cfg: ChunkReuse, first: Sequence[int] | None = None) -> torch.Tensor:
    """Which reused rows to recompute: a bool mask over ``deviation``'s rows.

    Args:
        deviation: ``[n]`` per reused row, how far its cached K/V are from this
            context's at the selection layer.
        chunk_rows: per chunk (run), its rows ``[a, b)`` among those ``n``.
        cfg: the rule, ratio and first tokens.
        first: per chunk, its first tokens to recompute (rules "first" and "both");
            default ``cfg.repair_first`` each.
    """
    n = deviation.shape[0]
    pick = torch.zeros(n, dtype=torch.bool)
    if first is None:
        first = [cfg.repair_first] * len(chunk_rows)
    if cfg.repair_rule in ("first", "both"):
        for (a, b), k in zip(chunk_rows, first, strict=True):
            pick[a : min(b, a + k)] = True
    if cfg.repair_rule in ("deviation", "both"):
        want = min(n, math.ceil(cfg.repair_ratio * n))
        extra = want - int(pick.sum())
        if extra > 0:
            dev = deviation.detach().float().cpu().clone()
            dev[pick] = -math.inf
            pick[torch.topk(dev, extra).indices] = True
    return pick


def register_chunks(cache: TQGPUCache, ids: Sequence[int], spans: Sequence[TokenSpan],
                    keys: Sequence[BlockHash], tenant: str, cfg: ChunkReuse) -> int:
    """Register the spans lying in the registered full blocks (``keys``) by content; a
    chunk's hops are the most of its blocks' (:meth:`ChunkIndex.taint`).

    Returns:
        Entries written (an entry that still holds and is as few hops away is kept).
    """
    bs = cache.block_size
    index = cache.chunks
    written = 0
    for span in spans:
        if span.end > len(keys) * bs or span.end - span.start < max(1, cfg.min_tokens):
            continue
        b0, b1 = span.start // bs, (span.end - 1) // bs + 1
        hops = index.hops_of(keys[b0:b1])
        entry = ChunkEntry(tenant=tenant, label=span.source_layer,
                           block_keys=tuple(keys[b0:b1]), offset=span.start % bs,
                           position=span.start, length=span.end - span.start, hops=hops)
        tokens = ids[span.start : span.end]
        key = index.key(tenant, span.source_layer, tokens)
        if cfg.versioned(len(tokens)):
            index.note_version(index.signature(tenant, span.source_layer,
                                               tokens[: cfg.edit_signature]),
                               tenant, tokens, key)
        held = index.get(key, tenant)
        keep = None
        if held is not None and held != entry and held.hops <= hops \
                and len(cache.lookup(held.block_keys, tenant)) == len(held.block_keys):
            keep = held
        written += index.put(key, entry, keep=keep)
    return written
