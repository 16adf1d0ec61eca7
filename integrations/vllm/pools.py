"""Format pools of the connector's store: one cache per block format and key offsets.

A *pool* is one :class:`gpu_cache.TQGPUCache` (with its prefix pins and its shadow)
whose identity is the connector's key identity with the pool's ``codec`` (block
format) and ``key_offset_digest``. Blocks of one request may live in several pools
(e.g. the attention sink in ``fp16``, the rest in ``tq4``); block keys are computed
from the key identity, so a key names the same tokens in every pool.

Session names (shadow and local snapshot) follow one rule, :func:`session_name`: the
pool of the key identity itself keeps the plain name (``vllm``, ``vllm-recovered``:
what older connectors wrote), every other pool appends ``@<format>`` and, with key
offsets, ``.<first 8 hex digits of their digest>``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpu_cache import (
    CacheConfig,
    CacheIdentity,
    PinCapacityError,
    PrefixPinManager,
    Tier,
    TQGPUCache,
    formats,
)
from gpu_cache.calibration import key_offset_digest, mean_key_offsets
from gpu_cache.config import PinConfig
from integrations.vllm.config import ConnectorConfig, pin_advice
from shadow import CacheShadow, ShadowResult, ShadowStore

__all__ = [
    "CALIBRATION_BLOCKS",
    "OFFSET_FORMATS",
    "Pool",
    "assemble_parts",
    "calibrate_offsets",
    "decode_pool_blocks",
    "fit_budget",
    "format_summary",
    "pool_identity",
    "pool_suffix",
    "server_sessions",
    "session_name",
    "unpinned_reason",
]

logger = logging.getLogger(__name__)

#: Formats whose pools subtract per-head key offsets (when the policy asks for them).
OFFSET_FORMATS = ("tq4", "k5v4", "int8")

#: A format's offset pool is calibrated from the first save with at least this many
#: blocks of that format (smaller saves before it go to the format's plain pool).
CALIBRATION_BLOCKS = 8


@dataclass(slots=True, eq=False)
class Pool:
    """One format's cache, its pins and (when shadowing) its shadow session."""

    name: str  #: session suffix: "" for the key identity's pool, else "@fmt[.digest8]"
    identity: CacheIdentity
    cache: TQGPUCache
    pins: PrefixPinManager
    save_tier: Tier
    #: loaded from the local snapshot (then its shadow session is not recovered again)
    restored: bool = False
    #: blocks stored (or evicted) since the last :meth:`ConnectorStore.shadow_now`
    dirty: bool = False
    shadow: CacheShadow | None = None
    # shadow accounting: the last result and manifest already counted
    counted_result: ShadowResult | None = None
    seen_manifest: object = None

    @property
    def fmt(self) -> str:
        return self.identity.codec

    @classmethod
    def create(cls, base: CacheIdentity, identity: CacheIdentity,
               key_offsets: torch.Tensor | None, *, host_blocks: int, device_blocks: int,
               device: str | None, pins: PinConfig | None = None,
               eviction: str = "semantic") -> Pool:
        """A pool for ``identity`` whose tiers hold as many bytes as ``host_blocks`` /
        ``device_blocks`` blocks of the key identity ``base`` (at least one block each),
        its pins limited by ``pins`` (default: :class:`gpu_cache.config.PinConfig`'s),
        its victims picked by the ``eviction`` policy (``"semantic"`` or ``"lru"``).

        Raises:
            CacheIdentityError: offsets that do not match ``identity.key_offset_digest``.
        """
        ratio = base.bytes_per_block / identity.bytes_per_block
        cache = TQGPUCache(identity, CacheConfig(
            num_device_blocks=max(1, int(device_blocks * ratio)),
            num_host_blocks=max(1, int(host_blocks * ratio)), device=device,
            pins=pins or PinConfig(), eviction_policy=eviction),
            key_offsets=key_offsets)
        tier = Tier.HOST if cache.device.type == "cpu" else Tier.DEVICE
        return cls(name=pool_suffix(base, identity), identity=identity, cache=cache,
                   pins=PrefixPinManager(cache), save_tier=tier)


def held_bytes(pools: Sequence[Pool]) -> int:
    """Bytes the pools' DDR (host) tiers hold."""
    return sum(p.cache.num_used(Tier.HOST) * p.identity.bytes_per_block for p in pools)


