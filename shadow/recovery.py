"""Discovery and recovery of shadowed sessions into a :class:`gpu_cache.TQGPUCache`.

Recovery reads a session's manifest (the only authoritative file), checks the cache
identity, streams the referenced block ranges, verifies every block's per-tensor
checksums and imports the good blocks into the host tier with their metadata and
keys. Blocks that were pinned are pinned again (which warms them to the device
tier). A bad block is skipped and reported; a bad session is reported and never
stops the recovery of the others.
"""

from __future__ import annotations

import json
import logging
import mmap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gpu_cache import (
    TENSOR_NAMES,
    BlockStateError,
    CacheIdentityError,
    PinCapacityError,
    PrefixPinManager,
    Tier,
    TQGPUCache,
)
from shadow._errors import (
    BlobNotFoundError,
    CorruptShadowError,
    ShadowError,
    UnauthenticatedShadowError,
)
from shadow.auth import KEY_ENV, resolve_key, sign, verify
from shadow.manifest import (
    INDEX_KEY,
    BlockRecord,
    Manifest,
    SessionInfo,
    block_dtypes,
    block_shapes,
    checksum,
    manifest_key,
    validate_session_id,
)
from shadow.stores import ShadowStore

__all__ = [
    "RecoveryReport",
    "SkippedBlock",
    "discover_sessions",
    "load_manifest",
    "read_index",
    "recover_session",
    "recover_sessions",
    "update_index",
]

logger = logging.getLogger(__name__)

#: Bytes read per step of a recovery (per step, all four tensors together).
DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024
_index_locks: dict[str, threading.Lock] = {}
_index_locks_guard = threading.Lock()


@dataclass(frozen=True, slots=True)
class SkippedBlock:
    """A block recovery left out, and why."""

    session_id: str
    index: int  # position in the manifest
    key: str | None
    reason: str


