"""TQGPUCache: a 5D TQ4 block cache with a device tier and a pinned host tier.

Layout (both tiers, same bytes)::

    k_packed, v_packed : uint8   [num_layers, num_blocks, block_size, num_kv_heads, head_dim/2]
    k_norms,  v_norms  : float32 [num_layers, num_blocks, block_size, num_kv_heads]

Because the block axis sits right after the layer axis, moving a set of blocks
between tiers is one strided copy per tensor across all layers: 4 copies per move
whatever the layer count. Blocks have stable ids; a block's slot changes when it
moves tiers. Running out of room returns ``None``; broken contracts raise.

The tier tensors live in :mod:`gpu_cache._storage` and the configuration in
:mod:`gpu_cache.config`; both are re-exported here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from gpu_cache._errors import (
    BlockStateError,
    CacheIdentityError,
    CodecInputError,
    UnknownBlockError,
)
from gpu_cache._records import check_import_record
from gpu_cache._storage import TENSOR_NAMES, LayerView, MoveStats, TierStorage, contiguous_run
from gpu_cache.calibration import key_offset_digest
from gpu_cache.chunks import ChunkIndex
from gpu_cache.codec import TQ4Codec
from gpu_cache.config import CacheConfig
from gpu_cache.hashing import BlockHash, hash_token_blocks
from gpu_cache.identity import CacheIdentity
from gpu_cache.ids import validate_tenant
from gpu_cache.metadata import (
    EVICTION_POLICIES,
    PINNED_PRIORITY,
    BlockMeta,
    BlockMetadataTable,
    Tier,
)

__all__ = ["TENSOR_NAMES", "CacheConfig", "LayerView", "MoveStats", "TQGPUCache", "TierStorage"]

logger = logging.getLogger(__name__)

_FREED_MEMORY = 1 << 20  # remember this many freed ids for precise errors


class TQGPUCache:
    """Tiered TQ4 KV block cache with semantic metadata.

    Args:
        identity: model and codec identity; salts every block key.
        config: tier sizes, placement and eviction policy.
        key_offsets: optional per-head key offsets ``[num_layers, num_kv_heads, head_dim]``
            (see :mod:`gpu_cache.calibration`); their digest must be the identity's
            ``key_offset_digest``.

    Raises:
        CacheIdentityError: key offsets that do not match the identity.
    """

    def __init__(self, identity: CacheIdentity, config: CacheConfig,
                 key_offsets: torch.Tensor | None = None) -> None:
        self.identity = identity
        self.config = config
        if config.device is not None:
            device = torch.device(config.device)
        else:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        # As tensors report it ("cuda" -> "cuda:0"), so device checks compare equal.
        self.device = torch.empty(0, device=device).device
        pin = config.pin_host_memory
        if pin is None:
            pin = torch.cuda.is_available()
        if pin and not torch.cuda.is_available():
            logger.warning("pin_host_memory requested without CUDA; host tier stays pageable")
            pin = False
        self.codec = TQ4Codec(identity.head_dim, seed=identity.rotation_seed, device=device)
        self.key_offsets = self._checked_offsets(identity, key_offsets, device)
        self.block_size = identity.block_size
        self.policy = EVICTION_POLICIES[config.eviction_policy]
        self.metadata = BlockMetadataTable(default_priority=config.default_priority)
        self._tiers = {
            Tier.DEVICE: TierStorage(identity, config.num_device_blocks, device, pin=False),
            Tier.HOST: TierStorage(identity, config.num_host_blocks, torch.device("cpu"),
                                   pin=bool(pin)),
        }
        self._identity_digest = identity.digest()
        #: Chunks by content (layers, turns) wherever they sit: :mod:`gpu_cache.chunks`.
        self.chunks = ChunkIndex(self._identity_digest)
        self._keys: dict[BlockHash, int] = {}
        self._next_id = 0
        # Recently freed ids -> why, so a stale id gets the right error. Bounded.
        self._freed: OrderedDict[int, str] = OrderedDict()
        self._lock = threading.RLock()
        self.stats = MoveStats()

    @staticmethod
    def _checked_offsets(identity: CacheIdentity, offsets: torch.Tensor | None,
                         device: torch.device) -> torch.Tensor | None:
        if key_offset_digest(offsets) != identity.key_offset_digest:
            raise CacheIdentityError(
                "key offsets do not match identity.key_offset_digest "
                f"({key_offset_digest(offsets) or 'none'} vs "
                f"{identity.key_offset_digest or 'none'}); build the identity with "
                "key_offset_digest=gpu_cache.calibration.key_offset_digest(offsets)"
            )
        if offsets is None:
            return None
        want = (identity.num_layers, identity.num_kv_heads, identity.head_dim)
        if tuple(offsets.shape) != want:
            raise CodecInputError(f"key_offsets must have shape {want}, got "
                                  f"{tuple(offsets.shape)}")
        return offsets.to(device, torch.float32).contiguous()

    def key_offset(self, layer: int) -> torch.Tensor | None:
        """The ``[num_kv_heads, head_dim]`` key offset of a layer, or None."""
        return None if self.key_offsets is None else self.key_offsets[layer]

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the cache's (reentrant) lock: no block moves or is freed meanwhile."""
        with self._lock:
            yield

    # ------------------------------------------------------------------ shape
    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V, packed and norms."""
        return self.identity.bytes_per_block

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size

    def storage(self, tier: Tier) -> TierStorage:
        return self._tiers[tier]

    def capacity(self, tier: Tier) -> int:
        return self._tiers[tier].num_blocks

    def num_free(self, tier: Tier) -> int:
        return self._tiers[tier].num_free

    def num_used(self, tier: Tier) -> int:
        return self.capacity(tier) - self.num_free(tier)

    def layer_view(self, layer: int, tier: Tier = Tier.DEVICE) -> LayerView:
        """Views of one layer of a tier, for kernels: ``[num_blocks, block_size, H, ...]``."""
        if not 0 <= layer < self.identity.num_layers:
            raise IndexError(f"layer {layer} out of range 0..{self.identity.num_layers - 1}")
        s = self._tiers[tier]
        return LayerView(s.k_packed[layer], s.k_norms[layer], s.v_packed[layer], s.v_norms[layer])

    # ------------------------------------------------------------------ allocation
    def allocate(
        self,
        num_blocks: int,
        tier: Tier = Tier.DEVICE,
        *,
        tenant: str = "default",
        source_layer: str = "unassigned",
        importance: float = 0.5,
    ) -> list[int] | None:
        """Allocate blocks in ``tier``, evicting by semantic priority if needed.

        Device evictions spill to the host tier when it has room (or can make room)
        and are dropped otherwise; host evictions drop blocks.

        Returns:
            New block ids, or ``None`` when the tier cannot make room (nothing changes).

        Raises:
            InvalidNameError: ``tenant`` breaks the naming rule of :mod:`gpu_cache.ids`.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        validate_tenant(tenant)
        with self._lock:
            if not self._make_room(tier, num_blocks, protect=()):
                return None
            slots = self._tiers[tier].take(num_blocks)
            assert slots is not None
            now = time.time()
            ids = []
            for slot in slots.tolist():
                bid = self._next_id
                self._next_id += 1
                self.metadata.add(BlockMeta(
                    block_id=bid, source_layer=source_layer, importance=importance,
                    created_at=now, last_attended=now,
                    eviction_priority=self.metadata.priority_for(source_layer),
                    token_range=(0, 0), tenant_slug=tenant, tier=tier, slot=slot,
                ))
                ids.append(bid)
            return ids

    def _make_room(self, tier: Tier, needed: int, protect: Iterable[int]) -> bool:
        # Only called with self._lock held.
        """Evict until ``needed`` slots are free in ``tier``; False (no change) if impossible."""
        storage = self._tiers[tier]
        short = needed - storage.num_free
        if short <= 0:
            return True
        if needed > storage.num_blocks:
            return False
        victims = self.metadata.eviction_order(tier, self.policy, exclude=protect)
        if len(victims) < short:
            return False
        victim_ids = [m.block_id for m in victims[:short]]
        if tier is Tier.DEVICE:
            # Spill the victims to the host tier, never evicting what the caller protects
            # there (e.g. the very blocks a warm is about to bring up).
            keep = set(protect) | set(victim_ids)
            if self._spill(victim_ids, protect=keep) is not None:
                self.stats.evictions += len(victim_ids)
                return True
        self._remove(victim_ids, reason="evicted")
        self.stats.evictions += len(victim_ids)
        return True

    # ------------------------------------------------------------------ moves
    def warm_blocks(self, block_ids: Sequence[int]) -> list[int] | None:
        """Promote blocks from the host tier to the device tier (4 bulk copies).

        Blocks already on the device are left as they are. Device blocks outside
        ``block_ids`` may be evicted (spilled) to make room.

        Returns:
            Ids actually moved, or ``None`` when the device tier cannot make room
            (nothing moves).
        """
        with self._lock:
            metas = [self.metadata.get(b) for b in self._checked(block_ids)]
            todo = [m for m in metas if m.tier is Tier.HOST]
            if not todo:
                return []
            if not self._make_room(Tier.DEVICE, len(todo), protect=block_ids):
                return None
            self._move(todo, Tier.HOST, Tier.DEVICE)
            self.stats.warms += 1
            self.stats.blocks_warmed += len(todo)
            return [m.block_id for m in todo]

    def spill_blocks(self, block_ids: Sequence[int]) -> list[int] | None:
        """Demote blocks from the device tier to the host tier (4 bulk copies).

        Raises:
            BlockStateError: a block is pinned (unpin it first) or in use.

        Returns:
            Ids actually moved, or ``None`` when the host tier cannot make room.
        """
        with self._lock:
            for bid in self._checked(block_ids):
                self._check_movable(bid, "spilling")
            return self._spill(list(block_ids), protect=set(block_ids))

    def _check_movable(self, block_id: int, action: str) -> None:
        """Raise BlockStateError for a pinned or in-use block (``action`` names the caller)."""
        meta = self.metadata.get(block_id)
        if meta.pinned:
            raise BlockStateError(
                f"block {block_id} ({meta.source_layer}) is pinned and never leaves the device "
                f"tier; unpin it with PrefixPinManager.unpin() before {action} it"
            )
        if meta.ref_count:
            raise BlockStateError(f"block {block_id} is in use by {meta.ref_count} reader(s); "
                                  f"release it before {action} it")

    def _spill(self, block_ids: Sequence[int], protect: set[int]) -> list[int] | None:
        metas = [self.metadata.get(b) for b in block_ids]
        todo = [m for m in metas if m.tier is Tier.DEVICE]
        if not todo:
            return []
        if not self._make_room(Tier.HOST, len(todo), protect=protect):
            return None
        self._move(todo, Tier.DEVICE, Tier.HOST)
        self.stats.spills += 1
        self.stats.blocks_spilled += len(todo)
        return [m.block_id for m in todo]

    def remove_blocks(self, block_ids: Sequence[int]) -> None:
        """Free blocks in whatever tier they are.

        Raises:
            UnknownBlockError: an id the cache never allocated.
            BlockStateError: an id already freed (double free), or a pinned block.
        """
        with self._lock:
            ids = self._checked(block_ids)
            for bid in ids:
                self._check_movable(bid, "removing")
            self._remove(ids, reason="removed")
            self.stats.removes += 1

    def _remove(self, block_ids: Sequence[int], reason: str) -> None:
        by_tier: dict[Tier, list[int]] = {Tier.DEVICE: [], Tier.HOST: []}
        for bid in block_ids:
            meta = self.metadata.pop(bid)
            by_tier[meta.tier].append(meta.slot)
            if meta.key is not None and self._keys.get(meta.key) == bid:
                del self._keys[meta.key]
            self._freed[bid] = reason
            if len(self._freed) > _FREED_MEMORY:
                self._freed.popitem(last=False)
        for tier, slots in by_tier.items():
            self._tiers[tier].give_back(slots)

    def _checked(self, block_ids: Iterable[int]) -> list[int]:
        ids = list(block_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate block ids in {ids}; pass each block once")
        for bid in ids:
            reason = self._freed.get(bid)
            if reason == "removed":
                raise BlockStateError(
                    f"block {bid} was already freed (double free); drop your reference to it"
                )
            if reason == "evicted":
                raise UnknownBlockError(
                    f"block {bid} was evicted to make room; look its key up again with "
                    "lookup() or recompute it"
                )
            self.metadata.get(bid)  # raises UnknownBlockError
        return ids

    def _move(self, metas: list[BlockMeta], src: Tier, dst: Tier) -> None:
        """Move blocks between tiers: one copy per tensor whatever the layer count."""
        metas = sorted(metas, key=lambda m: m.slot)
        src_store, dst_store = self._tiers[src], self._tiers[dst]
        src_slots = np.array([m.slot for m in metas], dtype=np.int64)
        dst_slots = dst_store.take(len(metas))
        assert dst_slots is not None, "caller must make room first"
        copies = 0
        for s_t, d_t in zip(src_store.tensors(), dst_store.tensors(), strict=True):
            self._copy_blocks(s_t, src_slots, d_t, dst_slots)
            copies += 1
        if dst is Tier.HOST and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # host reads follow
        src_store.give_back(src_slots.tolist())
        for meta, slot in zip(metas, dst_slots.tolist(), strict=True):
            meta.tier = dst
            meta.slot = slot
        self.stats.copies += copies
        self.stats.last_move_copies = copies
        self.stats.bytes_moved += len(metas) * self.bytes_per_block

    @staticmethod
    def _copy_blocks(src: torch.Tensor, src_slots: np.ndarray, dst: torch.Tensor,
                     dst_slots: np.ndarray) -> None:
        """``dst[:, dst_slots] = src[:, src_slots]`` as one transfer between devices."""
        non_blocking = src.device != dst.device
        s_run, d_run = contiguous_run(src_slots), contiguous_run(dst_slots)
        if s_run and d_run:
            dst[:, d_run[0]:d_run[1]].copy_(src[:, s_run[0]:s_run[1]], non_blocking=non_blocking)
            return
        if s_run:
            moved = src[:, s_run[0]:s_run[1]]
        else:
            moved = src.index_select(1, torch.from_numpy(src_slots).to(src.device))
            if moved.device.type == "cpu" and dst.device.type == "cuda":
                moved = moved.pin_memory()
        if d_run:
            dst[:, d_run[0]:d_run[1]].copy_(moved, non_blocking=non_blocking)
        else:
            index = torch.from_numpy(dst_slots).to(dst.device)
            dst.index_copy_(1, index, moved.to(dst.device, non_blocking=non_blocking))

    # ------------------------------------------------------------------ keys
    def block_keys(self, token_ids: Sequence[int], tenant: str,
                   parent: BlockHash | None = None) -> list[BlockHash]:
        """Content keys of the full blocks of ``token_ids`` under this identity and tenant.

        Raises:
            InvalidNameError: ``tenant`` breaks the naming rule of :mod:`gpu_cache.ids`.
        """
        validate_tenant(tenant)
        return hash_token_blocks(self._identity_digest, tenant, token_ids, self.block_size, parent)

    def set_key(self, block_id: int, key: BlockHash) -> None:
        """Register a block under its content key (later calls find it by key)."""
        with self._lock:
            meta = self.metadata.get(block_id)
            if meta.key is not None and self._keys.get(meta.key) == block_id:
                del self._keys[meta.key]
            meta.key = key
            self._keys[key] = block_id

    def lookup(self, keys: Sequence[BlockHash], tenant: str) -> list[int]:
        """Block ids for the longest prefix of ``keys`` held in any tier for ``tenant``.

        Raises:
            InvalidNameError: ``tenant`` breaks the naming rule of :mod:`gpu_cache.ids`.
        """
        validate_tenant(tenant)
        found: list[int] = []
        with self._lock:
            for key in keys:
                bid = self._keys.get(key)
                if bid is None:
                    break
                meta = self.metadata.get(bid)
                if meta.tenant_slug != tenant:  # keys are tenant-salted; belt and braces
                    break
                found.append(bid)
        return found

    # ------------------------------------------------------------------ access
    def block_table(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Device slots of blocks (int32 on the device) for the attention kernels.

        Raises:
            BlockStateError: a block is not in the device tier (warm it first).
        """
        slots = []
        with self._lock:
            for bid in self._checked(block_ids):
                meta = self.metadata.get(bid)
                if meta.tier is not Tier.DEVICE:
                    raise BlockStateError(
                        f"block {bid} is in the {meta.tier.value} tier; call warm_blocks() "
                        "before attending over it"
                    )
                slots.append(meta.slot)
        return torch.tensor(slots, dtype=torch.int32, device=self.device)

    def slot_mapping(self, block_ids: Sequence[int], start: int, num_tokens: int) -> torch.Tensor:
        """Flat device slots for tokens ``start .. start+num_tokens`` of a block sequence."""
        table = self.block_table(block_ids).to(torch.int64)
        pos = torch.arange(start, start + num_tokens, device=self.device)
        if num_tokens and int(pos[-1]) >= len(block_ids) * self.block_size:
            need = (start + num_tokens - 1) // self.block_size + 1
            raise CodecInputError(f"tokens up to {start + num_tokens} need {need} blocks, got "
                                  f"{len(block_ids)}; allocate more blocks")
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def acquire(self, block_ids: Sequence[int]) -> None:
        """Protect blocks from eviction while a reader uses them (reference count)."""
        with self._lock:
            for bid in self._checked(block_ids):
                self.metadata.get(bid).ref_count += 1

    def release(self, block_ids: Sequence[int]) -> None:
        with self._lock:
            for bid in self._checked(block_ids):
                meta = self.metadata.get(bid)
                if meta.ref_count <= 0:
                    raise BlockStateError(f"block {bid} released more often than acquired")
                meta.ref_count -= 1

    # ------------------------------------------------------------------ export / import
    def export_blocks(self, block_ids: Sequence[int], *,
                      block_major: bool = False) -> dict[str, torch.Tensor]:
        """CPU copies of blocks' bytes, in the order given.

        Args:
            block_ids: blocks to copy (any tiers).
            block_major: ``[n, num_layers, block_size, H, ...]`` (each block one
                contiguous byte range, as shadows store them) instead of the cache's
                own layer-major ``[num_layers, n, block_size, H, ...]``.

        Runs of consecutive slots in one tier are copied with one strided copy per
        tensor, so exporting a session allocated together costs about a memcpy.
        """
        with self._lock:
            metas = [self.metadata.get(b) for b in self._checked(block_ids)]
            n = len(metas)
            host = self._tiers[Tier.HOST]
            out: dict[str, torch.Tensor] = {}
            for name, like in zip(TENSOR_NAMES, host.tensors(), strict=True):
                shape = ((n, like.shape[0], *like.shape[2:]) if block_major
                         else (like.shape[0], n, *like.shape[2:]))
                out[name] = torch.empty(shape, dtype=like.dtype)
            i = 0
            while i < n:
                tier, slot = metas[i].tier, metas[i].slot
                j = i + 1
                while j < n and metas[j].tier is tier and metas[j].slot == slot + (j - i):
                    j += 1
                for name, src in zip(TENSOR_NAMES, self._tiers[tier].tensors(), strict=True):
                    run = src[:, slot:slot + (j - i)]
                    if block_major:
                        out[name][i:j].copy_(run.transpose(0, 1))
                    else:
                        out[name][:, i:j].copy_(run)
                i = j
            return out

    def import_blocks(
        self,
        tensors: dict[str, torch.Tensor],
        metas: Sequence[dict[str, object]],
        tier: Tier = Tier.HOST,
        *,
        block_major: bool = False,
    ) -> list[int] | None:
        """Write blocks into ``tier`` (4 copies) with their metadata; keys are re-registered.

        Args:
            tensors: as returned by :meth:`export_blocks` (layer-major, or
                block-major with ``block_major=True``).
            metas: per block: ``source_layer``, ``importance``, ``token_range``,
                ``tenant_slug``, optional ``key`` (bytes) and ``num_tokens``.
            tier: where the blocks go. Making room may evict other blocks of that
                tier by priority, as any allocation does.
            block_major: ``tensors`` are ``[n, num_layers, ...]``.

        Returns:
            New block ids, or ``None`` when the tier cannot make room.
        """
        n = len(metas)
        ref = self._tiers[tier]
        records = [check_import_record(i, m, self.block_size) for i, m in enumerate(metas)]
        if block_major:
            tensors = {name: t.transpose(0, 1) for name, t in tensors.items()}
        for name, t_ref in zip(TENSOR_NAMES, ref.tensors(), strict=True):
            t = tensors[name]
            want = (t_ref.shape[0], n, *t_ref.shape[2:])
            if tuple(t.shape) != want or t.dtype != t_ref.dtype:
                raise CodecInputError(f"{name} must be {t_ref.dtype} {want}, got {t.dtype} "
                                      f"{tuple(t.shape)}; it was exported from another layout")
        with self._lock:
            ids = self.allocate(n, tier)
            if ids is None:
                return None
            slots = np.array([self.metadata.get(b).slot for b in ids], dtype=np.int64)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            for name, t_dst in zip(TENSOR_NAMES, ref.tensors(), strict=True):
                self._copy_blocks(tensors[name], np.arange(n), t_dst, slots)
            for bid, rec in zip(ids, records, strict=True):
                self.metadata.annotate(
                    bid, source_layer=rec.source_layer, importance=rec.importance,
                    token_range=rec.token_range, tenant_slug=rec.tenant,
                    num_tokens=rec.num_tokens)
                if rec.key is not None:
                    self.set_key(bid, rec.key)
            return ids

    # ------------------------------------------------------------------ reporting
    def summary(self) -> dict[str, object]:
        """Occupancy per tier, pins and move counters."""
        with self._lock:
            return {
                "identity": self.identity.to_dict(),
                "device": str(self.device),
                "host_pinned": self._tiers[Tier.HOST].pinned,
                "bytes_per_token": self.bytes_per_token,
                "tiers": {
                    t.value: {"capacity": self.capacity(t), "used": self.num_used(t),
                              "bytes": self._tiers[t].nbytes}
                    for t in Tier
                },
                "pinned_blocks": len(self.metadata.pinned()),
                "keys": len(self._keys),
                "moves": {
                    "warms": self.stats.warms, "spills": self.stats.spills,
                    "evictions": self.stats.evictions, "bytes_moved": self.stats.bytes_moved,
                },
            }

    def set_pinned(self, block_id: int, pinned: bool, now: float | None = None) -> None:
        """Low-level pin flag used by :class:`PrefixPinManager`; prefer the manager
        (it enforces the pin quotas of :class:`~gpu_cache.config.PinConfig`)."""
        with self._lock:
            meta = self.metadata.get(block_id)
            if pinned and not meta.pinned:
                meta.pinned_at = time.time() if now is None else now
            meta.pinned = pinned
            meta.eviction_priority = (PINNED_PRIORITY if pinned
                                      else self.metadata.priority_for(meta.source_layer))


