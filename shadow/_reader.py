"""The mechanism of a recovery: plan reads, read chunks, verify every block, import.

Blocks are grouped by segment into chunks of nearby blocks; a chunk is read tensor by
tensor into one of three reused page-aligned buffer sets while an earlier chunk is
imported. Every block is verified before it is imported: with a key, its MAC
(:func:`shadow.auth.block_mac`: Poly1305 of its tensor slices under a one-time key
bound to the key, identity, session, tenant, content key, position and the record's
nonce); without one, its CRC-32s. The facade is :func:`shadow.recovery.recover_session`.
"""

from __future__ import annotations

import hmac
import mmap
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gpu_cache import TENSOR_NAMES, Tier, TQGPUCache
from shadow._errors import BlobNotFoundError
from shadow._report import RecoveryReport, SkippedBlock
from shadow.auth import BlockBinding, block_mac
from shadow.manifest import Manifest, block_dtypes, block_shapes, checksum
from shadow.records import BlockRecord
from shadow.stores import ShadowStore

__all__ = ["ChunkReader", "import_chunks", "plan_chunks", "prefetched"]

_NO_MAC = ("no block MAC with its nonce (written without a key, or by an earlier "
           "contextkit); re-shadow the session")
_BAD_MAC = "block MAC mismatch (its bytes changed after it was written)"
#: Buffer sets of a reader: one chunk imported while the next two are read.
_BUFFER_SETS = 3


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
    #: the checks still running on ``arrays``, each giving the blocks that fail it (see
    #: ChunkReader.settle)
    pending: list[Future[dict[int, str]]] = field(default_factory=list)


