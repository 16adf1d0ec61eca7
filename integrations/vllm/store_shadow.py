"""The connector store's durability: the local snapshot it starts from, one shadow
session per pool, and the shadow's accounting. :class:`PoolShadows` is held by
:class:`integrations.vllm.store.ConnectorStore`, which owns the pools and the index
and reaches them to it through the :class:`PoolHost` interface."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Protocol

import torch

from gpu_cache import CacheIdentity, CacheIdentityError
from integrations.vllm.config import ConnectorConfig
from integrations.vllm.identity import check_same_model
from integrations.vllm.metrics import StatsRecorder
from integrations.vllm.pools import Pool, combine_results, server_sessions, session_name
from integrations.vllm.shadow_lag import ShadowAccounting
from integrations.vllm.snapshots import LOCAL_SESSION
from shadow import (
    CacheShadow,
    RecoveryReport,
    ShadowConfig,
    ShadowError,
    ShadowResult,
    StoreConfig,
    load_manifest,
    open_store,
    recover_session,
)

__all__ = ["PoolHost", "PoolShadows"]

logger = logging.getLogger(__name__)


class PoolHost(Protocol):
    """What :class:`PoolShadows` needs of the store that owns the pools and the index."""

    pools: dict[str, Pool]

    def pool(self, identity: CacheIdentity, offsets: torch.Tensor | None) -> Pool:
        """The pool of ``identity``, made (and shadowed, when shadowing) if new."""
        ...

    def adopt(self, pool: Pool, block_ids: Iterable[int | None]) -> None:
        """Index blocks recovered into ``pool`` (None entries: not recovered), and make
        it its format's active pool if none is and its key offsets fit the policy."""
        ...


