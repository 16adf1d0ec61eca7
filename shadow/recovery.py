"""Discovery and recovery of shadowed sessions into a :class:`gpu_cache.TQGPUCache`.

Recovery reads a session's manifest (the only authoritative file), checks that it is
the newest generation the store records (:mod:`shadow.freshness`) and the cache
identity, streams the referenced block ranges, verifies every block (its MAC with a
key, its CRC-32s without) and imports the good blocks into the host tier with their
metadata and keys (:mod:`shadow._reader`), then the manifest's chunk index entries
whose blocks are all in the cache (:mod:`shadow._chunk_index`). Blocks that were pinned
are pinned again (which warms them to the device tier). A bad block (or block record) is
skipped and reported; a bad session is reported and never stops the recovery of the
others.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpu_cache import (
    BlockStateError,
    CacheIdentityError,
    PinCapacityError,
    PrefixPinManager,
    TQGPUCache,
)
from shadow._errors import (
    BlobNotFoundError,
    CorruptShadowError,
    RollbackShadowError,
    ShadowError,
    UnauthenticatedShadowError,
)
from shadow._index import read_index, update_index
from shadow._reader import ChunkReader, import_chunks, plan_chunks
from shadow._report import RecoveryReport, SkippedBlock
from shadow.auth import KEY_ENV, resolve_key
from shadow.freshness import HEAD_NAME, commit_record, newest_known, rollback_reason
from shadow.manifest import Manifest, SessionInfo, manifest_key, validate_session_id
from shadow.records import BlockRecord
from shadow.stores import ShadowStore

__all__ = [
    "RecoveryReport",
    "SkippedBlock",
    "discover_sessions",
    "load_manifest",
    "missing_manifest_reason",
    "read_index",
    "recover_session",
    "recover_sessions",
    "update_index",
]

logger = logging.getLogger(__name__)

#: Bytes read per step of a recovery (per step, all four tensors together).
DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024


# ---------------------------------------------------------------------- manifests & index
def load_manifest(store: ShadowStore, session_id: str, *,
                  key: bytes | str | None = None, accept_rollback: bool = False,
                  index: Mapping[str, Mapping[str, Any]] | None = None) -> Manifest:
    """Read, authenticate, validate and check the freshness of a session's manifest.

    Args:
        store: where the session lives.
        session_id: the session.
        key: the MAC key; ``None`` takes ``$CONTEXTKIT_SHADOW_KEY`` (see
            :func:`shadow.auth.resolve_key`), and without one reads unauthenticated
            manifests only.
        accept_rollback: return a manifest older than the newest generation the store
            records for the session (its :attr:`~shadow.Manifest.rollback` says why)
            instead of refusing it.
        index: ``index.json``'s sessions, when the caller read them already.

    Raises:
        InvalidSessionIdError: an unsafe session id.
        BlobNotFoundError: no such session.
        CorruptShadowError: no manifest, but ``head.json`` or ``index.json`` records a
            commit of the session (its blobs are kept: see :func:`missing_manifest_reason`).
        TamperedShadowError: a key is configured and the MAC is missing or wrong.
        RollbackShadowError: an older generation than ``head.json`` or ``index.json``
            record for the session (and not ``accept_rollback``).
        UnauthenticatedShadowError: no key is configured but the manifest is signed.
        CorruptShadowError: the manifest cannot be parsed or has malformed fields.
    """
    path = manifest_key(session_id)
    where = f"{store.url}/{path}"
    mac_key = resolve_key(key)
    try:
        raw = store.get(path)
    except BlobNotFoundError:
        record = commit_record(store, session_id)
        if record is None:
            raise
        raise CorruptShadowError(missing_manifest_reason(where, record)) from None
    manifest = Manifest.from_json(raw, where=where, key=mac_key)
    if manifest.session_id != session_id:
        raise CorruptShadowError(f"{where} describes session {manifest.session_id!r}, not "
                                 f"{session_id!r}")
    newest = newest_known(store, session_id, key=mac_key, index=index)
    why = rollback_reason(manifest, raw, newest, where)
    if why is not None:
        if not accept_rollback:
            raise RollbackShadowError(why)
        logger.warning("session %s: accepted %s", session_id, why.split(";")[0])
        manifest.rollback = why
    return manifest


def missing_manifest_reason(where: str, record: str) -> str:
    """One line: the manifest at ``where`` is missing although ``record`` says the session
    committed; nothing of it is deleted, and what to do."""
    return (f"{where} is missing, but {record}; nothing of the session was deleted - restore "
            "manifest.json from a backup to recover it, or delete the session's objects to "
            "drop it")


def discover_sessions(store: ShadowStore, *, key: bytes | str | None = None
                      ) -> list[SessionInfo]:
    """Every session with a manifest or a ``head.json``, sorted by id.

    The manifests are authoritative: index entries without a manifest are left out,
    manifests missing from the index are found by listing. A session whose head records
    a commit but whose manifest is missing is listed with ``error`` saying so. A session whose
    manifest is unreadable, or fails authentication under ``key`` (default
    ``$CONTEXTKIT_SHADOW_KEY``), is listed with ``error`` set.
    """
    key = resolve_key(key) or b""
    # a head without a manifest is a committed session that lost it: listed, with an error
    listed = {k.split("/", 1)[0] for k in store.list()
              if k.count("/") == 1 and k.endswith(("/manifest.json", f"/{HEAD_NAME}"))}
    try:
        index: Mapping[str, Mapping[str, Any]] = read_index(store, key=key)
    except ShadowError:
        index = {}  # a hint only: each session's head still speaks for it
    infos = []
    for sid in sorted(listed):
        try:
            validate_session_id(sid)
        except ShadowError:
            continue
        try:
            infos.append(load_manifest(store, sid, key=key, index=index).info())
        except (ShadowError, CacheIdentityError) as exc:
            infos.append(SessionInfo(session_id=sid, generation=-1, num_blocks=0, num_bytes=0,
                                     updated_at=0.0, error=str(exc)))
    return infos


# ---------------------------------------------------------------------- recovery
def recover_session(
    store: ShadowStore,
    session_id: str,
    cache: TQGPUCache,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    repin: bool = True,
    progress: Callable[[int], object] | None = None,
    key: bytes | str | None = None,
    allow_unauthenticated: bool = False,
    accept_rollback: bool = False,
) -> RecoveryReport:
    """Restore one session into the host tier of ``cache``.

    Blocks whose key the cache already holds for the same tenant are not imported
    again (counted in ``already_present``). Recovery fills free host slots only; it
    never evicts blocks to make room, the blocks that do not fit are reported. Blocks
    failing a checksum, cut off by a truncated blob or in a missing blob are skipped
    and reported; a skipped block breaks the key chain for prefix lookups of the blocks
    after it.

    Args:
        store: where the session lives.
        session_id: the session to restore.
        cache: the cache to fill; its identity must equal the session's.
        chunk_bytes: bytes read per step (memory use is about three times this).
        repin: pin again the blocks that were pinned when shadowed.
        progress: called with the number of blocks handled after each step.
        key: the MAC key (default ``$CONTEXTKIT_SHADOW_KEY``). With a key, the
            manifest's MAC is checked before anything else is read or allocated.
        allow_unauthenticated: recover an unsigned session from an ``s3://`` store
            (refused by default: anyone who can write the bucket could have written
            it). Local ``file://`` stores are recovered unsigned without asking.
        accept_rollback: recover a manifest older than the newest generation the store
            records for the session (reported in ``rollbacks``) instead of refusing it.

    The manifest is validated whole before the first host block is allocated, and if
    a later step fails (a store error), the blocks this call imported are removed
    again before the error propagates.

    Raises:
        InvalidSessionIdError: an unsafe session id.
        BlobNotFoundError: no such session.
        TamperedShadowError: a key is configured and the manifest's MAC is missing or
            does not match (the session was modified, or signed with another key).
        RollbackShadowError: the manifest is older than the newest generation the store
            records for the session (a replay), and not ``accept_rollback``.
        UnauthenticatedShadowError: the manifest is signed but no key is configured,
            or an unsigned ``s3://`` session without ``allow_unauthenticated``.
        CorruptShadowError: the manifest cannot be parsed or has malformed fields.
        CacheIdentityError: the session was shadowed for another model, codec,
            block size or schema (the message lists the differing fields).
    """
    start = time.perf_counter()
    mac_key = resolve_key(key)
    manifest = load_manifest(store, session_id, key=mac_key or b"",
                             accept_rollback=accept_rollback)
    if not manifest.authenticated and store.scheme == "s3" and not allow_unauthenticated:
        raise UnauthenticatedShadowError(
            f"{store.url}/{session_id} is not authenticated and an s3:// store may be "
            f"writable by others; refused - set {KEY_ENV} (and shadow with it), or pass "
            "allow_unauthenticated=True (CLI: --allow-unauthenticated)")
    cache.identity.check_compatible(manifest.identity, what=f"shadow session {session_id!r}")
    report = RecoveryReport(sessions=[session_id])
    if manifest.rollback is not None:
        report.rollbacks[session_id] = manifest.rollback
    ids: list[int | None] = [None] * (len(manifest.blocks) + len(manifest.bad_records))
    report.skipped += [SkippedBlock(session_id, pos, None, why)
                       for pos, why in sorted(manifest.bad_records.items())]
    todo: list[tuple[int, BlockRecord]] = []
    for pos, rec in zip(manifest.positions(), manifest.blocks, strict=True):
        if rec.key is not None:
            hit = cache.lookup([bytes.fromhex(rec.key)], rec.tenant)  # type: ignore[list-item]
            if hit:
                ids[pos] = hit[0]
                report.already_present += 1
                continue
        todo.append((pos, rec))

    sizes = manifest.block_nbytes
    chunk_blocks = max(1, chunk_bytes // manifest.bytes_per_block)
    chunks = plan_chunks(manifest, todo, chunk_blocks)
    present = [bid for bid in ids if bid is not None]
    reader = ChunkReader(store, manifest, chunks, key=mac_key)
    try:
        import_chunks(cache, session_id, reader.chunks(chunks), report, ids, sizes, progress)
    except BaseException:
        # leave the cache as it was: drop what this call imported
        ours = [bid for bid in ids if bid is not None and bid not in set(present)]
        if ours:
            cache.remove_blocks(ours)
            logger.warning("session %s: recovery failed; released the %d blocks it had "
                           "imported", session_id, len(ours))
        raise
    finally:
        reader.close()

    # the chunk index over the blocks now in the cache (those of skipped blocks dropped)
    report.chunks, report.chunks_dropped = manifest.chunk_index.restore(cache, manifest.blocks)
    report.chunks_refused += [f"{session_id}: {why}" for why in manifest.chunk_index.refused]
    if manifest.chunk_index.refused:
        logger.warning("session %s: left out %d unreadable chunk index entries (first: %s)",
                       session_id, len(manifest.chunk_index.refused),
                       manifest.chunk_index.refused[0])
    if repin:
        pinned = [ids[pos] for pos, rec in zip(manifest.positions(), manifest.blocks,
                                               strict=True) if rec.pinned]
        to_pin = [bid for bid in pinned if bid is not None]
        if to_pin:
            try:
                report.pinned = len(PrefixPinManager(cache).pin(to_pin))
            except (PinCapacityError, BlockStateError) as exc:
                report.errors[session_id] = f"blocks recovered but not pinned: {exc}"
                logger.warning("session %s: %s", session_id, report.errors[session_id])
    report.block_ids[session_id] = ids
    report.seconds = time.perf_counter() - start
    if report.skipped:
        logger.warning("session %s: skipped %d of %d blocks (first: %s)", session_id,
                       len(report.skipped), len(ids), report.skipped[0].reason)
    return report


def recover_sessions(
    store: ShadowStore,
    cache: TQGPUCache,
    session_ids: Sequence[str] | None = None,
    **kwargs: Any,
) -> RecoveryReport:
    """Recover several sessions (all discovered ones by default) into ``cache``.

    A session that cannot be recovered at all (missing, corrupt manifest, other
    identity) is recorded in ``errors`` and the others go on.
    """
    start = time.perf_counter()
    if session_ids is None:
        session_ids = [s.session_id for s in discover_sessions(store)]
    total = RecoveryReport()
    for sid in session_ids:
        try:
            total.merge(recover_session(store, sid, cache, **kwargs))
        except (ShadowError, CacheIdentityError) as exc:
            total.errors[sid] = str(exc)
            logger.warning("session %s not recovered: %s", sid, exc)
    total.seconds = time.perf_counter() - start
    return total