@dataclass(slots=True)
class RecoveryReport:
    """What a recovery did.

    ``block_ids`` maps each recovered session to the cache ids of its blocks in
    manifest order (``None`` where a block was skipped).
    """

    sessions: list[str] = field(default_factory=list)
    blocks: int = 0
    bytes: int = 0
    skipped: list[SkippedBlock] = field(default_factory=list)
    seconds: float = 0.0
    already_present: int = 0
    pinned: int = 0
    errors: dict[str, str] = field(default_factory=dict)
    block_ids: dict[str, list[int | None]] = field(default_factory=dict)

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def merge(self, other: RecoveryReport) -> None:
        self.sessions += other.sessions
        self.blocks += other.blocks
        self.bytes += other.bytes
        self.skipped += other.skipped
        self.seconds += other.seconds
        self.already_present += other.already_present
        self.pinned += other.pinned
        self.errors.update(other.errors)
        self.block_ids.update(other.block_ids)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (counts, plus the reasons of skips and errors)."""
        return {
            "sessions": len(self.sessions),
            "session_ids": list(self.sessions),
            "blocks": self.blocks,
            "bytes": self.bytes,
            "skipped": self.num_skipped,
            "seconds": round(self.seconds, 6),
            "already_present": self.already_present,
            "pinned": self.pinned,
            "errors": dict(self.errors),
            "skipped_blocks": [
                {"session_id": s.session_id, "index": s.index, "key": s.key, "reason": s.reason}
                for s in self.skipped
            ],
        }


# ---------------------------------------------------------------------- manifests & index
def load_manifest(store: ShadowStore, session_id: str, *,
                  key: bytes | str | None = None) -> Manifest:
    """Read, authenticate and validate a session's manifest.

    Args:
        store: where the session lives.
        session_id: the session.
        key: the MAC key; ``None`` takes ``$CONTEXTKIT_SHADOW_KEY`` (see
            :func:`shadow.auth.resolve_key`), and without one reads unauthenticated
            manifests only.

    Raises:
        InvalidSessionIdError: an unsafe session id.
        BlobNotFoundError: no such session.
        TamperedShadowError: a key is configured and the MAC is missing or wrong.
        UnauthenticatedShadowError: no key is configured but the manifest is signed.
        CorruptShadowError: the manifest cannot be parsed or has malformed fields.
    """
    path = manifest_key(session_id)
    manifest = Manifest.from_json(store.get(path), where=f"{store.url}/{path}",
                                  key=resolve_key(key))
    if manifest.session_id != session_id:
        raise CorruptShadowError(f"{store.url}/{path} describes session "
                                 f"{manifest.session_id!r}, not {session_id!r}")
    return manifest


def read_index(store: ShadowStore, *, key: bytes | str | None = None
               ) -> dict[str, dict[str, Any]]:
    """Sessions listed in ``index.json``; an unparsable index reads as empty (it is a hint).

    Raises:
        TamperedShadowError: a key is configured and the index's MAC is missing or wrong.
        UnauthenticatedShadowError: no key is configured but the index is signed.
    """
    try:
        doc = json.loads(store.get(INDEX_KEY))
        if not isinstance(doc, dict):
            raise TypeError("the index is not an object")
        verify(doc, resolve_key(key), "index", f"{store.url}/{INDEX_KEY}")
        sessions = doc["sessions"]
        if not isinstance(sessions, dict):
            raise TypeError("sessions is not an object")
        return {str(k): dict(v) for k, v in sessions.items()}
    except BlobNotFoundError:
        return {}
    except ShadowError:
        raise
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        logger.warning("ignoring unreadable %s/%s (%s); discovery lists manifests instead",
                       store.url, INDEX_KEY, exc)
        return {}


def update_index(store: ShadowStore, info: SessionInfo, *, key: bytes | None = None) -> None:
    """Record a session in ``index.json`` (read-modify-write, atomic put), signed with
    ``key`` when one is given (``None`` here means unsigned, not the environment).

    Writers in other processes may race; discovery therefore also lists manifests,
    so a lost index entry only costs a manifest read. An index that fails its MAC is
    rebuilt from this session alone (its other entries cannot be trusted).
    """
    with _index_locks_guard:
        lock = _index_locks.setdefault(store.url, threading.Lock())
    with lock:
        try:
            # b"" resolves to no key (not to the environment): the caller decided.
            sessions = read_index(store, key=key or b"")
        except UnauthenticatedShadowError:
            logger.warning("%s/%s is signed but this writer has no key; index not updated "
                           "(set %s)", store.url, INDEX_KEY, KEY_ENV)
            return
        except ShadowError as exc:
            logger.warning("%s; rewriting the index", exc)
            sessions = {}
        sessions[info.session_id] = {
            "generation": info.generation, "num_blocks": info.num_blocks,
            "num_bytes": info.num_bytes, "updated_at": info.updated_at,
            "identity": info.identity.to_dict() if info.identity else None,
        }
        doc: dict[str, Any] = {"format": "contextkit-shadow-index", "format_version": 1,
                               "sessions": sessions}
        if key:
            doc["mac"] = sign(doc, key, "index")
        store.put(INDEX_KEY, json.dumps(doc, separators=(",", ":"), sort_keys=True).encode())


def discover_sessions(store: ShadowStore, *, key: bytes | str | None = None
                      ) -> list[SessionInfo]:
    """Every session with a manifest, sorted by id.

    The manifests are authoritative: index entries without a manifest are left out,
    manifests missing from the index are found by listing. A session whose
    manifest is unreadable, or fails authentication under ``key`` (default
    ``$CONTEXTKIT_SHADOW_KEY``), is listed with ``error`` set.
    """
    key = resolve_key(key) or b""
    listed = {k.split("/", 1)[0] for k in store.list() if k.endswith("/manifest.json")
              and k.count("/") == 1}
    infos = []
    for sid in sorted(listed):
        try:
            validate_session_id(sid)
        except ShadowError:
            continue
        try:
            infos.append(load_manifest(store, sid, key=key).info())
        except (ShadowError, CacheIdentityError) as exc:
            infos.append(SessionInfo(session_id=sid, generation=-1, num_blocks=0, num_bytes=0,
                                     updated_at=0.0, error=str(exc)))
    return infos


# ---------------------------------------------------------------------- recovery
@dataclass(slots=True)
class _Chunk:
    segment_id: int
    first: int  # first block index (within the segment) read
    records: list[tuple[int, BlockRecord, int]]  # (manifest position, record, segment index)


@dataclass(slots=True)
class _ReadChunk:
    chunk: _Chunk
    arrays: dict[str, np.ndarray]  # [span, *block_shape]
    bad: dict[int, str]  # manifest position -> why the block is skipped
    missing: str | None = None


def _plan(manifest: Manifest, todo: Sequence[tuple[int, BlockRecord]],
          chunk_blocks: int) -> list[_Chunk]:
    """Group blocks by segment, sorted by offset, into chunks of nearby blocks."""
    sizes = manifest.block_nbytes
    by_seg: dict[int, list[tuple[int, BlockRecord, int]]] = {}
    for pos, rec in todo:
        by_seg.setdefault(rec.segment_id, []).append(
            (pos, rec, rec.offsets["k_packed"] // sizes["k_packed"]))
    chunks = []
    for seg_id in sorted(by_seg):
        items = sorted(by_seg[seg_id], key=lambda t: t[2])
        current: list[tuple[int, BlockRecord, int]] = []
        for item in items:
            # a chunk spans at most chunk_blocks blocks, garbage between live ones included
            if current and item[2] - current[0][2] >= chunk_blocks:
                chunks.append(_Chunk(seg_id, current[0][2], current))
                current = []
            current.append(item)
        if current:
            chunks.append(_Chunk(seg_id, current[0][2], current))
    return chunks


def _page_aligned(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised array in page-aligned anonymous memory (allows O_DIRECT reads)."""
    count = int(np.prod(shape))
    nbytes = max(1, count * np.dtype(dtype).itemsize)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=count).reshape(shape)