class PoolShadows:
    """Restore from the local snapshot, shadow every pool, account for the shadow.

    Args:
        host: the store owning the pools and the block index.
        identity: the key identity (its pool keeps the plain session names).
        config: the shadow URL, session id, interval and local store.
        stats: the worker side's metrics (shadow bytes and lag go there).
        lock: the store's lock, guarding the pools and the index.
    """

    def __init__(self, host: PoolHost, identity: CacheIdentity, config: ConnectorConfig,
                 stats: StatsRecorder, lock: threading.RLock) -> None:
        self._host = host
        self.identity = identity
        self.config = config
        self.stats = stats
        self._lock = lock
        self._shadowing = False
        self._lag = ShadowAccounting()  # metrics; never waits for a save

    def restore_local(self) -> RecoveryReport | None:
        """Load the verified snapshot sessions from ``config.local_store`` into the DDR
        tier, each into the pool of its format and key offsets.

        A session of another model is refused (logged, nothing of it loaded): vLLM then
        recomputes instead of reading wrong KV; so is an unreadable one or one of a
        format this contextkit does not know, while the others still load. Corrupt
        blocks are skipped. Returns None when nothing was loaded.
        """
        if not self.config.local_store:
            return None
        where = self.config.local_store
        report = RecoveryReport()
        store = open_store(where)
        try:
            sessions = server_sessions(store, LOCAL_SESSION)
            for sid in sessions:
                try:
                    manifest = load_manifest(store, sid)
                    check_same_model(self.identity, manifest.identity,
                                     what=f"snapshot session {sid!r}")
                    pool = self._host.pool(manifest.identity, manifest.key_offsets_tensor())
                    got = recover_session(store, sid, pool.cache, repin=True)
                except (CacheIdentityError, ShadowError) as exc:
                    logger.error("refusing the snapshot %s in %s: %s", sid, where, exc)
                    report.errors[sid] = str(exc)
                    continue
                with self._lock:
                    pool.restored = True
                    self._host.adopt(pool, [bid for ids in got.block_ids.values() for bid in ids])
                report.merge(got)
        finally:
            store.close()
        if not sessions:
            logger.info("no recovered snapshot in %s; starting cold (run `contextkit "
                        "recover --for-vllm` before `vllm serve`)", where)
            return None
        if not report.sessions:
            return None
        logger.info("restored %d blocks (%d skipped) of %d session(s) from %s", report.blocks,
                    report.num_skipped, len(report.sessions), where)
        return report

    def open_shadow(self, restored: bool) -> None:
        """Start shadowing to ``config.shadow_url``: one session per pool (see
        :func:`.pools.session_name`), pools made later get theirs when made.

        Args:
            restored: the local snapshot was loaded (kept for callers: each pool
                knows whether it was). A pool loaded from it holds its session's
                blocks and shadows incrementally. The server's other
                sessions in the shadow store (a restart without the recovery job) are
                recovered straight from the shadow into their pools first, so an empty
                cache never shadows over them.
        """
        if not self.config.shadow_url:
            return
        from shadow import BlobNotFoundError, ShadowStoreError

        sid = self.config.session_id
        try:
            store = open_store(self.config.shadow_url,
                               StoreConfig(endpoint_url=self.config.endpoint_url), create=False)
        except ShadowStoreError:
            store = None  # a file:// shadow not created yet: nothing to pick up
        if store is not None:
            try:
                for name in server_sessions(store, sid):
                    try:
                        manifest = load_manifest(store, name)
                        check_same_model(self.identity, manifest.identity,
                                         what=f"shadow session {name!r}")
                        if session_name(sid, self.identity, manifest.identity) != name:
                            raise CacheIdentityError(
                                f"its blocks are {manifest.identity.codec} with key offsets "
                                f"{manifest.identity.key_offset_digest or 'none'}, which "
                                "its name does not say")
                        self._host.pool(manifest.identity, manifest.key_offsets_tensor())
                    except BlobNotFoundError:
                        continue
                    except (CacheIdentityError, ShadowError) as exc:
                        logger.error("shadow session %s left alone: %s (give this server its "
                                     "own session_id or shadow_url)", name, exc)
            finally:
                store.close()
        with self._lock:
            self._shadowing = True
            for pool in list(self._host.pools.values()):
                self._open_pool_shadow(pool)

    def pool_made(self, pool: Pool) -> None:
        """Shadow a pool the store just made, when shadowing (caller holds the lock)."""
        if self._shadowing:
            self._open_pool_shadow(pool)

    def saved(self, stored: list[bytes], removed: list[bytes], at: float) -> None:
        """Account a save's stored and evicted keys for the shadow lag (when shadowing)."""
        if self.shadowing:
            self._lag.saved(stored, removed, at)

    def _open_pool_shadow(self, pool: Pool) -> None:
        """Open ``pool``'s shadow session (caller holds the lock); recover its blocks
        first unless the local snapshot loaded them."""
        name = session_name(self.config.session_id, self.identity, pool.identity)
        interval = self.config.shadow_interval_s
        try:
            shadow = CacheShadow(
                pool.cache, self.config.shadow_url, name,
                # a pool empties when the store evicts (or transcodes) its last block:
                # its session must say so, or recovery brings those blocks back
                config=ShadowConfig(interval_seconds=interval or 60.0, autostart=False,
                                    allow_empty=True),
                store_config=StoreConfig(endpoint_url=self.config.endpoint_url))
        except (CacheIdentityError, ShadowError) as exc:
            # Never overwrite (or read) a session of another model: this pool is unshadowed.
            logger.error("shadowing of %s disabled: %s (give this server its own session_id "
                         "or shadow_url)", name, exc)
            return
        if shadow.manifest is not None and shadow.manifest.blocks and not pool.restored:
            logger.warning("session %s was not restored by `contextkit recover --for-vllm`; "
                           "recovering it inside the engine", name)
            report = shadow.recover_session()
            self._host.adopt(pool, [bid for ids in report.block_ids.values() for bid in ids])
        elif shadow.manifest is not None:
            shadow.shadow_now()  # the restored blocks are the session: commit, incrementally
        if interval:
            shadow.start()
        pool.shadow = shadow

    # ------------------------------------------------------------------ shadow stats
    @property
    def shadowing(self) -> bool:
        """Whether any pool is shadowed."""
        return any(pool.shadow is not None for pool in list(self._host.pools.values()))

    @property
    def shadow(self) -> CacheShadow | None:
        """The shadow of the key identity's pool (else of the first shadowed pool)."""
        pools = sorted(self._host.pools.values(), key=lambda p: p.name != "")
        return next((p.shadow for p in pools if p.shadow is not None), None)

    def shadow_now(self) -> ShadowResult | None:
        """Shadow every pool whose blocks changed since the last call now (None without
        a shadow or a change); the bytes count in :meth:`shadow_stats`. With several
        pools the result sums theirs. (The periodic shadow, ``shadow_interval_s``,
        runs per pool on its own.)"""
        results = []
        for pool in list(self._host.pools.values()):
            shadow = pool.shadow
            if shadow is None or not pool.dirty:
                continue
            pool.dirty = False  # a save from now on marks it again
            try:
                results.append(shadow.shadow_now())
            except BaseException:
                pool.dirty = True
                raise
            self._lag.note(pool, shadow)
        return combine_results(results)

    def shadow_stats(self, now: float | None = None) -> tuple[int, float]:
        """Shadow bytes written since the last call, and the shadow lag in seconds.

        The lag is the age of the oldest stored block that no committed manifest holds
        yet (0 when none is pending or there is no shadow). Shadows the periodic job
        ran are counted from each shadow's last result, polled here and after every
        :meth:`shadow_now` (see :class:`.shadow_lag.ShadowAccounting`).
        """
        return self._lag.take(list(self._host.pools.values()), now)

    def close(self) -> None:
        """Final shadow of every pool changed since the last shadow, and of the key
        identity's pool (its session, ``config.session_id``, always exists after a
        run, as with older connectors), then stop; idempotent."""
        with self._lock:
            self._shadowing = False
        for pool in list(self._host.pools.values()):
            shadow, pool.shadow = pool.shadow, None
            if shadow is not None:
                try:
                    shadow.close(final_shadow=pool.dirty or pool.name == "")
                except Exception:
                    logger.exception("final shadow of session %s failed", shadow.session_id)
