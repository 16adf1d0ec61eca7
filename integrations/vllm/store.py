"""Worker-side block store of the vLLM connector: contextkit's tiers plus the shadow.

Holds one :class:`gpu_cache.TQGPUCache` per block format (device tier + DDR tier,
semantic eviction, prefix pins; see :mod:`.pools`) whose blocks are keyed by
contextkit's block keys, each with a :class:`shadow.CacheShadow` session that makes
them durable. Each block goes to the pool of its label's format (``BlockLabel.fmt``,
chosen by the precision policy); ``tq4`` and ``int8`` pools subtract per-head key
offsets calibrated on the first big save (loaded keys are always the keys). Free of
vLLM imports: the connector hands it K/V as
``[num_layers, n, block_size, num_kv_heads, head_dim]``. Blocks are allocated,
labelled and keyed through :class:`gpu_cache.RequestBlockManager`; the shadow
metrics (bytes, lag), the snapshot and the shadow sessions by the
:class:`.store_shadow.PoolShadows` it holds, and its side of the shared tier by the
:class:`.store_shared.SharedBlocks` it holds. A block whose
label carries a ``room_fmt`` is stored in it while the DDR budget has room and
transcoded back to its label's format before anything is evicted (:mod:`.headroom`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gpu_cache import (
    BlockAnnotation,
    BlockStateError,
    CacheIdentity,
    CacheIdentityError,
    PinCapacityError,
    PrefixPinManager,
    RequestBlockManager,
    Tier,
    TQGPUCache,
    formats,
)
from gpu_cache.hashing import BlockHash
from gpu_cache.metadata import BlockMeta
from integrations.vllm.config import ConnectorConfig
from integrations.vllm.headroom import demotion_candidates, room_formats
from integrations.vllm.metrics import StatsRecorder, layer_names
from integrations.vllm.pools import (
    CALIBRATION_BLOCKS,
    OFFSET_FORMATS,
    Pool,
    assemble_parts,
    calibrate_offsets,
    decode_pool_blocks,
    fit_budget,
    format_summary,
    held_bytes,
    pool_identity,
    pool_suffix,
    unpinned_reason,
)
from integrations.vllm.precision import BlockLabel
from integrations.vllm.snapshots import (
    LOCAL_SESSION,
    local_session_keys,
    shadow_manifest,
    shadow_manifests,
)
from integrations.vllm.store_shadow import PoolShadows
from integrations.vllm.store_shared import SharedBlocks, tenant_slug
from shadow import CacheShadow, RecoveryReport, ShadowResult
from shadow.shared.objects import SharedChunk

__all__ = ["LOCAL_SESSION", "ConnectorStore", "SaveResult", "local_session_keys",
           "shadow_manifest", "shadow_manifests", "tenant_slug"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SaveResult:
    """Keys a save stored, keys its allocation evicted, keys it could not store."""

    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    failed: list[bytes] = field(default_factory=list)
    #: source layer of each ``removed`` key (None: unknown)
    removed_layers: list[str | None] = field(default_factory=list)
    #: why blocks labelled pinned were stored unpinned (one line; None: none was)
    unpinned: str | None = None
    #: volatile-tail keys not stored: the save did not fit without evicting
    #: (``ConnectorConfig.store_volatile`` = ``"room"``)
    skipped: list[bytes] = field(default_factory=list)


class ConnectorStore:
    """Blocks by key in contextkit's tiers, one pool per block format, shadowed to
    ``config.shadow_url``.

    Args:
        identity: the key identity (model, block size, ``config.codec``): block keys
            are salted with its digest, and its pool keeps the plain session names.
        config: tier sizes (each pool's tiers hold as many bytes as ``host_blocks`` /
            ``device_blocks`` blocks of ``identity``), shadow and local store.
        key_offsets: ``tq4`` and ``int8`` pools subtract per-head key offsets,
            calibrated from the first save holding >= 8 blocks of the format; None
            takes ``config.policy.key_offsets``.

    Attributes:
        stats: the worker side's metrics (loads, saves, evictions, shadow); see
            :meth:`take_stats`.
        pools: the pools by name (``""``: the key identity's; ``"@fmt[.digest8]"``).
        shadows: the local snapshot and the shadow sessions of the pools.
        shared: the store's side of the shared tier (chunks out and in).

    Saves go to the DDR tier on CPU (both tiers are RAM; DDR is where stored
    blocks belong) and to the device tier on CUDA (fused quantization on the GPU;
    the semantic policy spills them to pinned DDR as the device tier fills).
    """

    def __init__(self, identity: CacheIdentity, config: ConnectorConfig, *,
                 key_offsets: bool | None = None) -> None:
        self.identity = identity
        self.config = config
        self.key_offsets = config.policy.key_offsets if key_offsets is None else key_offsets
        self.pools: dict[str, Pool] = {}
        #: per format, the pool new saves of it go to (offset pools once calibrated)
        self._active: dict[str, Pool] = {}
        self._lock = threading.RLock()
        self._ids: dict[bytes, tuple[Pool, int]] = {}  # key -> (pool, block id)
        self._pin_until: dict[bytes, float] = {}  # key -> when a hint's pin ends (monotonic)
        self._kept: set[bytes] = set()  # pinned through a session's pause (keep())
        self._sources: dict[bytes, str | None] = {}  # key -> source layer (metrics)
        #: key -> the rules' format of a block stored above it while there was room
        self._upgraded: dict[bytes, str] = {}
        self._demoting = False
        self.num_saved = 0
        self.num_loaded = 0
        self.stats = StatsRecorder(layer_names(config.default_source_layer))
        self.shadows = PoolShadows(self, identity, config, self.stats, self._lock)
        self.shared = SharedBlocks(self, identity, self._lock)
        self.pool(identity, None)  # the key identity's pool: small saves, old sessions

    # ------------------------------------------------------------------ pools
    @property
    def cache(self) -> TQGPUCache:
        """The cache of the key identity's pool."""
        return self.pool(self.identity, None).cache

    @property
    def pins(self) -> PrefixPinManager:
        return self.pool(self.identity, None).pins

    def pool(self, identity: CacheIdentity, offsets: torch.Tensor | None) -> Pool:
        """The pool of ``identity``, created (and shadowed, when shadowing) if new."""
        with self._lock:
            pool = self.pools.get(pool_suffix(self.identity, identity))
            if pool is not None:
                if pool.identity != identity:  # an 8-hex-digit digest prefix collision
                    raise CacheIdentityError(f"pool {pool.name!r} already holds another "
                                             "identity; restart the server to recalibrate")
                return pool
            config = self.config
            pool = Pool.create(self.identity, identity, offsets,
                               host_blocks=config.host_blocks,
                               device_blocks=config.device_blocks, device=config.device,
                               pins=config.pins, eviction=config.eviction)
            self.pools[pool.name] = pool
            self.shadows.pool_made(pool)
            return pool

    def _save_pool(self, fmt: str, k: torch.Tensor, index: Sequence[int]) -> Pool:
        """The pool blocks ``index`` of ``k`` in format ``fmt`` go to (caller holds the lock)."""
        active = self._active.get(fmt)
        if active is not None:
            return active
        if self.key_offsets and fmt in OFFSET_FORMATS:
            # per-head key means do not depend on the format: once one format's pool is
            # calibrated, the others take its offsets (a small save is enough then)
            calibrated = next((p.cache.key_offsets for p in self._active.values()
                               if p.cache.key_offsets is not None), None)
            if calibrated is None and len(index) < CALIBRATION_BLOCKS:
                return self.pool(pool_identity(self.identity, fmt), None)
            offsets = calibrated if calibrated is not None else calibrate_offsets(k, index)
            pool = self.pool(pool_identity(self.identity, fmt, offsets), offsets)
            logger.info("format %s: key offsets %s (pool %s)", fmt,
                        "of another format's pool" if calibrated is not None
                        else f"calibrated on {len(index)} blocks", pool.name)
        else:
            pool = self.pool(pool_identity(self.identity, fmt), None)
        self._active[fmt] = pool
        return pool

    def adopt(self, pool: Pool, block_ids: Iterable[int | None]) -> None:
        """Index blocks recovered into ``pool`` (None entries: not recovered), and make
        it its format's active pool if none is and its offsets match the policy."""
        with self._lock:
            wants_offsets = self.key_offsets and pool.fmt in OFFSET_FORMATS
            if (pool.fmt not in self._active
                    and bool(pool.identity.key_offset_digest) == wants_offsets):
                self._active[pool.fmt] = pool
            for bid in block_ids:
                if bid is None:
                    continue
                meta = pool.cache.metadata.get(bid)
                if meta.key is not None:
                    self.index_block(bytes(meta.key), pool, bid, meta.source_layer or None)

    def entry(self, key: bytes) -> tuple[Pool, int] | None:
        """The pool and block id holding ``key``; None when not held."""
        return self._ids.get(key)

    def index_block(self, key: bytes, pool: Pool, bid: int, source_layer: str | None) -> None:
        """Record that block ``bid`` of ``pool`` holds ``key`` (caller holds the lock)."""
        self._ids[key] = (pool, bid)
        self._sources[key] = source_layer

    def format_stats(self) -> dict[str, dict[str, Any]]:
        """Per format of the held blocks: ``blocks``, ``bytes``, ``bytes_per_token`` and
        ``vs_fp16`` (bytes per token over fp16 K/V, ``2 * 2 * L * H * D``)."""
        with self._lock:
            counts = [(pool.identity, len(pool.cache.metadata)) for pool in self.pools.values()]
        return format_summary(self.identity, [c for c in counts if c[1]])

    # ------------------------------------------------------------------ start / stop
    def restore_local(self) -> RecoveryReport | None:
        """See :meth:`.store_shadow.PoolShadows.restore_local`."""
        return self.shadows.restore_local()

    def open_shadow(self, restored: bool) -> None:
        """See :meth:`.store_shadow.PoolShadows.open_shadow`."""
        self.shadows.open_shadow(restored)

    def close(self) -> None:
        """See :meth:`.store_shadow.PoolShadows.close`."""
        self.shadows.close()

    @property
    def shadowing(self) -> bool:
        """Whether any pool is shadowed."""
        return self.shadows.shadowing

    @property
    def shadow(self) -> CacheShadow | None:
        """The shadow of the key identity's pool (else of the first shadowed pool)."""
        return self.shadows.shadow

    def shadow_now(self) -> ShadowResult | None:
        """See :meth:`.store_shadow.PoolShadows.shadow_now`."""
        return self.shadows.shadow_now()

    def shadow_stats(self, now: float | None = None) -> tuple[int, float]:
        """See :meth:`.store_shadow.PoolShadows.shadow_stats`."""
        return self.shadows.shadow_stats(now)

    def take_stats(self) -> dict[str, Any] | None:
        """The worker side's metrics since the last call (see :mod:`.metrics`); with a
        shadow, always the current shadow lag."""
        if self.shadowing:
            nbytes, lag = self.shadow_stats()
            self.stats.count("shadow_bytes", nbytes)
            self.stats.set_gauge("shadow_lag_seconds", lag)
        return self.stats.take()

    def warm_up(self) -> None:
        """Compile the fused CPU kernels of every format now rather than on the first
        request (not needed when every block is stored native)."""
        if self.identity.codec == "native" and self.config.policy.default == "native":
            return
        formats.warm_up(self.cache.codec)

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._ids)

    # ------------------------------------------------------------------ save
    def save(self, k: torch.Tensor, v: torch.Tensor, keys: Sequence[bytes], tenant: str,
             labels: Sequence[BlockLabel]) -> SaveResult:
        """Encode blocks into the store under their keys, each in its label's format.

        Args:
            k, v: ``[num_layers, n, block_size, num_kv_heads, head_dim]`` (any float dtype).
            keys: one key per block; keys already held are skipped.
            tenant: owner of the blocks, vLLM's ``cache_salt`` (keys are salted with
                it; the cache records it as :func:`tenant_slug`).
            labels: one semantic label per block; ``label.fmt`` picks the block's
                format (its pool).

        Returns:
            Stored keys, keys evicted to make room, keys not stored (no room), each in
            the order of ``keys``.

        Raises:
            ValueError: K/V of the wrong shape, or a label of an unknown format.
        """
        ident = self.identity
        want = (ident.num_layers, len(keys), ident.block_size, ident.num_kv_heads, ident.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"k/v must be {want}, got {tuple(k.shape)} / {tuple(v.shape)}")
        result = SaveResult()
        tenant = tenant_slug(tenant)
        with self._lock:
            self._expire_pins(time.monotonic())
            new = [i for i, key in enumerate(keys) if key not in self._ids]
            for i in new:
                formats.check_format(labels[i].fmt)
                if labels[i].room_fmt is not None:
                    formats.check_format(labels[i].room_fmt)
            skipped = self._skip_tail(labels, new)
            if skipped:
                new = [i for i in new if i not in skipped]
                result.skipped = [keys[i] for i in sorted(skipped)]
                self.stats.count("skipped_blocks", len(skipped))
            room = self._room_formats(labels, new)
            groups: dict[str, list[int]] = {}
            for i in new:
                groups.setdefault(room.get(i, labels[i].fmt), []).append(i)
            if not groups:
                return result
            stored: list[int] = []
            failed: list[int] = []
            stored_at = time.monotonic()
            mine: dict[int, set[int]] = {}  # id(pool) -> block ids this save stored
            for fmt, index in groups.items():
                pool = self._save_pool(fmt, k, index)
                if self._save_into(pool, fmt, k, v, keys, index, tenant, labels, mine,
                                   result):
                    stored.extend(index)
                else:
                    failed.extend(index)
            done = set(stored)
            for i in room:
                if i in done:
                    self._upgraded[keys[i]] = labels[i].fmt
            result.stored = [keys[i] for i in sorted(stored)]
            result.failed = [keys[i] for i in sorted(failed)]
            result.removed, result.removed_layers = self.forget_evicted()
            self.num_saved += len(result.stored)
            self.stats.count_layers("saved_blocks",
                                    [self._sources[key] for key in result.stored])
            self.shadows.saved(result.stored, result.removed, stored_at)
        return result

    @property
    def budget(self) -> int:
        """The DDR byte budget: ``host_blocks`` blocks of the key identity's format."""
        return self.config.host_blocks * self.identity.bytes_per_block

    def _skip_tail(self, labels: Sequence[BlockLabel], new: list[int]) -> set[int]:
        """The volatile-tail blocks of a save not to store (caller holds ``_lock``): all
        of them when the save's new blocks, in their rules' formats, would not fit the
        DDR budget beside what it holds, so storing them would evict; else none. The
        next call of their sender changes them, so under pressure they are worth less
        than any block a later prompt can reuse (``store_volatile`` = ``"always"``:
        never skipped)."""
        tail = {i for i in new if labels[i].tail}
        if not tail or self.config.store_volatile == "always":
            return set()
        sizes = {fmt: pool_identity(self.identity, fmt).bytes_per_block
                 for fmt in {labels[i].fmt for i in new}}
        need = sum(sizes[labels[i].fmt] for i in new)
        if held_bytes(list(self.pools.values())) + need <= self.budget:
            return set()
        return tail

    def _room_formats(self, labels: Sequence[BlockLabel], new: list[int]) -> dict[int, str]:
        """Blocks of a save to store in their label's ``room_fmt`` (caller holds _lock):
        all of them when the save fits the DDR budget that way, else none (see
        :func:`.headroom.room_formats`). On CUDA saves go to the device tier, which
        spills by its own policy: no room formats there."""
        if self.cache.device.type != "cpu":
            return {}
        return room_formats(labels, new, held_bytes(list(self.pools.values())), self.budget,
                            lambda fmt: pool_identity(self.identity, fmt).bytes_per_block)

    def _fit_budget(self, pool: Pool, num_blocks: int,
                    protect: dict[int, set[int]]) -> bool:
        """Make room for ``num_blocks`` blocks of ``pool`` within the store's byte budget
        (``host_blocks`` blocks of the key identity's format): first by transcoding
        blocks stored above their format back down (:meth:`_demote`), then by evicting
        across pools, never ``protect`` (see :func:`.pools.fit_budget`; caller holds
        ``_lock``)."""
        if self._upgraded and not self._demoting and pool.save_tier is Tier.HOST:
            excess = (held_bytes(list(self.pools.values()))
                      + num_blocks * pool.identity.bytes_per_block - self.budget)
            if excess > 0:
                self._demote(excess, protect)
        # listed after _demote: a demotion may make a pool (the first of its blocks'
        # rules' format), whose bytes and blocks the eviction must count
        return fit_budget(list(self.pools.values()), pool, num_blocks, self.budget, protect)

    def _demote(self, excess: int, protect: dict[int, set[int]]) -> None:
        """Transcode upgraded blocks to their rules' format, lowest eviction priority
        first, until ``excess`` bytes are free or none is left (caller holds _lock).

        A block keeps its key, tenant, label and recency; one that cannot be stored
        again is gone, as if evicted (the save that follows reports it removed)."""
        chosen: dict[tuple[int, str, str], list[BlockMeta]] = {}
        pools: dict[int, Pool] = {}
        base_bytes: dict[str, int] = {}  # a block's bytes in each rules' format
        freed = 0
        for pool, meta in demotion_candidates(list(self.pools.values()), self._upgraded,
                                              protect):
            if freed >= excess:
                break
            assert meta.key is not None
            fmt = self._upgraded[bytes(meta.key)]
            chosen.setdefault((id(pool), fmt, meta.tenant_slug), []).append(meta)
            pools[id(pool)] = pool
            if fmt not in base_bytes:
                base_bytes[fmt] = pool_identity(self.identity, fmt).bytes_per_block
            freed += pool.identity.bytes_per_block - base_bytes[fmt]
        self._demoting = True
        try:
            for (pool_id, fmt, tenant), metas in chosen.items():
                self._transcode(pools[pool_id], fmt, tenant, metas, protect)
        finally:
            self._demoting = False

    def _transcode(self, pool: Pool, fmt: str, tenant: str, metas: list[BlockMeta],
                   protect: dict[int, set[int]]) -> None:
        """Move upgraded blocks of one pool and tenant into format ``fmt`` in one pass."""
        keys = [bytes(m.key) for m in metas if m.key is not None]
        bids = [m.block_id for m in metas]
        with pool.cache.locked():
            k, v = decode_pool_blocks(pool, pool.cache.export_blocks(bids))
            pool.cache.remove_blocks(bids)
        pool.dirty = True
        for key in keys:
            del self._upgraded[key]
        index = list(range(len(keys)))
        target = self._save_pool(fmt, k, index)
        labels = [BlockLabel(m.source_layer, m.importance, fmt=fmt) for m in metas]
        # the save's blocks stay protected; the transcoded ones are not (they may go next)
        mine = {pool_id: set(ids) for pool_id, ids in protect.items()}
        if not self._save_into(target, fmt, k, v, keys, index, tenant, labels, mine,
                               SaveResult()):
            return  # gone: forget_evicted reports the keys removed
        for key, meta in zip(keys, metas, strict=True):
            moved = target.cache.metadata.get(self._ids[key][1])
            for name in ("created_at", "last_attended", "eviction_priority",
                         "prefix_priority", "prefix_importance", "token_range"):
                setattr(moved, name, getattr(meta, name))
        self.stats.count("demoted_blocks", len(keys))

    def _save_into(self, pool: Pool, fmt: str, k: torch.Tensor, v: torch.Tensor,
                   keys: Sequence[bytes], index: list[int], tenant: str,
                   labels: Sequence[BlockLabel], protect: dict[int, set[int]],
                   result: SaveResult) -> bool:
        """Encode blocks ``index`` into ``pool`` (caller holds ``_lock``); False: no room.
        ``protect`` (``id(pool)`` -> block ids) holds this save's blocks, which making
        room never evicts; the new ones are added to it. Blocks labelled pinned that
        cannot be pinned are stored unpinned, and ``result.unpinned`` says why."""
        ident, cache = pool.identity, pool.cache
        bs = ident.block_size
        if not self._fit_budget(pool, len(index), protect):
            return False
        with cache.locked():
            blocks = RequestBlockManager(cache)
            got = blocks.allocate(len(index), tenant, tier=pool.save_tier, annotations=[
                BlockAnnotation(source_layer=labels[i].source_layer,
                                importance=labels[i].importance, num_tokens=bs)
                for i in index])
            if got is None:
                return False
            ids = got.block_ids
            protect.setdefault(id(pool), set()).update(ids)
            slots = torch.tensor([cache.metadata.get(b).slot for b in ids], dtype=torch.int64,
                                 device=cache.device)
            token_slots = (slots[:, None] * bs + torch.arange(bs, device=cache.device)).reshape(-1)
            sel = torch.tensor(index, dtype=torch.int64, device=k.device)
            shape = (-1, ident.num_kv_heads, ident.head_dim)
            for layer in range(ident.num_layers):
                kl = k[layer].index_select(0, sel).reshape(shape).to(cache.device, torch.float32)
                vl = v[layer].index_select(0, sel).reshape(shape).to(cache.device, torch.float32)
                formats.encode_into(fmt, kl, vl, token_slots,
                                    cache.layer_view(layer, pool.save_tier), cache.codec,
                                    key_offset=cache.key_offset(layer))
            pool.dirty = True
            blocks.set_keys(ids, [BlockHash(keys[i]) for i in index])  # K/V written: findable
            to_pin: list[int] = []
            hinted: list[tuple[bytes, int]] = []
            until: dict[bytes, float] = {}
            for bid, i in zip(ids, index, strict=True):
                self._ids[keys[i]] = (pool, bid)
                self._sources[keys[i]] = labels[i].source_layer
                keep = labels[i].keep_s
                if labels[i].pinned and keep is None:
                    to_pin.append(bid)
                elif labels[i].pinned and keep is not None:
                    hinted.append((keys[i], bid))
                    until[keys[i]] = time.monotonic() + keep
            if to_pin:
                try:
                    pool.pins.pin(to_pin)
                except (PinCapacityError, BlockStateError) as exc:
                    result.unpinned = unpinned_reason(self.config, self.identity, pool, tenant,
                                                      len(to_pin), exc)
            if hinted:  # a hint's pins: any layer, for their time
                pinned, failure = self._pin_timed(pool, tenant, hinted, until)
                if failure is not None:
                    result.unpinned = unpinned_reason(self.config, self.identity, pool, tenant,
                                                      len(hinted), failure)
                self.stats.count("hint_pinned_blocks", len(pinned))
                self.stats.count("hint_pins_refused", len(hinted) - len(pinned))
        return True

    def _pin_timed(self, pool: Pool, slug: str, blocks: Sequence[tuple[bytes, int]],
                   until: Mapping[bytes, float]) -> tuple[list[bytes], Exception | None]:
        """Pin ``blocks`` ((key, id) of ``pool``, in order) until ``until[key]``, any
        layer, as many as the tenant's pin quota leaves room for, the first first
        (caller holds ``_lock``); the keys pinned, and why none was if pinning failed."""
        room = pool.pins.tenant_quota - pool.pins.pinned_by_tenant().get(slug, 0)
        fits = list(blocks[:max(0, room)])
        if not fits:
            return [], None
        others = {m.block_id for m in pool.cache.metadata.pinned() if m.tenant_slug != slug}
        try:
            pool.pins.pin([bid for _, bid in fits], any_layer=True, demote_others=False)
        except (PinCapacityError, BlockStateError) as exc:
            return [], exc
        finally:  # counted, not assumed: another tenant's pins a hint unpinned or evicted
            self.stats.count("hint_other_pins_lost", len(others - {
                m.block_id for m in pool.cache.metadata.pinned() if m.tenant_slug != slug}))
        for key, _ in fits:
            self._pin_until[key] = until[key]
        return [key for key, _ in fits], None

    def _unpin_timed(self, key: bytes) -> None:
        """Drop block ``key``'s timed pin (caller holds ``_lock``)."""
        self._pin_until.pop(key, None)
        self._kept.discard(key)
        held = self._ids.get(key)
        if held is not None and held[1] in held[0].cache.metadata:
            held[0].pins.unpin([held[1]])

    def _expire_pins(self, now: float) -> None:
        """Unpin the blocks whose hint's time ran out (caller holds ``_lock``): they
        are ordinary blocks again, evicted by meaning like any other."""
        for key in [key for key, until in self._pin_until.items() if until <= now]:
            self._unpin_timed(key)

    def keep(self, keys: Sequence[bytes], tenant: str, keep_s: float) -> int:
        """Pin the held blocks of ``keys`` (a prefix chain: from the first, up to the
        first one not held) for ``keep_s`` seconds, any layer, as many as the tenant's
        pin quota leaves room for; ``keep_s`` 0 releases the pins an earlier keep
        made. Blocks pinned for good stay so. Returns the blocks pinned (or released)."""
        slug = tenant_slug(tenant)
        with self._lock:
            self._expire_pins(time.monotonic())
            held = self._held_prefix(keys, slug)
            if not keep_s:
                mine = [key for key, _, _ in held if key in self._kept]
                for key in mine:
                    self._unpin_timed(key)
                self.stats.count("pause_released_blocks", len(mine))
                return len(mine)
            until = dict.fromkeys((key for key, _, _ in held), time.monotonic() + keep_s)
            pinned = 0
            for pool in {id(p): p for _, p, _ in held}.values():
                todo = [(key, bid) for key, p, bid in held if p is pool
                        and not pool.cache.metadata.get(bid).pinned]
                kept, failure = self._pin_timed(pool, slug, todo, until)
                if failure is not None:
                    logger.info("session keep of %d blocks not pinned: %s", len(todo),
                                failure)
                self._kept.update(kept)
                pinned += len(kept)
            self.stats.count("pause_kept_blocks", pinned)
            self._warm_held(held)  # device first: what the quota left unpinned too
            return pinned

    def warm(self, keys: Sequence[bytes], tenant: str) -> int:
        """Bring the held blocks of ``keys`` (a prefix chain) of ``tenant`` back to the
        device tier ahead of their session's return (the pause look-ahead), as room
        allows, spilling the device tier's lowest-priority unpinned blocks; pins
        stay as they are. Returns the blocks moved."""
        with self._lock:
            return self._warm_held(self._held_prefix(keys, tenant_slug(tenant)))

    def _held_prefix(self, keys: Sequence[bytes], slug: str
                     ) -> list[tuple[bytes, Pool, int]]:
        """(key, pool, id) of the longest prefix of ``keys`` held for tenant ``slug``
        (caller holds ``_lock``): it ends at the first key not held, or another's."""
        held = []
        for key in keys:
            found = self._ids.get(key)
            if found is None or found[0].cache.lookup([BlockHash(key)], slug) != [found[1]]:
                break
            held.append((key, *found))
        return held

    def _warm_held(self, held: Sequence[tuple[bytes, Pool, int]]) -> int:
        """Move the DDR-tier blocks of ``held`` ((key, pool, id)) to their pool's device
        tier, the chain's first first, as many as it makes room for (caller holds
        ``_lock``); counted, returns how many."""
        moved = 0
        for pool in {id(p): p for _, p, _ in held}.values():
            on_host = [bid for _, p, bid in held if p is pool
                       and pool.cache.metadata.get(bid).tier is Tier.HOST]
            n = len(on_host)
            while n:  # the room of a tier full of pins: halve until it fits
                got = pool.cache.warm_blocks(on_host[:n])
                if got is not None:
                    moved += len(got)
                    break
                n //= 2
        self.stats.count("pause_warmed_blocks", moved)
        return moved

    def expire_pins(self) -> None:
        """Unpin the blocks whose hint's time ran out (a save does it too)."""
        with self._lock:
            self._expire_pins(time.monotonic())

    def pinned_until(self, key: bytes) -> float | None:
        """When the hint's pin of block ``key`` ends (monotonic), if it has one."""
        return self._pin_until.get(key)

    def forget_evicted(self) -> tuple[list[bytes], list[str | None]]:
        """Forget the blocks the pools evicted (to make room for a save or an import)
        and count them by layer; returns their keys and layers."""
        gone = [key for key, (pool, bid) in self._ids.items() if bid not in pool.cache.metadata]
        for key in gone:
            del self._ids[key]
            self._upgraded.pop(key, None)
        layers = [self._sources.pop(key, None) for key in gone]
        self.stats.count_layers("evicted_blocks", layers)
        return gone, layers

    # ------------------------------------------------------------------ shared tier
    def export_chunk(self, keys: Sequence[bytes], tenant: str, path: str
                     ) -> SharedChunk | None:
        """See :meth:`.store_shared.SharedBlocks.export_chunk`."""
        return self.shared.export_chunk(keys, tenant, path)

    def import_chunk(self, chunk: SharedChunk, want: Sequence[bytes]
                     ) -> tuple[list[bytes], list[bytes]]:
        """See :meth:`.store_shared.SharedBlocks.import_chunk`."""
        return self.shared.import_chunk(chunk, want)

    def held_bytes(self) -> int:
        """Bytes the DDR tier holds (every pool)."""
        with self._lock:
            return held_bytes(list(self.pools.values()))

    def missing(self, keys: Iterable[bytes]) -> set[bytes]:
        """The keys of ``keys`` the store does not hold."""
        with self._lock:
            return {key for key in keys if key not in self._ids}

    # ------------------------------------------------------------------ load
    def read(self, keys: Sequence[bytes], tenant: str
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Decode the longest held prefix of ``keys`` (across pools).

        Returns:
            ``(k, v)`` float32 ``[num_layers, n, block_size, num_kv_heads, head_dim]``
            for the first ``n`` keys (``n`` may be smaller than ``len(keys)``), or None
            when the first key is not held. Keys are the keys: pools with key offsets
            add them back.
        """
        parts = self.read_parts(keys, tenant)
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0][1], parts[0][2]
        return assemble_parts(parts, sum(len(positions) for positions, _, _ in parts))

    def read_parts(self, keys: Sequence[bytes], tenant: str
                   ) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
        """:meth:`read` without reassembly: per pool holding blocks of the prefix,
        ``(positions, k, v)`` with the positions (into ``keys``) of its blocks and their
        K/V ``[num_layers, len(positions), block_size, H, D]``. The positions of all
        parts are ``0 .. n-1`` once each; empty when the first key is not held."""
        return [(positions, *decode_pool_blocks(pool, data))
                for pool, positions, data in self.export_parts(keys, tenant)]

    def export_all(self, keys: Sequence[bytes], tenant: str
                   ) -> list[tuple[Pool, list[int], dict[str, torch.Tensor]]] | None:
        """:meth:`export_parts` of every key, or None when the store does not hold all
        of them for ``tenant`` (a moved chunk needs every one of its source blocks)."""
        parts = self.export_parts(keys, tenant)
        return parts if sum(len(positions) for _, positions, _ in parts) == len(keys) else None

    def export_parts(self, keys: Sequence[bytes], tenant: str
                     ) -> list[tuple[Pool, list[int], dict[str, torch.Tensor]]]:
        """The stored bytes of the longest held prefix of ``keys``, not decoded: per pool
        holding blocks of it, ``(pool, positions, exported)`` (``exported``: the pool's
        :meth:`~gpu_cache.TQGPUCache.export_blocks` of those blocks, layer-major). The
        connector decodes each layer straight into vLLM's pages
        (:func:`~integrations.vllm.pools.decode_pool_layer_into`)."""
        slug = tenant_slug(tenant)
        parts: dict[str, tuple[Pool, list[int], list[int]]] = {}  # name -> pool, positions, ids
        exported: list[tuple[Pool, list[int], dict[str, torch.Tensor]]] = []
        with self._lock:
            held = self._held_prefix(keys, slug)
            for n, (_, pool, bid) in enumerate(held):
                part = parts.setdefault(pool.name, (pool, [], []))
                part[1].append(n)
                part[2].append(bid)
            n = len(held)
            self.stats.count("loaded_blocks", n)
            self.stats.count("hit_tokens", n * self.identity.block_size)
            self.stats.count("load_errors", len(keys) - n)
            for pool, positions, bids in parts.values():
                with pool.cache.locked():
                    pool.cache.metadata.touch(bids)
                    # layer-major CPU copies of the bytes
                    exported.append((pool, positions, pool.cache.export_blocks(bids)))
        self.num_loaded += n
        return exported