class _ChunkReader:
    """Reads chunks into two reused buffer sets and verifies checksums as it goes.

    Fresh buffers per chunk would page-fault on every read (as costly as the CRC);
    two sets suffice because at most one chunk is being imported while the next is
    read. Each tensor's checksums run in a helper thread while the next tensor is
    read (``zlib.crc32`` releases the GIL), so reading and verifying overlap.
    """

    def __init__(self, store: ShadowStore, manifest: Manifest, chunks: list[_Chunk]) -> None:
        self.store, self.manifest = store, manifest
        self.shapes, self.dtypes = block_shapes(manifest.identity), block_dtypes(manifest.identity)
        self.sizes = manifest.block_nbytes
        self.files = {s.segment_id: s.files for s in manifest.segments}
        span = max((c.records[-1][2] - c.first + 1 for c in chunks), default=0)
        self.buffers = [{name: _page_aligned((span, *self.shapes[name]), self.dtypes[name])
                         for name in TENSOR_NAMES} for _ in range(2)]
        self.verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shadow-crc")
        self.turn = 0

    def close(self) -> None:
        self.verifier.shutdown(wait=True)

    def _verify(self, name: str, arr: np.ndarray, chunk: _Chunk, blocks_read: int
                ) -> dict[int, str]:
        bad: dict[int, str] = {}
        for pos, rec, seg_idx in chunk.records:
            local = seg_idx - chunk.first
            if local >= blocks_read:
                bad[pos] = f"{name} blob is truncated"
            elif checksum(arr[local].reshape(-1).view(np.uint8)) != rec.checksums[name]:
                bad[pos] = f"{name} checksum mismatch"
        return bad

    def read(self, chunk: _Chunk) -> _ReadChunk:
        files = self.files[chunk.segment_id]
        span = chunk.records[-1][2] - chunk.first + 1
        buffers = self.buffers[self.turn]
        self.turn ^= 1
        arrays: dict[str, np.ndarray] = {}
        pending = []
        try:
            for name in TENSOR_NAMES:
                arr = buffers[name][:span]
                if not self.sizes[name]:  # the empty norms of fp16/native: nothing to read
                    arrays[name] = arr
                    continue
                try:
                    got = self.store.read_into(files[name], chunk.first * self.sizes[name],
                                               memoryview(arr.reshape(-1).view(np.uint8)))  # type: ignore[arg-type]
                except BlobNotFoundError:
                    return _ReadChunk(chunk, {}, {}, missing=files[name])
                arrays[name] = arr
                pending.append(self.verifier.submit(self._verify, name, arr, chunk,
                                                    got // self.sizes[name]))
        finally:
            results = [f.result() for f in pending]  # never leave a verify running on a buffer
        bad: dict[int, str] = {}
        for found in results:
            for pos, why in found.items():
                bad.setdefault(pos, why)
        return _ReadChunk(chunk, arrays, bad)


def _prefetched(fn: Callable[[_Chunk], _ReadChunk], chunks: list[_Chunk]) -> Iterator[_ReadChunk]:
    """Read chunk ``i + 1`` in a thread while chunk ``i`` is imported."""
    if not chunks:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shadow-read") as pool:
        future = pool.submit(fn, chunks[0])
        for i in range(len(chunks)):
            result = future.result()
            if i + 1 < len(chunks):
                future = pool.submit(fn, chunks[i + 1])
            yield result


def _import_chunks(cache: TQGPUCache, session_id: str, chunks: Iterator[_ReadChunk],
                   report: RecoveryReport, ids: list[int | None], sizes: dict[str, int],
                   progress: Callable[[int], object] | None) -> None:
    """Import verified blocks of each chunk into the host tier, recording skips."""
    no_room = False
    for got in chunks:
        recs = got.chunk.records
        if no_room or got.missing is not None:
            reason = ("the host tier has no room left" if no_room
                      else f"blob {got.missing} is missing")
            report.skipped += [SkippedBlock(session_id, pos, rec.key, reason)
                               for pos, rec, _ in recs]
            if progress:
                progress(len(recs))
            continue
        good: list[tuple[int, BlockRecord, int]] = []
        for pos, rec, seg_idx in recs:
            if pos in got.bad:
                report.skipped.append(SkippedBlock(session_id, pos, rec.key, got.bad[pos]))
            else:
                good.append((pos, rec, seg_idx - got.chunk.first))
        room = cache.num_free(Tier.HOST)
        if len(good) > room:
            # never evict live blocks (or blocks just recovered) to make room
            no_room = True
            report.skipped += [SkippedBlock(session_id, pos, rec.key,
                                            "the host tier has no room left")
                               for pos, rec, _ in good[room:]]
            good = good[:room]
        if good:
            span = next(iter(got.arrays.values())).shape[0]
            local_idx = [g[2] for g in good]
            dense = local_idx == list(range(span))
            tensors = {}
            for name in TENSOR_NAMES:
                arr = got.arrays[name] if dense else got.arrays[name][local_idx]
                tensors[name] = torch.from_numpy(arr).transpose(0, 1)  # -> [L, n, BS, H, ...]
            new_ids = cache.import_blocks(tensors, [g[1].meta_for_import() for g in good],
                                          tier=Tier.HOST)
            if new_ids is None:
                no_room = True
                report.skipped += [SkippedBlock(session_id, pos, rec.key,
                                                "the host tier has no room left")
                                   for pos, rec, _ in good]
            else:
                for (pos, _, _), bid in zip(good, new_ids, strict=True):
                    ids[pos] = bid
                report.blocks += len(new_ids)
                report.bytes += len(new_ids) * sum(sizes.values())
        if progress:
            progress(len(recs))



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
        chunk_bytes: bytes read per step (memory use is about twice this).
        repin: pin again the blocks that were pinned when shadowed.
        progress: called with the number of blocks handled after each step.
        key: the MAC key (default ``$CONTEXTKIT_SHADOW_KEY``). With a key, the
            manifest's MAC is checked before anything else is read or allocated.
        allow_unauthenticated: recover an unsigned session from an ``s3://`` store
            (refused by default: anyone who can write the bucket could have written
            it). Local ``file://`` stores are recovered unsigned without asking.

    The manifest is validated whole before the first host block is allocated, and if
    a later step fails (a store error), the blocks this call imported are removed
    again before the error propagates.

    Raises:
        InvalidSessionIdError: an unsafe session id.
        BlobNotFoundError: no such session.
        TamperedShadowError: a key is configured and the manifest's MAC is missing or
            does not match (the session was modified, or signed with another key).
        UnauthenticatedShadowError: the manifest is signed but no key is configured,
            or an unsigned ``s3://`` session without ``allow_unauthenticated``.
        CorruptShadowError: the manifest cannot be parsed or has malformed fields.
        CacheIdentityError: the session was shadowed for another model, codec,
            block size or schema (the message lists the differing fields).
    """
    start = time.perf_counter()
    manifest = load_manifest(store, session_id, key=resolve_key(key) or b"")
    if not manifest.authenticated and store.scheme == "s3" and not allow_unauthenticated:
        raise UnauthenticatedShadowError(
            f"{store.url}/{session_id} is not authenticated and an s3:// store may be "
            f"writable by others; refused - set {KEY_ENV} (and shadow with it), or pass "
            "allow_unauthenticated=True (CLI: --allow-unauthenticated)")
    cache.identity.check_compatible(manifest.identity, what=f"shadow session {session_id!r}")
    report = RecoveryReport(sessions=[session_id])
    ids: list[int | None] = [None] * len(manifest.blocks)
    todo: list[tuple[int, BlockRecord]] = []
    for pos, rec in enumerate(manifest.blocks):
        if rec.key is not None:
            hit = cache.lookup([bytes.fromhex(rec.key)], rec.tenant)  # type: ignore[list-item]
            if hit:
                ids[pos] = hit[0]
                report.already_present += 1
                continue
        todo.append((pos, rec))

    sizes = manifest.block_nbytes
    chunk_blocks = max(1, chunk_bytes // manifest.bytes_per_block)
    chunks = _plan(manifest, todo, chunk_blocks)
    present = [bid for bid in ids if bid is not None]
    reader = _ChunkReader(store, manifest, chunks)
    try:
        _import_chunks(cache, session_id, _prefetched(reader.read, chunks), report, ids,
                       sizes, progress)
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

    if repin:
        to_pin = [bid for rec, bid in zip(manifest.blocks, ids, strict=True)
                  if rec.pinned and bid is not None]
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
                       len(report.skipped), len(manifest.blocks), report.skipped[0].reason)
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
