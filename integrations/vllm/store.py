"""Worker-side block store of the vLLM connector: contextkit's tiers plus the shadow.

Holds a :class:`gpu_cache.TQGPUCache` (device tier + DDR tier, semantic eviction,
prefix pins) whose blocks are keyed by contextkit's block keys, and a
:class:`shadow.CacheShadow` that makes them durable. Free of vLLM imports: the
connector hands it K/V as ``[num_layers, n, block_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gpu_cache import (
    BlockStateError,
    CacheConfig,
    CacheIdentity,
    CacheIdentityError,
    InvalidNameError,
    PinCapacityError,
    PrefixPinManager,
    Tier,
    TQGPUCache,
    validate_tenant,
)
from gpu_cache.codec import TQ4Encoded
from gpu_cache.hashing import BlockHash
from gpu_cache.kernels import quantize_into_cache
from integrations.vllm.config import ConnectorConfig
from integrations.vllm.metrics import StatsRecorder, layer_names
from integrations.vllm.planning import BlockLabel
from shadow import (
    CacheShadow,
    Manifest,
    RecoveryReport,
    ShadowConfig,
    ShadowError,
    ShadowResult,
    StoreConfig,
    open_store,
    recover_session,
)

__all__ = ["ConnectorStore", "SaveResult", "local_session_keys", "shadow_manifest", "tenant_slug"]

logger = logging.getLogger(__name__)


def tenant_slug(cache_salt: str) -> str:
    """The cache tenant of a vLLM ``cache_salt``: the salt itself when it follows
    contextkit's naming rule (as the pipeline's tenants do), else a stable digest of
    it. vLLM allows any salt; block keys are salted with the raw salt either way."""
    try:
        return validate_tenant(cache_salt)
    except InvalidNameError:
        return "salt-" + hashlib.sha256(cache_salt.encode()).hexdigest()[:40]

#: Session name of the verified snapshot ``contextkit recover --for-vllm`` writes.
LOCAL_SESSION = "vllm-recovered"


@dataclass(slots=True)
class SaveResult:
    """Keys a save stored, keys its allocation evicted, keys it could not store."""

    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    failed: list[bytes] = field(default_factory=list)
    #: source layer of each ``removed`` key (None: unknown)
    removed_layers: list[str | None] = field(default_factory=list)


def local_session_keys(local_store: str, identity: CacheIdentity) -> list[bytes]:
    """Keys of the verified snapshot in ``local_store`` (empty if absent or for another
    identity). The scheduler seeds its index with them."""
    from shadow import BlobNotFoundError, load_manifest

    if not local_store:
        return []
    store = open_store(local_store)
    try:
        manifest = load_manifest(store, LOCAL_SESSION)
    except BlobNotFoundError:
        return []
    except ShadowError as exc:
        logger.warning("local store %s unreadable (%s); starting cold", local_store, exc)
        return []
    finally:
        store.close()
    if manifest.identity != identity:
        return []  # the worker refuses it too (and says why)
    return [bytes.fromhex(b.key) for b in manifest.blocks if b.key is not None]


def shadow_manifest(config: ConnectorConfig) -> Manifest | None:
    """The connector's last committed shadow of its store, read-only (another process
    may be serving): one record per stored block with its key, source layer,
    importance, tenant and pin flag. None when the config has no shadow or nothing
    has been shadowed yet.

    With ``shadow_on_save`` (the default) the connector shadows after every save, so
    this is its store as of the last save: what an operator or a test can inspect
    while vLLM runs. Block keys are :func:`gpu_cache.hash_token_blocks` of the
    request's tokens, salted with its ``cache_salt``.

    Raises:
        shadow.ShadowError: the manifest exists but cannot be read or trusted.
    """
    from shadow import BlobNotFoundError, ShadowStoreError, load_manifest

    if not config.shadow_url:
        return None
    try:
        store = open_store(config.shadow_url, StoreConfig(endpoint_url=config.endpoint_url),
                           create=False)
    except ShadowStoreError:
        return None  # a file:// shadow not created yet
    try:
        return load_manifest(store, config.session_id)
    except BlobNotFoundError:
        return None
    finally:
        store.close()


class ConnectorStore:
    """Blocks by key in contextkit's tiers, shadowed to ``config.shadow_url``.

    Args:
        identity: the cache identity (model, block size, codec).
        config: tier sizes, shadow and local store.

    Attributes:
        stats: the worker side's metrics (loads, saves, evictions, shadow); see
            :meth:`take_stats`.

    Saves go to the DDR tier on CPU (both tiers are RAM; DDR is where stored
    blocks belong) and to the device tier on CUDA (fused quantization on the GPU;
    the semantic policy spills them to pinned DDR as the device tier fills).
    """

    def __init__(self, identity: CacheIdentity, config: ConnectorConfig) -> None:
        self.identity = identity
        self.config = config
        self.cache = TQGPUCache(identity, CacheConfig(
            num_device_blocks=config.device_blocks, num_host_blocks=config.host_blocks,
            device=config.device))
        self.save_tier = Tier.HOST if self.cache.device.type == "cpu" else Tier.DEVICE
        self.pins = PrefixPinManager(self.cache)
        self.shadow: CacheShadow | None = None
        self._lock = threading.RLock()
        self._ids: dict[bytes, int] = {}  # key -> block id, to notice evictions
        self._sources: dict[bytes, str | None] = {}  # key -> source layer (metrics)
        self.num_saved = 0
        self.num_loaded = 0
        self.stats = StatsRecorder(layer_names(config.default_source_layer))
        # shadow accounting (metrics), under its own lock: never waits for a save
        self._stats_lock = threading.Lock()
        self._unshadowed: dict[bytes, float] = {}  # key -> monotonic time stored, oldest first
        self._seen_manifest: object = None
        self._counted_result: ShadowResult | None = None
        self._shadow_bytes = 0

    # ------------------------------------------------------------------ start / stop
    def warm_up(self) -> None:
        """Compile the codec's fused CPU kernels now rather than on the first request."""
        if self.identity.codec == "tq4":
            codec = self.cache.codec
            x = torch.randn(512, self.identity.head_dim, device=codec.device)
            codec.decode(codec.encode(x))

    def restore_local(self) -> RecoveryReport | None:
        """Load the verified snapshot from ``config.local_store`` into the DDR tier.

        A snapshot of another identity is refused (logged, nothing loaded): vLLM then
        recomputes instead of reading wrong KV. Corrupt blocks are skipped.
        """
        if not self.config.local_store:
            return None
        from shadow import BlobNotFoundError

        store = open_store(self.config.local_store)
        try:
            report = recover_session(store, LOCAL_SESSION, self.cache, repin=True)
        except BlobNotFoundError:
            logger.info("no recovered snapshot in %s; starting cold (run `contextkit "
                        "recover --for-vllm` before `vllm serve`)", self.config.local_store)
            return None
        except (CacheIdentityError, ShadowError) as exc:
            logger.error("refusing the snapshot in %s: %s", self.config.local_store, exc)
            return None
        finally:
            store.close()
        with self._lock:
            for ids in report.block_ids.values():
                for bid in ids:
                    if bid is not None:
                        self._remember(bid)
        logger.info("restored %d blocks (%d skipped) from %s", report.blocks,
                    report.num_skipped, self.config.local_store)
        return report

    def open_shadow(self, restored: bool) -> None:
        """Start shadowing to ``config.shadow_url`` under ``config.session_id``.

        Args:
            restored: the local snapshot was loaded. Then the session's blocks are in
                the cache and the next shadow is incremental. Otherwise an existing
                session is recovered straight from the shadow first, so a restart
                without the recovery job never shadows an empty cache over it.
        """
        if not self.config.shadow_url:
            return
        interval = self.config.shadow_interval_s
        try:
            shadow = CacheShadow(
                self.cache, self.config.shadow_url, self.config.session_id,
                config=ShadowConfig(interval_seconds=interval or 60.0, autostart=False),
                store_config=StoreConfig(endpoint_url=self.config.endpoint_url))
        except (CacheIdentityError, ShadowError) as exc:
            # Never overwrite (or read) a session of another model: serve unshadowed.
            logger.error("shadowing disabled: %s (give this server its own session_id or "
                         "shadow_url)", exc)
            return
        if shadow.manifest is not None and shadow.manifest.blocks and not restored:
            logger.warning("session %s was not restored by `contextkit recover --for-vllm`; "
                           "recovering it inside the engine", self.config.session_id)
            report = shadow.recover_session()
            with self._lock:
                for ids in report.block_ids.values():
                    for bid in ids:
                        if bid is not None:
                            self._remember(bid)
        elif shadow.manifest is not None:
            shadow.shadow_now()  # the restored blocks are the session: commit, incrementally
        if interval:
            shadow.start()
        self.shadow = shadow

    def _remember(self, bid: int) -> None:
        """Index a block recovered into the cache (caller holds ``_lock``)."""
        meta = self.cache.metadata.get(bid)
        if meta.key is not None:
            self._ids[bytes(meta.key)] = bid
            self._sources[bytes(meta.key)] = meta.source_layer or None

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._ids)

    # ------------------------------------------------------------------ shadow stats
    def shadow_now(self) -> ShadowResult | None:
        """Shadow now (None without a shadow); its bytes count in :meth:`shadow_stats`."""
        shadow = self.shadow
        if shadow is None:
            return None
        result = shadow.shadow_now()
        self._note_shadow(shadow)
        return result

    def _note_shadow(self, shadow: CacheShadow) -> None:
        """Count the shadow's last result once, and clear the keys its manifest holds."""
        result, manifest = shadow.last_result, shadow.manifest
        with self._stats_lock:
            if result is not None and result is not self._counted_result:
                self._counted_result = result
                self._shadow_bytes += result.bytes_written + result.manifest_bytes
            if manifest is not None and manifest is not self._seen_manifest:
                self._seen_manifest = manifest
                if self._unshadowed:
                    for record in manifest.blocks:
                        if record.key is not None:
                            self._unshadowed.pop(bytes.fromhex(record.key), None)

    def shadow_stats(self, now: float | None = None) -> tuple[int, float]:
        """Shadow bytes written since the last call, and the shadow lag in seconds.

        The lag is the age of the oldest stored block that no committed manifest holds
        yet (0 when none is pending or there is no shadow). Shadows the periodic job
        ran are counted from the shadow's last result, polled here and after every
        :meth:`shadow_now`.
        """
        shadow = self.shadow
        if shadow is not None:
            self._note_shadow(shadow)
        now = time.monotonic() if now is None else now
        with self._stats_lock:
            nbytes, self._shadow_bytes = self._shadow_bytes, 0
            if shadow is None or not self._unshadowed:
                return nbytes, 0.0
            oldest = next(iter(self._unshadowed.values()))
        return nbytes, max(0.0, now - oldest)

    def take_stats(self) -> dict[str, Any] | None:
        """The worker side's metrics since the last call (see :mod:`.metrics`); with a
        shadow, always the current shadow lag."""
        if self.shadow is not None:
            nbytes, lag = self.shadow_stats()
            self.stats.count("shadow_bytes", nbytes)
            self.stats.set_gauge("shadow_lag_seconds", lag)
        return self.stats.take()

    def close(self) -> None:
        """Final shadow and stop; idempotent."""
        shadow, self.shadow = self.shadow, None
        if shadow is not None:
            try:
                shadow.close(final_shadow=True)
            except Exception:
                logger.exception("final shadow of session %s failed", self.config.session_id)

    # ------------------------------------------------------------------ save
    def save(self, k: torch.Tensor, v: torch.Tensor, keys: Sequence[bytes], tenant: str,
             labels: Sequence[BlockLabel]) -> SaveResult:
        """Quantize blocks into the store under their keys.

        Args:
            k, v: ``[num_layers, n, block_size, num_kv_heads, head_dim]`` (any float dtype).
            keys: one key per block; keys already held are skipped.
            tenant: owner of the blocks, vLLM's ``cache_salt`` (keys are salted with
                it; the cache records it as :func:`tenant_slug`).
            labels: one semantic label per block.

        Returns:
            Stored keys, keys evicted to make room, keys not stored (no room).
        """
        ident = self.identity
        want = (ident.num_layers, len(keys), ident.block_size, ident.num_kv_heads, ident.head_dim)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise ValueError(f"k/v must be {want}, got {tuple(k.shape)} / {tuple(v.shape)}")
        result = SaveResult()
        cache = self.cache
        tenant = tenant_slug(tenant)
        with self._lock, cache.locked():
            todo = [i for i, key in enumerate(keys) if key not in self._ids]
            if not todo:
                return result
            ids = cache.allocate(len(todo), self.save_tier, tenant=tenant)
            if ids is None:
                result.failed = [keys[i] for i in todo]
                return result
            slots = torch.tensor([cache.metadata.get(b).slot for b in ids], dtype=torch.int64,
                                 device=cache.device)
            bs = ident.block_size
            token_slots = (slots[:, None] * bs + torch.arange(bs, device=cache.device)).reshape(-1)
            index = torch.tensor(todo, dtype=torch.int64, device=k.device)
            for layer in range(ident.num_layers):
                kl = k[layer].index_select(0, index).reshape(-1, ident.num_kv_heads, ident.head_dim)
                vl = v[layer].index_select(0, index).reshape(-1, ident.num_kv_heads, ident.head_dim)
                kl, vl = kl.to(cache.device, torch.float32), vl.to(cache.device, torch.float32)
                view = cache.layer_view(layer, self.save_tier)
                if ident.codec == "native":
                    d = ident.head_dim
                    view.k_packed.view(-1, ident.num_kv_heads, d).index_copy_(0, token_slots, kl)
                    view.v_packed.view(-1, ident.num_kv_heads, d).index_copy_(0, token_slots, vl)
                else:
                    quantize_into_cache(kl, vl, token_slots, view.k_packed, view.k_norms,
                                        view.v_packed, view.v_norms, cache.codec,
                                        check_bounds=False)
            to_pin = []
            stored_at = time.monotonic()
            for bid, i in zip(ids, todo, strict=True):
                label = labels[i]
                cache.metadata.annotate(bid, source_layer=label.source_layer,
                                        importance=label.importance, tenant_slug=tenant,
                                        num_tokens=bs)
                cache.set_key(bid, BlockHash(keys[i]))
                self._ids[keys[i]] = bid
                self._sources[keys[i]] = label.source_layer
                result.stored.append(keys[i])
                if label.pinned:
                    to_pin.append(bid)
            if to_pin:
                try:
                    self.pins.pin(to_pin)
                except (PinCapacityError, BlockStateError) as exc:
                    logger.warning("blocks stored but not pinned: %s", exc)
            result.removed = self._forget_evicted()
            result.removed_layers = [self._sources.pop(key, None) for key in result.removed]
            self.num_saved += len(result.stored)
            self.stats.count_layers("saved_blocks",
                                    [self._sources[key] for key in result.stored])
            self.stats.count_layers("evicted_blocks", result.removed_layers)
            if self.shadow is not None:
                with self._stats_lock:
                    for key in result.stored:
                        self._unshadowed[key] = stored_at
                    for key in result.removed:
                        self._unshadowed.pop(key, None)
        return result

    def _forget_evicted(self) -> list[bytes]:
        gone = [key for key, bid in self._ids.items() if bid not in self.cache.metadata]
        for key in gone:
            del self._ids[key]
        return gone

    # ------------------------------------------------------------------ load
    def read(self, keys: Sequence[bytes], tenant: str
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Decode the longest held prefix of ``keys``.

        Returns:
            ``(k, v)`` float32 ``[num_layers, n, block_size, num_kv_heads, head_dim]``
            for the first ``n`` keys (``n`` may be smaller than ``len(keys)``), or None
            when the first key is not held.
        """
        cache = self.cache
        with self._lock, cache.locked():
            bids = cache.lookup([BlockHash(key) for key in keys], tenant_slug(tenant))
            self.stats.count("loaded_blocks", len(bids))
            self.stats.count("hit_tokens", len(bids) * self.identity.block_size)
            self.stats.count("load_errors", len(keys) - len(bids))
            if not bids:
                return None
            cache.metadata.touch(bids)
            exported = cache.export_blocks(bids)  # layer-major CPU copies of the bytes
        if self.identity.codec == "native":
            k, v = exported["k_packed"], exported["v_packed"]
        else:
            codec = cache.codec
            dev = codec.device
            k = codec.decode(TQ4Encoded(exported["k_packed"].to(dev), exported["k_norms"].to(dev)))
            v = codec.decode(TQ4Encoded(exported["v_packed"].to(dev), exported["v_norms"].to(dev)))
        self.num_loaded += len(bids)
        return k, v
