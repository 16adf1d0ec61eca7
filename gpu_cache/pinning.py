"""PrefixPinManager: keep stable prompt prefixes in the device tier, fairly across tenants.

Pins are a per-tenant, bounded resource (:class:`~gpu_cache.config.PinConfig`, part of
the cache's :class:`~gpu_cache.CacheConfig`):

- **quota**: one tenant pins at most ``tenant_share`` of the device tier. Asking for
  more raises :class:`~gpu_cache.PinCapacityError` (the tenant's own excess is the
  only pinning error);
- **cap**: all tenants together pin at most ``total_share`` of it, so a new tenant's
  unpinned work always has room. Past the cap :meth:`PrefixPinManager.try_pin` serves
  the prefix unpinned (and says why), after demoting idle and over-quota pins;
- **idle TTL**: a pinned block nobody attended or pinned again for ``idle_ttl_s`` is
  demoted: it becomes an ordinary block with its layer's eviction priority (axioms
  100, identity 90, ...), which eviction may then spill to the host tier;
- **reclaim**: when a request needs device blocks that pins hold,
  :meth:`PrefixPinManager.reclaim` demotes pins (idle ones, then over-quota excess,
  then whole tenants least recently active first, the caller's own last) instead of
  failing the request.

All state lives in the cache's block metadata (``pinned``, ``pinned_at``,
``last_attended``), so any number of managers over one cache agree.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from gpu_cache._errors import BlockStateError, PinCapacityError
from gpu_cache.cache import TQGPUCache
from gpu_cache.config import PinConfig
from gpu_cache.metadata import PINNABLE_SOURCES, BlockMeta, Tier

__all__ = ["PinResult", "PrefixPinManager"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PinResult:
    """What :meth:`PrefixPinManager.try_pin` did.

    Attributes:
        pinned: ids newly pinned.
        held: ids that were pinned already.
        demoted: pins of other blocks released to make room (idle or over quota).
        refused: why the blocks were left unpinned (``None`` when they are pinned).
    """

    pinned: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    demoted: list[int] = field(default_factory=list)
    refused: str | None = None


class PrefixPinManager:
    """Pins blocks of stable layers (axioms, identity, rules, capabilities, soul).

    Pinned blocks get priority 999, are warmed into the device tier if needed, and
    are never spilled or evicted until unpinned or demoted (see the module doc for
    quotas, the idle TTL and reclaiming).

    Args:
        cache: the cache whose blocks to pin; its ``config.pins`` sets the quotas.
        pinnable_sources: source layers whose blocks may be pinned.
    """

    def __init__(self, cache: TQGPUCache, pinnable_sources: frozenset[str] = PINNABLE_SOURCES):
        self.cache = cache
        self.pinnable_sources = pinnable_sources

    # ------------------------------------------------------------------ limits
    @property
    def config(self) -> PinConfig:
        return self.cache.config.pins

    @property
    def tenant_quota(self) -> int:
        """Most blocks one tenant may pin."""
        return self.config.tenant_quota(self.cache.capacity(Tier.DEVICE))

    @property
    def total_cap(self) -> int:
        """Most blocks all tenants together may pin."""
        return self.config.total_cap(self.cache.capacity(Tier.DEVICE))

    def pinned_by_tenant(self) -> dict[str, int]:
        """Pinned blocks per tenant."""
        out: dict[str, int] = {}
        for meta in self.cache.metadata.pinned():
            out[meta.tenant_slug] = out.get(meta.tenant_slug, 0) + 1
        return out

    def over_quota(self) -> dict[str, int]:
        """Tenants holding more pins than their quota, with the excess (pins made
        before a quota applied, or low-level :meth:`TQGPUCache.set_pinned` calls)."""
        quota = self.tenant_quota
        return {t: n - quota for t, n in self.pinned_by_tenant().items() if n > quota}

    # ------------------------------------------------------------------ pinning
    def pin(self, block_ids: Sequence[int], *, now: float | None = None,
            any_layer: bool = False, demote_others: bool = True) -> list[int]:
        """Pin blocks, all or none; returns the ids newly pinned. ``any_layer``: blocks
        of any source layer (a time-bound pin the request asked for, e.g. through a
        tool-call pause); the quotas hold all the same. ``demote_others`` False: take
        free pin room only, never demoting another tenant's pins (an agent hint's pin).

        Raises:
            BlockStateError: a block's source layer is not pinnable.
            PinCapacityError: a tenant would exceed its quota, the pins of all
                tenants would exceed the cap (after demoting idle and over-quota
                pins), or the device tier cannot make room for blocks still in the
                host tier. None of the given blocks is pinned then.
        """
        result = self.try_pin(block_ids, now=now, any_layer=any_layer,
                              demote_others=demote_others)
        if result.refused is not None:
            raise PinCapacityError(result.refused)
        return result.pinned

    def try_pin(self, block_ids: Sequence[int], *, now: float | None = None,
                any_layer: bool = False, demote_others: bool = True) -> PinResult:
        """Pin blocks within their tenants' quotas, or leave them unpinned and say why.

        Idle pins (past the TTL) are demoted first. When the cap is reached, the
        excess of over-quota tenants is demoted; if that is not enough the blocks
        stay unpinned (``refused``) and every other pin stays as it was. With
        ``demote_others`` False only the pinning tenants' own pins are demoted.

        Raises:
            BlockStateError: a block's source layer is not pinnable.
            PinCapacityError: a tenant's own pins would exceed its quota (nothing
                of this call is pinned).
        """
        cache = self.cache
        stamp = time.time() if now is None else now
        with cache.locked():
            metas = [cache.metadata.get(b) for b in cache._checked(block_ids)]
            for meta in metas:
                if not any_layer and meta.source_layer not in self.pinnable_sources:
                    raise BlockStateError(
                        f"block {meta.block_id} comes from layer {meta.source_layer!r}, which is "
                        f"not pinnable (pinnable: {sorted(self.pinnable_sources)}); pin only "
                        "stable-prefix blocks")
            result = PinResult(held=[m.block_id for m in metas if m.pinned])
            only = None if demote_others else {m.tenant_slug for m in metas}
            result.demoted = self.release_idle(now=stamp, protect=block_ids, tenants=only)
            new = [m for m in metas if not m.pinned]
            if not new:
                return result
            self._check_quota(new)
            cap = self.total_cap
            excess = len(cache.metadata.pinned()) + len(new) - cap
            if excess > 0:
                result.demoted += self._demote_over_quota(excess, protect=set(block_ids),
                                                          tenants=only)
                excess = len(cache.metadata.pinned()) + len(new) - cap
            if excess > 0:
                capacity = cache.capacity(Tier.DEVICE)
                result.refused = (
                    f"pinning {len(new)} blocks would make {cap + excess} pinned blocks, over "
                    f"the cap of {cap} of {capacity} device blocks that all tenants' pins may "
                    "hold (PinConfig.total_share); the prefix is served unpinned until other "
                    "tenants' pins go idle, or raise num_device_blocks")
                return result
            on_host = [m.block_id for m in new if m.tier is Tier.HOST]
            if on_host and cache.warm_blocks(on_host) is None:
                result.refused = (
                    f"the device tier cannot make room for {len(on_host)} blocks to pin (the "
                    "rest is pinned or in use); release blocks or raise num_device_blocks. "
                    "No pin was changed")
                return result
            for meta in new:
                cache.set_pinned(meta.block_id, True, now=stamp)
            result.pinned = [m.block_id for m in new]
            logger.debug("pinned %d blocks (%d pinned in all)", len(new),
                         len(cache.metadata.pinned()))
            return result

    def _check_quota(self, new: Sequence[BlockMeta]) -> None:
        quota = self.tenant_quota
        adding: dict[str, int] = {}
        for meta in new:
            adding[meta.tenant_slug] = adding.get(meta.tenant_slug, 0) + 1
        held = self.pinned_by_tenant()
        for tenant, n in adding.items():
            total = held.get(tenant, 0) + n
            if total > quota:
                raise PinCapacityError(
                    f"tenant {tenant!r} would pin {total} blocks, over its quota of {quota} "
                    f"(PinConfig.tenant_share={self.config.tenant_share} of "
                    f"{self.cache.capacity(Tier.DEVICE)} device blocks); shorten its stable "
                    "prefix, unpin its old prefixes, or raise num_device_blocks or "
                    "tenant_share. None of these blocks was pinned")

    def unpin(self, block_ids: Sequence[int]) -> None:
        """Unpin blocks; their priority returns to that of their source layer."""
        cache = self.cache
        with cache.locked():
            for bid in cache._checked(block_ids):
                cache.set_pinned(bid, False)

    def unpin_tenant(self, tenant: str, keep: Iterable[int] = ()) -> list[int]:
        """Unpin every pin of ``tenant`` outside ``keep`` (a superseded prefix);
        returns the ids unpinned."""
        keep_ids = set(keep)
        with self.cache.locked():
            stale = [m.block_id for m in self.cache.metadata.pinned(tenant)
                     if m.block_id not in keep_ids]
            for bid in stale:
                self.cache.set_pinned(bid, False)
        if stale:
            logger.debug("tenant %s: released %d superseded pins", tenant, len(stale))
        return stale

    # ------------------------------------------------------------------ demotion
    def release_idle(self, *, now: float | None = None, protect: Iterable[int] = (),
                     tenants: Collection[str] | None = None) -> list[int]:
        """Demote pins idle beyond ``idle_ttl_s`` (not attended or pinned since);
        returns their ids. ``protect``: ids to leave alone (the caller's own);
        ``tenants``: only these tenants' pins (default: every tenant's)."""
        ttl = self.config.idle_ttl_s
        if ttl is None:
            return []
        stamp = time.time() if now is None else now
        skip = set(protect)
        with self.cache.locked():
            idle = [m for m in self.cache.metadata.pinned()
                    if m.block_id not in skip and stamp - m.last_active > ttl
                    and (tenants is None or m.tenant_slug in tenants)]
            return self._demote(idle, "idle")

    def reclaim(self, num_blocks: int, *, for_tenant: str | None = None,
                protect: Iterable[int] = (), now: float | None = None) -> list[int]:
        """Demote pins until at least ``num_blocks`` more device blocks are unpinned.

        Order: idle pins (all of them), the excess of over-quota tenants, then other
        tenants' pins, whole tenants, least recently active first, and last the pins
        of ``for_tenant`` itself. ``protect`` (the request's own blocks) is never
        demoted. Demoted blocks stay cached; eviction may spill them.

        Returns:
            The ids demoted (possibly fewer than asked when too few pins remain).
        """
        skip = set(protect)
        with self.cache.locked():
            demoted = self.release_idle(now=now, protect=skip)
            if len(demoted) < num_blocks:
                demoted += self._demote_over_quota(num_blocks - len(demoted), protect=skip)
            if len(demoted) < num_blocks:
                by_tenant: dict[str, list[BlockMeta]] = {}
                for meta in self.cache.metadata.pinned():
                    if meta.block_id not in skip:
                        by_tenant.setdefault(meta.tenant_slug, []).append(meta)
                order = sorted(by_tenant, key=lambda t: (t == for_tenant,
                                                         max(m.last_active for m in by_tenant[t]),
                                                         t))
                for tenant in order:
                    if len(demoted) >= num_blocks:
                        break
                    demoted += self._demote(by_tenant[tenant], f"reclaimed for {for_tenant!r}")
        return demoted

    def _demote_over_quota(self, num_blocks: int, protect: set[int],
                           tenants: Collection[str] | None = None) -> list[int]:
        """Demote up to ``num_blocks`` pins of tenants over their quota (their excess
        only: least recently active first, then the blocks furthest into the prompt);
        ``tenants``: only these tenants' pins (default: any tenant's)."""
        demoted: list[int] = []
        for tenant, excess in sorted(self.over_quota().items()):
            if tenants is not None and tenant not in tenants:
                continue
            if len(demoted) >= num_blocks:
                break
            metas = [m for m in self.cache.metadata.pinned(tenant) if m.block_id not in protect]
            metas.sort(key=lambda m: (m.last_active, -m.token_range[0], -m.block_id))
            take = min(excess, num_blocks - len(demoted))
            demoted += self._demote(metas[:take], "over quota")
        return demoted

    def _demote(self, metas: Sequence[BlockMeta], why: str) -> list[int]:
        for meta in metas:
            self.cache.set_pinned(meta.block_id, False)
        if metas:
            tenants = sorted({m.tenant_slug for m in metas})
            logger.info("demoted %d pins of %s (%s); they stay cached as ordinary blocks",
                        len(metas), ", ".join(tenants), why)
        return [m.block_id for m in metas]

    # ------------------------------------------------------------------ views
    def pinned_ids(self, tenant: str | None = None) -> list[int]:
        """Ids of pinned blocks (of one tenant when given)."""
        return sorted(m.block_id for m in self.cache.metadata.pinned(tenant))

    @property
    def num_pinned(self) -> int:
        return len(self.cache.metadata.pinned())