def fit_budget(pools: Sequence[Pool], pool: Pool, num_blocks: int, budget: int,
               protect: Mapping[int, set[int]] | None = None) -> bool:
    """Evict across ``pools``, lowest semantic priority first, until ``num_blocks`` more
    blocks of ``pool`` fit ``budget`` bytes of DDR (host) tier.

    Each pool's tier could hold the whole budget, so without this a pool would evict
    its own higher-priority blocks while another kept lower ones. ``protect`` maps
    ``id(pool)`` to block ids never evicted here (the blocks the same save just
    stored). Returns False, evicting nothing, when even every other evictable block
    would not make room (the save then fails). On CUDA the device tier spills by each
    pool's own policy, as before.
    """
    tier = pool.save_tier
    if tier is not Tier.HOST:
        return True
    excess = held_bytes(pools) + num_blocks * pool.identity.bytes_per_block - budget
    if excess <= 0:
        return True
    protect = protect or {}
    candidates = [(p.cache.policy.priority(meta), p, meta.block_id) for p in pools
                  for meta in p.cache.metadata.eviction_order(tier, p.cache.policy,
                                                              exclude=protect.get(id(p), ()))]
    candidates.sort(key=lambda c: c[0])  # stable: ties keep each pool's own order
    victims: dict[int, list[int]] = {}
    freed = 0
    for _, victim_pool, bid in candidates:
        if freed >= excess:
            break
        victims.setdefault(id(victim_pool), []).append(bid)
        freed += victim_pool.identity.bytes_per_block
    if freed < excess:
        return False
    for p in pools:
        if id(p) in victims:
            p.cache.remove_blocks(victims[id(p)])
            p.cache.stats.evictions += len(victims[id(p)])
            p.dirty = True
    return True


def pool_identity(base: CacheIdentity, fmt: str, key_offsets: torch.Tensor | None = None
                  ) -> CacheIdentity:
    """The identity of ``base``'s pool of format ``fmt`` with ``key_offsets``."""
    return dataclasses.replace(base, codec=fmt, key_offset_digest=key_offset_digest(key_offsets))


def pool_suffix(base: CacheIdentity, identity: CacheIdentity) -> str:
    """``""`` for the key identity itself, else ``@<codec>`` plus ``.<digest[:8]>``
    with key offsets."""
    if identity == base:
        return ""
    suffix = f"@{identity.codec}"
    if identity.key_offset_digest:
        suffix += f".{identity.key_offset_digest[:8]}"
    return suffix


def session_name(prefix: str, base: CacheIdentity, identity: CacheIdentity) -> str:
    """The session (shadow or local snapshot) of the pool of ``identity``, for the
    session ``prefix`` (``config.session_id`` or ``LOCAL_SESSION``)."""
    return prefix + pool_suffix(base, identity)


def is_pool_session(prefix: str, session_id: str) -> bool:
    return session_id == prefix or session_id.startswith(prefix + "@")


def server_sessions(store: ShadowStore, prefix: str) -> list[str]:
    """Sessions in ``store`` with a manifest that belong to ``prefix``: the plain one
    and its pools' ``prefix@...`` sessions, sorted (the plain one first)."""
    found = {key.split("/", 1)[0] for key in store.list(prefix)
             if key.endswith("/manifest.json") and key.count("/") == 1}
    return sorted((sid for sid in found if is_pool_session(prefix, sid)),
                  key=lambda sid: (sid != prefix, sid))


def calibrate_offsets(k: torch.Tensor, index: Sequence[int]) -> torch.Tensor:
    """Per-head key offsets ``[L, H, D]`` from the keys of blocks ``index`` of ``k``
    (``[L, n, BS, H, D]``): the mean key of each layer and head over all their tokens."""
    idx = torch.tensor(list(index), dtype=torch.int64, device=k.device)
    per_layer = []
    for layer in range(k.shape[0]):
        keys = k[layer].index_select(0, idx).reshape(-1, k.shape[-2], k.shape[-1])
        per_layer.append(keys.to("cpu", torch.float32).transpose(0, 1))
    return mean_key_offsets(per_layer)


def format_summary(identity: CacheIdentity, counts: Iterable[tuple[CacheIdentity, int]]
                   ) -> dict[str, dict[str, Any]]:
    """Per format: ``blocks``, ``bytes``, ``bytes_per_token`` and ``vs_fp16`` (bytes per
    token over fp16 K/V of the same model, ``2 * 2 * L * H * D``) of blocks held in
    pools; ``counts`` gives ``(pool identity, blocks)`` pairs."""
    totals: dict[str, list[int]] = {}
    for ident, blocks in counts:
        row = totals.setdefault(ident.codec, [0, 0])
        row[0] += blocks
        row[1] += blocks * ident.bytes_per_block
    return {fmt: _stats_row(identity, blocks, nbytes)
            for fmt, (blocks, nbytes) in sorted(totals.items())}


