"""Writing one segment: export blocks block-major, checksum (and MAC) them, stream them.

The mechanism under :class:`shadow.CacheShadow`: chunk ``i + 1`` is exported from the
cache and checksummed in a helper thread while chunk ``i`` is written, so the copy,
the CRC-32s and (with a key) every block's Poly1305 MAC overlap the store's writes. A
segment is written once, under names no earlier segment used
(:func:`shadow.manifest.new_segment_token`), and committed only whole.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from gpu_cache import TENSOR_NAMES, BlockMeta, TQGPUCache
from shadow.auth import BlockBinding, block_mac, new_block_nonces
from shadow.manifest import block_nbytes, checksum
from shadow.records import BlockRecord, SegmentRecord
from shadow.stores import ShadowStore

__all__ = ["SegmentWriter"]


@dataclass(slots=True)
class _Prepared:
    metas: list[BlockMeta]
    arrays: dict[str, np.ndarray]  # per tensor ``[n, L, BS, H, ...]`` C-contiguous
    checksums: dict[str, list[int]]
    macs: list[tuple[str, str]] | None  # (nonce, MAC) hex per block (with a key)


class SegmentWriter:
    """Writes blocks of ``cache`` into new segments of ``session_id`` in ``store``.

    Args:
        cache: the cache the blocks are exported from.
        store: where the segment's blobs go.
        session_id: the session the blocks' MACs are bound to.
        chunk_bytes: bytes exported and written per step.
        key: the MAC key; with one, every block record carries its MAC.
    """

    def __init__(self, cache: TQGPUCache, store: ShadowStore, session_id: str,
                 chunk_bytes: int, key: bytes | None) -> None:
        self.cache, self.store, self.session_id = cache, store, session_id
        self.chunk_bytes, self.key = chunk_bytes, key
        self.identity_digest = cache.identity.digest()

    def _check(self, rows: np.ndarray) -> list[int]:
        """CRC-32 of each row ``[n, bytes]``."""
        return [checksum(rows[k]) for k in range(rows.shape[0])]

    def _macs(self, metas: list[BlockMeta], rows: dict[str, np.ndarray], segment: str,
              first_slot: int) -> list[tuple[str, str]]:
        """(nonce, MAC) hex of each block: block ``i`` goes to slot ``first_slot + i``."""
        assert self.key is not None
        out = []
        for i, (m, nonce) in enumerate(zip(metas, new_block_nonces(len(metas)), strict=True)):
            binding = BlockBinding(identity=self.identity_digest, session_id=self.session_id,
                                   tenant=m.tenant_slug,
                                   key=m.key.hex() if m.key is not None else None,
                                   segment=segment, slot=first_slot + i)
            out.append((nonce.hex(), block_mac(self.key, binding, nonce,
                                               [rows[name][i] for name in TENSOR_NAMES])))
        return out

    def _prepare(self, metas: list[BlockMeta], checks: ThreadPoolExecutor, segment: str,
                 first_slot: int) -> _Prepared:
        """Copy blocks out block-major with per-block checksums (and MACs); each tensor's
        CRC-32s run in ``checks`` (zlib releases the GIL), the MACs in this thread."""
        cache = self.cache
        # Blocks freed since the plan was made are dropped; export_blocks copies runs of
        # consecutive slots with one strided copy each.
        with cache.locked():
            metas = [m for m in metas if m.block_id in cache.metadata]
            n = len(metas)
            exported = cache.export_blocks([m.block_id for m in metas], block_major=True)
        arrays = {name: exported[name].numpy() for name in TENSOR_NAMES}
        rows = {name: arrays[name].reshape(n, -1).view(np.uint8) for name in TENSOR_NAMES}
        pending = {name: checks.submit(self._check, rows[name]) for name in TENSOR_NAMES}
        macs = self._macs(metas, rows, segment, first_slot) if self.key is not None else None
        sums = {name: future.result() for name, future in pending.items()}
        return _Prepared(metas, arrays, sums, macs)

    def _prepared_chunks(self, metas: list[BlockMeta], segment: str) -> Iterator[_Prepared]:
        """Export and checksum chunk ``i + 1`` in threads while chunk ``i`` is written."""
        per_block = self.cache.bytes_per_block
        step = max(1, self.chunk_bytes // per_block)
        chunks = [metas[i:i + step] for i in range(0, len(metas), step)]
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shadow-export") as pool, \
                ThreadPoolExecutor(max_workers=2, thread_name_prefix="shadow-sum") as checks:
            future = pool.submit(self._prepare, chunks[0], checks, segment, 0)
            slot = 0
            for i in range(len(chunks)):
                prepared = future.result()
                slot += len(prepared.metas)  # blocks freed meanwhile take no slot
                if i + 1 < len(chunks):
                    future = pool.submit(self._prepare, chunks[i + 1], checks, segment, slot)
                yield prepared

    def _record(self, m: BlockMeta, segment: SegmentRecord, slot: int, prepared: _Prepared,
                i: int, sizes: dict[str, int]) -> BlockRecord:
        key = m.key.hex() if m.key is not None else None
        nonce = mac = None
        if self.key is not None:
            assert prepared.macs is not None
            nonce, mac = prepared.macs[i]
        return BlockRecord(
            key=key, source_layer=m.source_layer, importance=m.importance,
            token_range=(int(m.token_range[0]), int(m.token_range[1])),
            tenant=m.tenant_slug, pinned=m.pinned, num_tokens=m.num_tokens,
            segment_id=segment.segment_id, offsets={n: slot * sizes[n] for n in TENSOR_NAMES},
            checksums={n: prepared.checksums[n][i] for n in TENSOR_NAMES}, mac=mac,
            mac_nonce=nonce)

    def write(self, segment: SegmentRecord, metas: Sequence[BlockMeta]
              ) -> tuple[list[tuple[int, BlockRecord]], list[BlockMeta]]:
        """Stream blocks into ``segment``'s four blobs and commit them.

        Returns:
            ``(block id, record)`` per written block, and the blocks actually written
            (blocks freed meanwhile are dropped).
        """
        sizes = block_nbytes(self.cache.identity)
        writers = {name: self.store.open_writer(segment.files[name]) for name in TENSOR_NAMES}
        out: list[tuple[int, BlockRecord]] = []
        written: list[BlockMeta] = []
        try:
            for prepared in self._prepared_chunks(list(metas), segment.name):
                for name in TENSOR_NAMES:
                    if sizes[name]:  # the empty norms of fp16/native stay empty blobs
                        writers[name].write(prepared.arrays[name])
                for i, m in enumerate(prepared.metas):
                    record = self._record(m, segment, len(written) + i, prepared, i, sizes)
                    out.append((m.block_id, record))
                written += prepared.metas
            for name in TENSOR_NAMES:
                writers[name].commit()
        except BaseException:
            for w in writers.values():
                w.abort()
            raise
        return out, written