def plan_chunks(manifest: Manifest, todo: Sequence[tuple[int, BlockRecord]],
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


class ChunkReader:
    """Reads chunks into three reused buffer sets and verifies every block as it goes.

    Fresh buffers per chunk would page-fault on every read (as costly as the checks);
    three sets suffice because one chunk is being imported while at most the next two
    are read (:func:`prefetched`). The checks run in helper threads (without a key each
    tensor's CRC-32s from the moment it is read, ``zlib.crc32`` releases the GIL; with a
    key the chunk's MACs once all its tensors are read) and are awaited only by
    :meth:`settle`, just before the chunk is imported: the next chunks' reads overlap
    this chunk's checks.

    Args:
        store: where the session lives.
        manifest: the session's (authenticated) manifest.
        chunks: what :func:`plan_chunks` planned.
        key: the MAC key; with one, each block's MAC is checked (and its CRC-32s, which
            it covers, are not); without one, its CRC-32s.
    """

    def __init__(self, store: ShadowStore, manifest: Manifest, chunks: list[_Chunk],
                 key: bytes | None = None) -> None:
        self.store, self.manifest, self.key = store, manifest, key
        self.shapes, self.dtypes = block_shapes(manifest.identity), block_dtypes(manifest.identity)
        self.sizes = manifest.block_nbytes
        self.files = {s.segment_id: s.files for s in manifest.segments}
        self.segment_names = {s.segment_id: s.name for s in manifest.segments}
        self.identity_digest = manifest.identity.digest()
        span = max((c.records[-1][2] - c.first + 1 for c in chunks), default=0)
        self.buffers = [{name: _page_aligned((span, *self.shapes[name]), self.dtypes[name])
                         for name in TENSOR_NAMES} for _ in range(_BUFFER_SETS)]
        # CRC-32 runs at ~2.5 GB/s per core: two tensors checked at once keep up with fast
        # disks; Poly1305 runs at ~5 GB/s (holding the GIL: one MAC job per chunk)
        self.verifier = ThreadPoolExecutor(max_workers=2, thread_name_prefix="shadow-verify")
        self.turn = 0

    def close(self) -> None:
        self.verifier.shutdown(wait=True)

    def _verify(self, name: str, arr: np.ndarray, chunk: _Chunk, blocks_read: int
                ) -> dict[int, str]:
        """Blocks of ``chunk`` that fail in tensor ``name``: truncated, wrong CRC-32."""
        bad: dict[int, str] = {}
        for pos, rec, seg_idx in chunk.records:
            local = seg_idx - chunk.first
            if local >= blocks_read:
                bad[pos] = f"{name} blob is truncated"
            elif checksum(arr[local].reshape(-1).view(np.uint8)) != rec.checksums[name]:
                bad[pos] = f"{name} checksum mismatch"
        return bad

    def _check_macs(self, chunk: _Chunk, arrays: dict[str, np.ndarray],
                    blocks_read: dict[str, int]) -> dict[int, str]:
        """Blocks of ``chunk`` that are truncated, lack a MAC, or fail it."""
        assert self.key is not None
        m = self.manifest
        segment = self.segment_names[chunk.segment_id]
        bad: dict[int, str] = {}
        for pos, rec, seg_idx in chunk.records:
            local = seg_idx - chunk.first
            short = [name for name, got in blocks_read.items() if local >= got]
            if short:
                bad[pos] = f"{short[0]} blob is truncated"
                continue
            if rec.mac is None or rec.mac_nonce is None:
                bad[pos] = _NO_MAC
                continue
            binding = BlockBinding(identity=self.identity_digest, session_id=m.session_id,
                                   tenant=rec.tenant, key=rec.key, segment=segment,
                                   slot=seg_idx)
            want = block_mac(self.key, binding, bytes.fromhex(rec.mac_nonce),
                             [arrays[name][local] for name in TENSOR_NAMES])
            if not hmac.compare_digest(want, rec.mac):
                bad[pos] = _BAD_MAC
        return bad

    def read(self, chunk: _Chunk) -> _ReadChunk:
        """Read ``chunk`` into the next buffer set; its checks keep running (see
        :meth:`settle`)."""
        files = self.files[chunk.segment_id]
        span = chunk.records[-1][2] - chunk.first + 1
        buffers = self.buffers[self.turn]
        self.turn = (self.turn + 1) % len(self.buffers)
        arrays: dict[str, np.ndarray] = {}
        blocks_read: dict[str, int] = {}
        pending: list[Future[dict[int, str]]] = []
        try:
            for name in TENSOR_NAMES:
                arr = buffers[name][:span]
                arrays[name] = arr
                if not self.sizes[name]:  # the empty norms of fp16/native: nothing to read
                    continue
                got = self.store.read_into(files[name], chunk.first * self.sizes[name],
                                           memoryview(arr.reshape(-1).view(np.uint8)))  # type: ignore[arg-type]
                blocks_read[name] = got // self.sizes[name]
                if self.key is None:
                    pending.append(self.verifier.submit(self._verify, name, arr, chunk,
                                                        blocks_read[name]))
        except BlobNotFoundError:
            wait(pending)  # never leave a check running on a buffer
            return _ReadChunk(chunk, {}, {}, missing=files[name])
        except BaseException:
            wait(pending)
            raise
        if self.key is not None:
            pending.append(self.verifier.submit(self._check_macs, chunk, arrays, blocks_read))
        return _ReadChunk(chunk, arrays, {}, pending=pending)

    def settle(self, got: _ReadChunk) -> _ReadChunk:
        """Wait for ``got``'s checks and record the blocks that fail them."""
        if not got.pending:
            return got
        pending, got.pending = got.pending, []
        for future in pending:
            for pos, why in future.result().items():
                got.bad.setdefault(pos, why)
        return got

    def chunks(self, chunks: list[_Chunk]) -> Iterator[_ReadChunk]:
        """Every chunk read (the next one while this one is imported) and verified."""
        for got in prefetched(self.read, chunks):
            yield self.settle(got)


def prefetched(fn: Callable[[_Chunk], _ReadChunk], chunks: list[_Chunk]
               ) -> Generator[_ReadChunk, None, None]:
    """Read chunks ``i + 1`` and ``i + 2`` in a thread while chunk ``i`` is imported.

    Two reads queued keep the disk busy while a chunk's checks or import run long;
    with one, the disk idled ~10 % of a recovery here. Uses ``_BUFFER_SETS`` (3)
    buffer sets: the chunk being imported and the two being read.
    """
    if not chunks:
        return
    ahead = _BUFFER_SETS - 1
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shadow-read") as pool:
        futures = deque(pool.submit(fn, c) for c in chunks[:ahead])
        try:
            for i in range(len(chunks)):
                result = futures.popleft().result()
                if i + ahead < len(chunks):
                    futures.append(pool.submit(fn, chunks[i + ahead]))
                yield result
        finally:
            for future in futures:  # never leave a read running into a buffer
                future.cancel()
            wait(futures)


def import_chunks(cache: TQGPUCache, session_id: str, chunks: Iterator[_ReadChunk],
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