def total_summary(identity: CacheIdentity, formats: dict[str, dict[str, Any]]
                  ) -> dict[str, Any]:
    """The same figures over all formats of a :func:`format_summary`."""
    blocks = sum(int(row["blocks"]) for row in formats.values())
    nbytes = sum(int(row["bytes"]) for row in formats.values())
    return _stats_row(identity, blocks, nbytes)


def _stats_row(identity: CacheIdentity, blocks: int, nbytes: int) -> dict[str, Any]:
    fp16 = 2 * 2 * identity.num_layers * identity.num_kv_heads * identity.head_dim
    per_token = nbytes / (blocks * identity.block_size) if blocks else 0.0
    return {"blocks": blocks, "bytes": nbytes, "bytes_per_token": per_token,
            "vs_fp16": per_token / fp16}


def combine_results(results: Sequence[ShadowResult]) -> ShadowResult | None:
    """One result for shadows of several pools (bytes and blocks summed)."""
    if not results:
        return None
    if len(results) == 1:
        return results[0]
    return ShadowResult(
        session_id=results[0].session_id, generation=max(r.generation for r in results),
        num_blocks=sum(r.num_blocks for r in results),
        blocks_written=sum(r.blocks_written for r in results),
        bytes_written=sum(r.bytes_written for r in results),
        manifest_bytes=sum(r.manifest_bytes for r in results),
        seconds=sum(r.seconds for r in results), compacted=any(r.compacted for r in results))


def decode_pool_blocks(pool: Pool, exported: dict[str, torch.Tensor]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool's exported blocks as float32 K/V, its key offsets added back."""
    return formats.decode_blocks(pool.fmt, exported, pool.cache.codec,
                                 pool.cache.key_offsets)


def decode_pool_layer_into(pool: Pool, exported: Mapping[str, torch.Tensor], layer: int,
                           out: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor
                           ) -> None:
    """One layer of a pool's exported blocks decoded straight into rows of ``out`` (a
    layer of vLLM's pages viewed as rows), its key offsets added back; see
    :func:`gpu_cache.formats.decode_layer_into`."""
    formats.decode_layer_into(pool.fmt, exported, layer, pool.cache.codec, out, k_rows,
                              v_rows, pool.cache.key_offsets)


def assemble_parts(parts: list[tuple[list[int], torch.Tensor, torch.Tensor]], n: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[L, n, ...]`` from per-pool parts ``(positions, k, v)``: runs of
    consecutive positions (the usual case: a sink block, then the rest) are copied
    as slices, anything else by index."""
    first = parts[0][1]
    shape = (first.shape[0], n, *first.shape[2:])
    k_out = torch.empty(shape, dtype=torch.float32, device=first.device)
    v_out = torch.empty(shape, dtype=torch.float32, device=first.device)
    for positions, k, v in parts:
        k, v = k.to(first.device), v.to(first.device)
        a, b = positions[0], positions[-1] + 1
        if b - a == len(positions):
            k_out[:, a:b].copy_(k)
            v_out[:, a:b].copy_(v)
        else:
            at = torch.tensor(positions, dtype=torch.int64, device=first.device)
            k_out.index_copy_(1, at, k)
            v_out.index_copy_(1, at, v)
    return k_out, v_out


def unpinned_reason(config: ConnectorConfig, base: CacheIdentity, pool: Pool, tenant: str,
                    num_new: int, exc: Exception) -> str:
    """One line: why ``num_new`` blocks of ``tenant`` labelled pinned stayed unpinned in
    ``pool`` (``exc``: what pinning raised), in the connector's own keys (``pin_share``,
    ``device_blocks``; see :func:`~integrations.vllm.config.pin_advice`)."""
    pins = pool.pins
    needed = pins.pinned_by_tenant().get(tenant, 0) + num_new
    if isinstance(exc, PinCapacityError) and needed > pins.tenant_quota:
        return pin_advice(config, tenant=tenant, needed=needed, quota=pins.tenant_quota,
                          pool_ratio=base.bytes_per_block / pool.identity.bytes_per_block)
    if isinstance(exc, PinCapacityError):
        return (f"tenant {tenant!r}: {num_new} blocks of its stable prefix are stored "
                f"unpinned: all tenants' pins fill their cap of {pins.total_cap} device "
                f"blocks (max(pin_share, 0.75) of device_blocks={config.device_blocks}) "
                "until other tenants' pins go idle; raise device_blocks in "
                "kv_connector_extra_config")
    return f"tenant {tenant!r}: blocks stored unpinned: {exc}"
