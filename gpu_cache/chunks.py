"""Chunks by content: where a labelled run of tokens (a prompt layer, a conversation
turn) already has K/V in the cache, whatever came before it.

Block keys chain over everything before a block, so a layer that changes in the middle
of a prompt gives every later block a new key, although the text after it is mostly
the same as last turn. :class:`ChunkIndex` keys a chunk by what it *is* alone:
``sha256(identity | tenant | label | token ids)``, and remembers where its K/V lie: the
chained keys of the blocks that hold it, its offset in the first of them and the
position it was computed at. A caller that finds a chunk at another position re-rotates
its keys by the position delta (RoPE) and repairs the seams (see
:mod:`contextkit.engine.chunks`).

The index holds no K/V and no block ids: an entry names blocks by their keys, so it is
valid exactly as long as those blocks are cached (any tier) and a stale entry is
dropped on lookup. Entries are tenant-salted (another tenant's identical text has
another key) and bounded (least recently used first). Nothing here imports an engine:
the vLLM connector can key its DDR tier's chunks the same way.

A chunk whose text changed a little (a status line whose figures moved) has a new key.
The index also remembers, per ``(tenant, label, first tokens)``, the token ids of the
last few chunks registered under that signature (:meth:`ChunkIndex.versions`), so a
caller can align the new text against an earlier version and reuse the tokens they
share (:mod:`contextkit.engine.chunks`). Versions live in memory only.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from gpu_cache.hashing import BlockHash

__all__ = ["ChunkEntry", "ChunkIndex", "chunk_key"]

#: Entries an index keeps by default (a few hundred prompts' layers and turns).
DEFAULT_MAX_ENTRIES = 4096

#: Versions kept per signature (:meth:`ChunkIndex.versions`), most recent first.
VERSIONS_PER_SIGNATURE = 4


def chunk_key(identity_digest: bytes, tenant: str, label: str,
              token_ids: Sequence[int]) -> bytes:
    """Key of a chunk: ``sha256(identity | tenant | label | token ids)``, each part
    length-prefixed (no concatenation of two parts can collide with another)."""
    h = hashlib.sha256(b"contextkit-chunk-v1")
    h.update(identity_digest)
    for part in (tenant.encode("utf-8"), label.encode("utf-8")):
        h.update(struct.pack("<I", len(part)))
        h.update(part)
    h.update(struct.pack(f"<I{len(token_ids)}i", len(token_ids), *token_ids))
    return h.digest()


@dataclass(frozen=True, slots=True)
class ChunkEntry:
    """Where one chunk's K/V lie.

    Attributes:
        tenant: whose chunk (its key is salted with it too).
        label: the layer or turn label it was registered under.
        block_keys: chained keys of the blocks that hold it, in order.
        offset: the chunk's first token's slot in the first of those blocks.
        position: the absolute position its first token was computed at.
        length: tokens.
        hops: 0 when its K/V were computed in full context; ``n + 1`` when they were
            reused from an ``n``-hop entry (re-rotated, the seams repaired) and not
            recomputed since.
        lead: a digest of the tokens right before it where it was computed, or None: a
            caller that places it after the same tokens may skip its seam (the vLLM
            connector's planner sets and reads it).
    """

    tenant: str
    label: str
    block_keys: tuple[BlockHash, ...]
    offset: int
    position: int
    length: int
    hops: int = 0
    lead: bytes | None = None


class ChunkIndex:
    """Chunk key -> :class:`ChunkEntry`, least recently used evicted past ``max_entries``.

    Args:
        identity_digest: the cache identity's digest (salts every key).
        max_entries: entries kept.
    """

    def __init__(self, identity_digest: bytes, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.identity_digest = identity_digest
        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, ChunkEntry] = OrderedDict()
        # block key -> hops of the reused K/V the block holds (absent: computed in
        # full context); bounded like the entries.
        self._hops: OrderedDict[BlockHash, int] = OrderedDict()
        # signature -> [(tenant, token ids, chunk key)], most recent first
        self._versions: OrderedDict[bytes, list[tuple[str, tuple[int, ...], bytes]]] = \
            OrderedDict()
        self._lock = threading.Lock()

    def key(self, tenant: str, label: str, token_ids: Sequence[int]) -> bytes:
        """The chunk key of ``token_ids`` under ``label`` for ``tenant``."""
        return chunk_key(self.identity_digest, tenant, label, token_ids)

    def get(self, key: bytes, tenant: str) -> ChunkEntry | None:
        """The entry under ``key`` if it is ``tenant``'s (marks it recently used)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.tenant != tenant:
                return None
            self._entries.move_to_end(key)
            return entry

    def put(self, key: bytes, entry: ChunkEntry, *, keep: ChunkEntry | None = None) -> bool:
        """Register ``entry`` under ``key``, unless ``keep`` (the caller found the entry
        held there still valid and fewer hops from a full computation) is still there.

        Returns:
            Whether ``entry`` was stored.
        """
        with self._lock:
            held = self._entries.get(key)
            if keep is not None and held == keep:
                self._entries.move_to_end(key)
                return False
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
            return True

    def taint(self, block_keys: Sequence[BlockHash], hops: int) -> None:
        """Record that these blocks hold K/V reused ``hops`` hops from a full
        computation (the most recorded for a block counts)."""
        with self._lock:
            for bk in block_keys:
                self._hops[bk] = max(hops, self._hops.get(bk, 0))
                self._hops.move_to_end(bk)
            while len(self._hops) > 4 * self.max_entries:
                self._hops.popitem(last=False)

    def hops_of(self, block_keys: Sequence[BlockHash]) -> int:
        """The most hops any of these blocks' K/V are from a full computation."""
        with self._lock:
            return max((self._hops.get(bk, 0) for bk in block_keys), default=0)

    def signature(self, tenant: str, label: str, token_ids: Sequence[int]) -> bytes:
        """The key under which versions of a chunk starting with ``token_ids`` (its first
        tokens) are kept for ``tenant`` and ``label``."""
        return chunk_key(self.identity_digest, tenant, "\x00versions:" + label, token_ids)

    def note_version(self, signature: bytes, tenant: str, token_ids: Sequence[int],
                     key: bytes) -> None:
        """Remember that the chunk ``token_ids`` (registered under ``key``) is the latest
        version under ``signature``."""
        ids = tuple(token_ids)
        with self._lock:
            held = [v for v in self._versions.get(signature, []) if v[1] != ids]
            self._versions[signature] = [(tenant, ids, key), *held][:VERSIONS_PER_SIGNATURE]
            self._versions.move_to_end(signature)
            while len(self._versions) > self.max_entries:
                self._versions.popitem(last=False)

    def versions(self, signature: bytes, tenant: str) -> list[tuple[tuple[int, ...], bytes]]:
        """``tenant``'s versions under ``signature``: token ids and chunk key, most recent
        first (their entries may be gone: look each key up with :meth:`get`)."""
        with self._lock:
            return [(ids, key) for t, ids, key in self._versions.get(signature, [])
                    if t == tenant]

    def discard(self, key: bytes) -> None:
        """Forget ``key`` (its blocks are gone)."""
        with self._lock:
            self._entries.pop(key, None)

    def drop_tenant(self, tenant: str) -> int:
        """Forget every entry of ``tenant``; how many."""
        with self._lock:
            gone = [k for k, e in self._entries.items() if e.tenant == tenant]
            for k in gone:
                del self._entries[k]
            for sig in list(self._versions):
                kept = [v for v in self._versions[sig] if v[0] != tenant]
                if kept:
                    self._versions[sig] = kept
                else:
                    del self._versions[sig]
            return len(gone)

    def of_tenant(self, tenant: str) -> Iterator[ChunkEntry]:
        """``tenant``'s entries (a snapshot; no other tenant's)."""
        with self._lock:
            entries = [e for e in self._entries.values() if e.tenant == tenant]
        return iter(entries)

    def items(self, tenant: str) -> list[tuple[bytes, ChunkEntry]]:
        """``tenant``'s keys and entries, least recently used first (a snapshot; no
        other tenant's): what a shadow persists."""
        with self._lock:
            return [(k, e) for k, e in self._entries.items() if e.tenant == tenant]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
