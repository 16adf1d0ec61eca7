"""The cache's chunk index (:mod:`gpu_cache.chunks`) as a manifest carries it.

A manifest holds the entries of :attr:`gpu_cache.TQGPUCache.chunks` whose blocks are
all among its own blocks, each under the tenant of those blocks, and the hops of the
reused K/V its blocks hold, so that chunk lookups work again after a recovery. Two
optional top-level fields (a manifest without them, as every manifest before them, reads
as an empty index; readers that predate them ignore them)::

    "chunks": [{"key": "<64 hex>", "tenant": "alice", "label": "memories",
                "blocks": ["<64 hex>", ...], "offset": 3, "position": 19,
                "length": 40, "hops": 0}, ...]          least recently used first
    "block_hops": {"<64 hex block key>": 1, ...}        only blocks with hops > 0

Both are covered by the manifest's MAC. Every field is type- and range-checked on read,
like a block record: the list itself malformed (not a list, more than
:data:`MAX_CHUNK_ENTRIES` entries) refuses the manifest; one malformed entry costs that
entry only (its reason is kept in :attr:`ChunkSection.refused` and reported by the
recovery), never a block or the session. An entry must name only blocks the manifest
holds a record of, all of its own tenant, and end in its last block. The writer runs its
entries through the same parser, so nothing is written that a reader would refuse.

Recovery puts back the entries whose blocks are all in the cache for their tenant once
the blocks are imported (an entry of a skipped block is dropped), and the hops.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpu_cache import InvalidNameError, validate_tenant
from gpu_cache.chunks import ChunkEntry, ChunkIndex
from gpu_cache.hashing import BlockHash
from shadow._fields import FieldError, int_field, list_field, mapping_field, validate_label

if TYPE_CHECKING:
    from gpu_cache import TQGPUCache
    from shadow.records import BlockRecord

__all__ = ["MAX_CHUNK_ENTRIES", "MAX_HOPS", "ChunkSection"]

#: Most chunk entries a manifest may hold (an index keeps 4096 by default); a writer
#: whose index holds more keeps its most recently used ones.
MAX_CHUNK_ENTRIES = 1 << 16
#: Most hops an entry or a block may record (entries past a few are never reused).
MAX_HOPS = 1 << 16
_KEY = re.compile("[0-9a-f]{64}")  # chunk and block keys: SHA-256 digests, lowercase hex


def _key(value: object, what: str) -> bytes:
    if not isinstance(value, str) or not _KEY.fullmatch(value):
        raise FieldError(f"{what} must be 64 lowercase hex digits, got {value!r:.40}")
    return bytes.fromhex(value)


def _entry_doc(key: bytes, entry: ChunkEntry) -> dict[str, Any]:
    return {"key": key.hex(), "tenant": entry.tenant, "label": entry.label,
            "blocks": [bytes(k).hex() for k in entry.block_keys], "offset": entry.offset,
            "position": entry.position, "length": entry.length, "hops": entry.hops}


def _parse_entry(raw: object, what: str, held: set[tuple[str, bytes]],
                 block_size: int) -> tuple[bytes, ChunkEntry]:
    """One entry, every field checked; ``held``: the manifest's (tenant, block key)s.

    Raises:
        FieldError: (a ``ValueError``) naming the bad field.
        KeyError: a missing field.
    """
    data = mapping_field(raw, what)
    key = _key(data["key"], f"{what}.key")
    try:
        tenant = validate_tenant(data["tenant"])
    except InvalidNameError as exc:
        raise FieldError(f"{what}.tenant: {exc}") from None
    label = validate_label(data["label"], f"{what}.label")
    raw_blocks = list_field(data["blocks"], f"{what}.blocks")
    if not 1 <= len(raw_blocks) <= len(held):
        raise FieldError(f"{what}.blocks must name 1-{len(held)} blocks (the manifest's), "
                         f"got {len(raw_blocks)}")
    blocks = tuple(BlockHash(_key(b, f"{what}.blocks[{j}]")) for j, b in enumerate(raw_blocks))
    for j, bk in enumerate(blocks):
        if (tenant, bk) not in held:
            raise FieldError(f"{what}.blocks[{j}] names block {bk.hex()[:12]}..., of which "
                             f"the manifest holds no readable record of tenant {tenant!r}")
    offset = int_field(data["offset"], f"{what}.offset", 0, block_size - 1)
    n = len(blocks)
    # the chunk starts in the first block and ends in the last: no block is there for nothing
    length = int_field(data["length"], f"{what}.length",
                       max(1, (n - 1) * block_size - offset + 1), n * block_size - offset)
    return key, ChunkEntry(tenant=tenant, label=label, block_keys=blocks, offset=offset,
                           position=int_field(data["position"], f"{what}.position"),
                           length=length,
                           hops=int_field(data["hops"], f"{what}.hops", 0, MAX_HOPS))


def _held(blocks: Sequence[BlockRecord]) -> set[tuple[str, bytes]]:
    return {(b.tenant, bytes.fromhex(b.key)) for b in blocks if b.key is not None}


@dataclass(slots=True)
class ChunkSection:
    """A manifest's chunk entries and block hops.

    Attributes:
        entries: ``(chunk key, entry)``, least recently used first.
        block_hops: block key -> hops of the reused K/V it holds (> 0 only).
        refused: why each entry or hop that could not be read was left out (not stored).
    """

    entries: list[tuple[bytes, ChunkEntry]] = field(default_factory=list)
    block_hops: dict[BlockHash, int] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)

    def to_doc(self) -> dict[str, Any]:
        """The manifest's fields (none when there is nothing to persist: such a manifest
        is the same as one written before chunks existed)."""
        doc: dict[str, Any] = {}
        if self.entries:
            doc["chunks"] = [_entry_doc(k, e) for k, e in self.entries]
        if self.block_hops:
            doc["block_hops"] = {bytes(k).hex(): h for k, h in self.block_hops.items()}
        return doc

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any], blocks: Sequence[BlockRecord],
                 block_size: int) -> ChunkSection:
        """Parse a manifest's ``chunks`` and ``block_hops`` (both optional).

        Raises:
            FieldError: either is not of its type, or holds more items than allowed
                (the manifest is refused, as for a malformed ``blocks`` list).
        """
        section = cls()
        raw_entries = doc.get("chunks")
        raw_hops = doc.get("block_hops")
        if raw_entries is None and raw_hops is None:
            return section
        held = _held(blocks)
        entries = list_field([] if raw_entries is None else raw_entries, "chunks")
        if len(entries) > MAX_CHUNK_ENTRIES:
            raise FieldError(f"chunks holds {len(entries)} entries, more than the "
                             f"{MAX_CHUNK_ENTRIES} a manifest may hold")
        hops = mapping_field({} if raw_hops is None else raw_hops, "block_hops")
        if len(hops) > len(held):
            raise FieldError(f"block_hops names {len(hops)} blocks, more than the manifest's "
                             f"{len(held)} keyed blocks")
        seen: set[bytes] = set()
        for i, item in enumerate(entries):
            what = f"chunks[{i}]"
            try:
                key, entry = _parse_entry(item, what, held, block_size)
                if key in seen:
                    raise FieldError(f"{what}.key lists chunk {key.hex()[:12]}... twice")
            except KeyError as exc:
                section.refused.append(f"{what} is missing field {exc}")
                continue
            except (TypeError, ValueError) as exc:
                section.refused.append(f"{what} is malformed ({str(exc)[:160]})")
                continue
            seen.add(key)
            section.entries.append((key, entry))
        keys = {bk for _, bk in held}
        for raw_key, value in hops.items():
            what = f"block_hops[{str(raw_key)[:16]!r}]"
            try:
                bk = BlockHash(_key(raw_key, f"{what} key"))
                if bk not in keys:
                    raise FieldError(f"{what} names a block the manifest holds no readable "
                                     "record of")
                section.block_hops[bk] = int_field(value, what, 1, MAX_HOPS)
            except (TypeError, ValueError) as exc:
                section.refused.append(f"{what} is malformed ({str(exc)[:160]})")
        return section

    @classmethod
    def collect(cls, index: ChunkIndex, blocks: Sequence[BlockRecord],
                block_size: int) -> ChunkSection:
        """What a manifest of ``blocks`` persists of ``index``: the entries lying in those
        blocks under their tenant (each checked as a reader will), and their hops."""
        held = _held(blocks)
        section = cls()
        for tenant in sorted({t for t, _ in held}):
            for key, entry in index.items(tenant):
                try:
                    section.entries.append(_parse_entry(_entry_doc(key, entry), "chunk",
                                                        held, block_size))
                except (KeyError, TypeError, ValueError):
                    continue  # not in these blocks (or not a persistable entry)
        del section.entries[:-MAX_CHUNK_ENTRIES]
        for _, bk in held:
            hops = index.hops_of([BlockHash(bk)])
            if hops > 0:
                section.block_hops[BlockHash(bk)] = min(hops, MAX_HOPS)
        return section

    def restore(self, cache: TQGPUCache, blocks: Sequence[BlockRecord]) -> tuple[int, int]:
        """Put the entries whose blocks are all in ``cache`` for their tenant back into
        its index, and the hops of the blocks present (taints only ever rise).

        A block the cache held already was not imported: its K/V are the cache's, so an
        entry over it is put back no fewer hops away than the cache records for it. An
        entry the cache holds already, valid and as few hops away, is kept.

        Returns:
            ``(restored, dropped)``: entries stored, and entries left out because a
            block of theirs is not in the cache (skipped by the recovery).
        """
        index = cache.chunks
        dropped = 0
        todo: list[tuple[bytes, ChunkEntry]] = []
        for key, entry in self.entries:
            if len(cache.lookup(entry.block_keys, entry.tenant)) < len(entry.block_keys):
                dropped += 1
                continue
            live = index.hops_of(entry.block_keys)  # before this manifest's taints
            todo.append((key, entry if live <= entry.hops
                         else dataclasses.replace(entry, hops=live)))
        tenant_of = {bk: t for t, bk in _held(blocks)}
        for bk, hops in self.block_hops.items():
            tenant = tenant_of.get(bk)
            if tenant is not None and cache.lookup([bk], tenant):
                index.taint([bk], hops)
        restored = 0
        for key, entry in todo:
            if entry.hops > 0:
                index.taint(entry.block_keys, entry.hops)
            held = index.get(key, entry.tenant)
            keep = held if (held is not None and held.hops <= entry.hops and
                            len(cache.lookup(held.block_keys, held.tenant))
                            == len(held.block_keys)) else None
            restored += index.put(key, entry, keep=keep)
        return restored, dropped
