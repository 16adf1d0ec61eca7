"""CacheShadow: crash-safe, incremental shadows of a TQGPUCache to a store.

Write protocol of one shadow (the manifest put is the commit point)::

    1. new blocks -> one new immutable segment (four blobs) under names never used
       before (a random token), each streamed, fsynced and renamed into place (or a
       completed multipart upload on S3); with a key, each block record gets its MAC
    2. manifest.json -> written to a temp name, fsynced, atomically replaced; its
       generation is above every generation this writer or the store ever recorded
    3. head.json     -> the committed generation and manifest digest (freshness)
    4. index.json    -> updated last (a discovery hint)
    5. segments the new manifest no longer references are deleted

A crash before 2 leaves the previous manifest authoritative and at most some
unreferenced blobs, which the next writer (or ``contextkit recover``) deletes. A shadow
that fails anywhere leaves the writer uncertain of what was committed (a manifest PUT
whose response was lost may still have landed), so the next shadow first re-reads the
committed manifest and removes what it does not reference; since segments are never
rewritten under a name, nothing committed is ever overwritten. A block is matched to
the previous shadow by its content key; keyed blocks are immutable in the cache (content
addressing), so each is written once. Blocks without a key (still being filled) are
written on every shadow. When unreferenced bytes exceed ``compact_garbage_fraction`` of
what the segments hold, the shadow rewrites every live block into one fresh segment (a
compaction). A shadow that would commit no block over a session that holds some commits
nothing (a tenant filter that matches nothing never empties a session), unless the
config allows it (``allow_empty``: a cache whose blocks leave on purpose).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from gpu_cache import BlockMeta, InvalidNameError, TQGPUCache, validate_tenant
from shadow._chunk_index import ChunkSection
from shadow._errors import BlobNotFoundError, CorruptShadowError, TamperedShadowError
from shadow._fields import check_seconds
from shadow._segments import SegmentWriter
from shadow.auth import KEY_STEP, resolve_key
from shadow.debris import (
    DEFAULT_DEBRIS_AGE_S,
    LEASE_NAME,
    abort_stale_uploads,
    drop_lease,
    write_lease,
)
from shadow.freshness import HEAD_NAME, newest_known, write_head
from shadow.manifest import (
    Manifest,
    SessionInfo,
    manifest_key,
    new_segment_token,
    segment_files,
    validate_label,
    validate_session_id,
)
from shadow.records import BlockRecord, SegmentRecord
from shadow.recovery import (
    DEFAULT_CHUNK_BYTES,
    RecoveryReport,
    discover_sessions,
    load_manifest,
    recover_session,
    update_index,
)
from shadow.stores import LocalStore, ShadowStore, StoreConfig, open_store

__all__ = ["CacheShadow", "ShadowConfig", "ShadowResult"]

logger = logging.getLogger(__name__)
#: Stores this process has already warned about writing unsigned manifests to.
_WARNED_UNSIGNED: set[str] = set()


@dataclass(frozen=True, slots=True)
class ShadowConfig:
    """Behaviour of a :class:`CacheShadow`.

    Args:
        interval_seconds: period of the background shadow.
        autostart: start the background scheduler in the constructor.
        tenant: shadow only this tenant's blocks; ``None`` shadows every block.
        chunk_bytes: bytes exported and written per step (memory use is about
            three times this, since the next step is prepared while one is written).
        compact_garbage_fraction: compact when unreferenced bytes exceed this
            share of the bytes the segments hold.
        auth_key: the MAC key of manifests and the index (``bytes`` or ``str``);
            ``None`` takes ``$CONTEXTKIT_SHADOW_KEY``. Without either, manifests are
            written unauthenticated (a warning says so).
        allow_unauthenticated: let :meth:`CacheShadow.recover_session` restore an
            unsigned session from an ``s3://`` store.
        lease_ttl_seconds: how long the writer's lease stays live without a refresh
            (see :mod:`shadow.debris`); ``None``: three intervals, at least 600 s.
        upload_abort_after_seconds: at start, abort incomplete multipart uploads older
            than this (of this session, and of sessions without a live writer).
        accept_rollback: open a session whose manifest is older than the newest
            generation the store records (see :mod:`shadow.freshness`) instead of
            refusing it; the next shadow commits above that newest generation.
        allow_empty: commit a shadow with no block over a session that holds some
            (a cache emptied on purpose, e.g. a format pool of the vLLM connector's
            store whose last block was evicted); default: such a shadow commits nothing,
            so a tenant filter that matches nothing never empties a session.

    Raises:
        ValueError: a value out of range (naming the field), a tenant that breaks the
            naming rule (:func:`gpu_cache.validate_tenant`).
    """

    interval_seconds: float = 60.0
    autostart: bool = True
    tenant: str | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    compact_garbage_fraction: float = 0.5
    auth_key: bytes | str | None = field(default=None, repr=False)
    allow_unauthenticated: bool = False
    lease_ttl_seconds: float | None = None
    upload_abort_after_seconds: float = DEFAULT_DEBRIS_AGE_S
    accept_rollback: bool = False
    allow_empty: bool = False

    def __post_init__(self) -> None:
        check_seconds("interval_seconds", self.interval_seconds, positive=True)
        if isinstance(self.chunk_bytes, bool) or not isinstance(self.chunk_bytes, int) \
                or self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be an int >= 1, got {self.chunk_bytes!r}")
        fraction = self.compact_garbage_fraction
        if not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
            raise ValueError(f"compact_garbage_fraction must be within (0, 1], got {fraction!r}")
        if self.lease_ttl_seconds is not None:
            check_seconds("lease_ttl_seconds", self.lease_ttl_seconds, positive=True)
        check_seconds("upload_abort_after_seconds", self.upload_abort_after_seconds)
        if self.tenant is not None:
            try:
                validate_tenant(self.tenant)
            except InvalidNameError as exc:
                raise ValueError(f"ShadowConfig.tenant: {exc}") from None

    @property
    def lease_ttl(self) -> float:
        if self.lease_ttl_seconds is not None:
            return self.lease_ttl_seconds
        return max(3.0 * self.interval_seconds, 600.0)


@dataclass(frozen=True, slots=True)
class ShadowResult:
    """What one shadow wrote.

    ``committed`` is false when the shadow committed nothing (no block to shadow over a
    session that holds some): ``generation`` and ``num_blocks`` are then the committed
    ones. ``blocks_left_out`` counts blocks whose labels a manifest cannot hold
    (:func:`shadow.manifest.validate_label`), left out with a warning.
    """

    session_id: str
    generation: int
    num_blocks: int  # live blocks in the (new) manifest
    blocks_written: int
    bytes_written: int  # block bytes written (manifest and index excluded)
    manifest_bytes: int
    seconds: float
    compacted: bool
    committed: bool = True
    blocks_left_out: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}


class CacheShadow:
    """Shadows ``cache`` to ``store_url`` under ``session_id``, periodically and on demand.

    Args:
        cache: the cache to shadow and to recover into.
        store_url: ``file:///path``, ``s3://bucket/prefix``, or a ready store
            (e.g. a :class:`shadow.stores.MeteredStore`).
        session_id: the session's name in the store (see
            :func:`shadow.manifest.validate_session_id`).
        config: interval, tenant filter, chunking, compaction.
        store_config: options for a store built from a URL.

    If the session already exists, its manifest becomes the base of incremental
    shadows; the periodic job then waits until :meth:`recover_session` restored it
    (so a restarted process never shadows its empty cache over the saved session);
    an explicit :meth:`shadow_now` overrides that.

    The writer holds the session's lease (``{session}/writer.lease``, see
    :mod:`shadow.debris`) from construction to :meth:`close`, refreshed at the start of
    every shadow, so recovery's debris sweep never touches a live writer's files.

    Raises:
        InvalidSessionIdError: an unsafe session id.
        CacheIdentityError: the existing session belongs to another identity.
        TamperedShadowError: a key is configured and the existing manifest fails its
            MAC (never overwritten: delete the session or fix the key).
        RollbackShadowError: the existing manifest is older than the newest generation
            the store records (unless ``config.accept_rollback``).
        UnauthenticatedShadowError: the existing manifest is signed and no key is set.
    """

    def __init__(
        self,
        cache: TQGPUCache,
        store_url: str | ShadowStore,
        session_id: str,
        *,
        config: ShadowConfig | None = None,
        store_config: StoreConfig | None = None,
    ) -> None:
        self.cache = cache
        self.session_id = validate_session_id(session_id)
        self.config = config or ShadowConfig()
        self._owns_store = not isinstance(store_url, ShadowStore)
        self.store: ShadowStore = (open_store(store_url, store_config)
                                   if isinstance(store_url, str) else store_url)
        self._lock = threading.Lock()
        self._scheduler: Any = None
        self._closed = False
        self.last_result: ShadowResult | None = None
        self.last_error: BaseException | None = None
        self._key = resolve_key(self.config.auth_key)
        if self._key is None:
            # once per store and process: a server with one writer per format and
            # session would otherwise say it on every start of each
            first = self.store.url not in _WARNED_UNSIGNED
            _WARNED_UNSIGNED.add(self.store.url)
            logger.log(logging.WARNING if first else logging.DEBUG,
                       "session %s: shadow manifests in %s are unauthenticated (unsigned: "
                       "whoever can write the store can change what is recovered); to "
                       "sign them: %s (or ShadowConfig.auth_key)",
                       self.session_id, self.store.url, KEY_STEP)
        self._segments = SegmentWriter(cache, self.store, self.session_id,
                                       self.config.chunk_bytes, self._key)
        #: the highest generation this writer committed, tried, or saw recorded: the
        #: next commit is above it, so no generation is ever used twice
        self._generation_floor = 0
        #: a shadow failed: what was committed is uncertain until re-read
        self._resync = False
        write_lease(self.store, self.session_id, self.config.lease_ttl)
        try:
            self._manifest = self._load_existing()
            self._awaiting_recovery = (self._manifest is not None
                                       and bool(self._manifest.blocks))
            abort_stale_uploads(self.store, self.config.upload_abort_after_seconds,
                                own_session=self.session_id)
            self._collect_garbage()
        except BaseException:
            self._release()
            raise
        if self.config.autostart:
            self.start()

    # ------------------------------------------------------------------ state
    def _load_existing(self) -> Manifest | None:
        """The committed manifest (``None``: none), and the generation floor raised to the
        newest generation the store records."""
        key = self._key or b""
        newest = newest_known(self.store, self.session_id, key=self._key)
        self._generation_floor = max(self._generation_floor, newest.generation)
        try:
            manifest = load_manifest(self.store, self.session_id, key=key,
                                     accept_rollback=self.config.accept_rollback)
        except BlobNotFoundError:
            return None
        except TamperedShadowError:
            raise  # never overwrite a session that may be someone else's evidence or data
        except CorruptShadowError as exc:
            logger.warning("session %s: existing manifest unreadable (%s); the next shadow "
                           "starts the session afresh", self.session_id, exc)
            return None
        self.cache.identity.check_compatible(
            manifest.identity, what=f"existing shadow session {self.session_id!r}")
        self._generation_floor = max(self._generation_floor, manifest.generation)
        return manifest

    def _collect_garbage(self) -> None:
        """Delete blobs of this session that the manifest does not reference.

        Assumes one writer per session (the documented contract).
        """
        keep = {manifest_key(self.session_id), f"{self.session_id}/{LEASE_NAME}",
                f"{self.session_id}/{HEAD_NAME}"}
        if self._manifest is not None:
            keep |= {f for s in self._manifest.segments for f in s.files.values()}
        stale = [k for k in self.store.list(f"{self.session_id}/") if k not in keep]
        self.store.delete_many(stale)
        if isinstance(self.store, LocalStore):
            self.store.remove_unfinished(f"{self.session_id}/")
        if stale:
            logger.debug("session %s: removed %d unreferenced blobs", self.session_id, len(stale))

    @property
    def manifest(self) -> Manifest | None:
        """The last committed manifest of this session (``None`` before the first)."""
        return self._manifest

    # ------------------------------------------------------------------ scheduling
    def start(self) -> None:
        """Start the periodic shadow (apscheduler BackgroundScheduler); idempotent."""
        if self._closed:
            raise RuntimeError("this CacheShadow is closed; create a new one")
        if self._scheduler is not None:
            return
        try:
            from apscheduler.schedulers.background import BackgroundScheduler
        except ImportError:
            raise ImportError("periodic shadows need apscheduler: "
                              "pip install 'contextkit[shadow]'") from None
        scheduler = BackgroundScheduler(daemon=True)
        scheduler.add_job(self._periodic, "interval", seconds=self.config.interval_seconds,
                          id=f"shadow:{self.session_id}", max_instances=1, coalesce=True)
        scheduler.start()
        self._scheduler = scheduler

    def _periodic(self) -> None:
        if self._awaiting_recovery:
            logger.warning("session %s exists in %s and was not recovered into this cache; "
                           "periodic shadow skipped (call recover_session() or shadow_now())",
                           self.session_id, self.store.url)
            return
        try:
            self.shadow_now()
        except Exception as exc:  # a failed shadow leaves the last one authoritative
            self.last_error = exc
            logger.exception("periodic shadow of session %s failed", self.session_id)

    def close(self, final_shadow: bool = False) -> None:
        """Stop the scheduler (waiting for a running shadow), optionally shadow once more.

        Idempotent.
        """
        if self._closed:
            return
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=True)
            self._scheduler = None
        try:
            if final_shadow:
                self.shadow_now()
        finally:
            self._closed = True
            self._release()

    def _release(self) -> None:
        """Drop the lease and close an owned store."""
        try:
            drop_lease(self.store, self.session_id)
        except Exception:  # the lease goes stale by itself after its TTL
            logger.warning("session %s: could not drop the writer lease", self.session_id,
                           exc_info=True)
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> CacheShadow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def running(self) -> bool:
        return self._scheduler is not None

    # ------------------------------------------------------------------ shadow
    def shadow_now(self) -> ShadowResult:
        """Shadow the cache now; returns what was written.

        On any error the error propagates and what was committed stays authoritative;
        a manifest write whose acknowledgement was lost may have committed this shadow
        after all, so the next shadow first re-reads the committed manifest.
        """
        with self._lock:
            result = self._shadow_locked()
            self.last_result = result
            self._awaiting_recovery = False
            return result

    def _live_blocks(self) -> tuple[list[BlockMeta], int]:
        """The blocks to shadow, and how many were left out for labels a manifest cannot
        hold (the reader would refuse them; nothing is written that cannot be read)."""
        tenant = self.config.tenant
        metas, bad = [], []
        for m in self.cache.metadata.all():
            if tenant is not None and m.tenant_slug != tenant:
                continue
            try:
                validate_label(m.source_layer, "source_layer")
            except ValueError:
                bad.append(m)
                continue
            metas.append(m)
        if bad:
            logger.warning("session %s: %d block(s) left out of the shadow: their source_layer "
                           "is not a label a manifest can hold (first: %r); labels are 1-1024 "
                           "printable characters", self.session_id, len(bad),
                           bad[0].source_layer[:60])
        return sorted(metas, key=lambda m: m.block_id), len(bad)

    def _resync_after_failure(self) -> None:
        """A shadow failed: re-read what is committed (a lost acknowledgement may have
        committed it after all) and remove what it does not reference."""
        self._manifest = self._load_existing()
        self._collect_garbage()
        self._resync = False

    def _shadow_locked(self) -> ShadowResult:
        start = time.perf_counter()
        # a shadow in progress always has a fresh lease: the sweep never takes its blobs
        write_lease(self.store, self.session_id, self.config.lease_ttl)
        if self._resync:
            self._resync_after_failure()
        try:
            return self._commit(start)
        except BaseException:
            self._resync = True
            raise

    def _commit(self, start: float) -> ShadowResult:
        cache, prev = self.cache, self._manifest
        identity = cache.identity
        metas, left_out = self._live_blocks()
        if not metas and prev is not None and prev.blocks and not self.config.allow_empty:
            logger.warning("session %s: no block%s to shadow; generation %d (%d blocks) stays "
                           "committed (a shadow never empties a session)", self.session_id,
                           f" of tenant {self.config.tenant}" if self.config.tenant else "",
                           prev.generation, len(prev.blocks))
            return ShadowResult(
                session_id=self.session_id, generation=prev.generation,
                num_blocks=len(prev.blocks), blocks_written=0, bytes_written=0,
                manifest_bytes=0, seconds=time.perf_counter() - start, compacted=False,
                committed=False, blocks_left_out=left_out)
        prev_by_key = {r.key: r for r in prev.blocks if r.key is not None} if prev else {}
        reuse: dict[int, BlockRecord] = {}
        new: list[BlockMeta] = []
        for m in metas:
            rec = prev_by_key.get(m.key.hex()) if m.key is not None else None
            # a record is reused only as it was signed: same tenant, and with a key a MAC
            # and its nonce (format 1 had none: such blocks are written again, with one)
            if rec is not None and rec.tenant == m.tenant_slug \
                    and (self._key is None or (rec.mac is not None
                                               and rec.mac_nonce is not None)):
                reuse[m.block_id] = rec
            else:
                new.append(m)

        per_block = identity.bytes_per_block
        compacted = False
        if prev is not None and prev.segments:
            stored = prev.stored_bytes + len(new) * per_block
            live = len(metas) * per_block
            if stored and (stored - live) / stored > self.config.compact_garbage_fraction:
                new, reuse, compacted = list(metas), {}, True

        segment_id = prev.next_segment if prev else 0
        segments = [] if compacted or prev is None else list(prev.segments)
        written_records: dict[int, BlockRecord] = {}
        if new:
            kind = "compaction" if compacted else ("base" if segment_id == 0 else "incremental")
            token = new_segment_token()
            segment = SegmentRecord(segment_id, segment_files(self.session_id, segment_id, token),
                                    0, kind, token)
            written, new = self._segments.write(segment, new)
            written_records = dict(written)
            segment.num_blocks = len(new)
            segments.append(segment)
            next_segment = segment_id + 1
        else:
            next_segment = segment_id

        records: list[BlockRecord] = []
        for m in metas:
            if m.block_id in written_records:
                records.append(written_records[m.block_id])
            elif m.block_id in reuse:
                old = reuse[m.block_id]
                records.append(BlockRecord(
                    key=old.key, source_layer=m.source_layer, importance=m.importance,
                    token_range=tuple(m.token_range), tenant=m.tenant_slug,  # type: ignore[arg-type]
                    pinned=m.pinned, num_tokens=m.num_tokens, segment_id=old.segment_id,
                    offsets=old.offsets, checksums=old.checksums, mac=old.mac,
                    mac_nonce=old.mac_nonce))
        used = {r.segment_id for r in records}
        segments = [s for s in segments if s.segment_id in used]
        now = time.time()
        generation = max(prev.generation if prev else 0, self._generation_floor) + 1
        self._generation_floor = generation  # tried is used: it may land late
        manifest = Manifest(session_id=self.session_id, identity=identity,
                            generation=generation,
                            segments=segments, blocks=records, next_segment=next_segment,
                            created_at=prev.created_at if prev else now, updated_at=now,
                            key_offsets=self._key_offset_bytes(),
                            chunk_index=ChunkSection.collect(cache.chunks, records,
                                                             identity.block_size),
                            authenticated=self._key is not None)
        raw = manifest.to_json(self._key)
        self.store.put(manifest_key(self.session_id), raw)  # the commit point
        self._manifest = manifest
        self._after_commit(manifest, raw, prev, segments)
        result = ShadowResult(
            session_id=self.session_id, generation=manifest.generation,
            num_blocks=len(records), blocks_written=len(written_records),
            bytes_written=len(written_records) * per_block, manifest_bytes=len(raw),
            seconds=time.perf_counter() - start, compacted=compacted,
            blocks_left_out=left_out)
        logger.debug("shadowed session %s: %s", self.session_id, result)
        return result

    def _after_commit(self, manifest: Manifest, raw: bytes, prev: Manifest | None,
                      segments: list[SegmentRecord]) -> None:
        """Head, index, and the segments the new manifest dropped. The manifest is
        committed: a failure here is logged, never raised (the head and the index lag
        behind, which freshness allows; the next writer deletes the stale segments)."""
        try:
            write_head(self.store, self.session_id, manifest.generation, raw, self._key)
        except Exception:
            logger.warning("session %s: head update failed", self.session_id, exc_info=True)
        try:
            update_index(self.store, manifest.info(), key=self._key)
        except Exception:  # the manifest is committed; the index is only a hint
            logger.warning("session %s: index update failed", self.session_id, exc_info=True)
        if prev is not None:
            dropped = {s.segment_id for s in prev.segments} - {s.segment_id for s in segments}
            stale = [f for s in prev.segments if s.segment_id in dropped
                     for f in s.files.values()]
            try:
                self.store.delete_many(stale)
            except Exception:
                logger.warning("session %s: could not delete %d dropped blobs; the next writer "
                               "or `contextkit recover` removes them", self.session_id,
                               len(stale), exc_info=True)

    def _key_offset_bytes(self) -> bytes | None:
        offsets = self.cache.key_offsets
        if offsets is None:
            return None
        return offsets.detach().to("cpu", torch.float32).numpy().astype("<f4").tobytes()

    # ------------------------------------------------------------------ discovery / recovery
    def discover_sessions(self) -> list[SessionInfo]:
        """Sessions in this shadow's store (see :func:`shadow.recovery.discover_sessions`)."""
        return discover_sessions(self.store, key=self._key or b"")

    def session_info(self) -> SessionInfo | None:
        return self._manifest.info() if self._manifest else None

    def recover_session(self, session_id: str | None = None, **kwargs: Any) -> RecoveryReport:
        """Restore a session (this one by default) into this shadow's cache.

        See :func:`shadow.recovery.recover_session` for arguments and errors.
        """
        sid = self.session_id if session_id is None else validate_session_id(session_id)
        kwargs.setdefault("key", self._key or b"")
        kwargs.setdefault("allow_unauthenticated", self.config.allow_unauthenticated)
        with self._lock:
            report = recover_session(self.store, sid, self.cache, **kwargs)
            if sid == self.session_id:
                self._awaiting_recovery = False
        return report
