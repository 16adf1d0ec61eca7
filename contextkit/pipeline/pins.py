"""Stable-prefix pins of a pipeline's agents (used by
:class:`~contextkit.pipeline.pipeline.CacheAwareContextPipeline`).

Ownership rule
--------------
An *agent* is a (tenant, agent name) pair; a pipeline's agent name is its ``agent=``
(default: the tenant of the call), so one pipeline per agent over one shared engine is
the multi-agent setup, and two pipelines with the same agent name are one agent (the
later call supersedes the earlier, as a restarted process does).

- Each call of an agent makes that call's pinnable stable-prefix blocks the agent's
  *holding* (its latest prefix), replacing the agent's previous holding.
- A tenant's pinned block stays pinned while the holding of any *live* agent of the
  tenant contains it (live: the pipeline that made the holding has not been garbage
  collected). Agents of one tenant share their organisation's leading blocks, so those
  stay pinned while any of them holds them.
- After pinning, a call releases every pin of its tenant that no live agent holds:
  this agent's superseded prefix, the prefixes of agents whose pipeline is gone, and
  pins made outside any pipeline (another process's, or ``set_pinned``). Other
  tenants' pins are never touched.

The holdings are process-local, one ledger per cache (shared by every pipeline over
that engine); the pins themselves stay in the cache's block metadata, where quotas,
the idle TTL and reclaiming apply as before (:mod:`gpu_cache.pinning`). What this module
needs of a pipeline is passed in plain: its pin manager, and a liveness probe (a weak
reference to the pipeline) that tells whether the agent is live.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from contextkit.engine.types import TokenSpan
from gpu_cache import PinCapacityError, PrefixPinManager, Tier, TQGPUCache
from gpu_cache.metadata import PINNABLE_SOURCES, BlockHash

logger = logging.getLogger("contextkit.pipeline.pipeline")


#: Whether an agent is live: returns ``None`` once what keeps it live (its pipeline) is
#: gone, as a ``weakref.ref`` to that does.
Liveness = Callable[[], object | None]


@dataclass
class _Holding:
    """One agent's latest stable prefix: the blocks (with their keys, so a recycled
    block id is not mistaken for the prefix's) and whether its holder is live."""

    alive: Liveness
    blocks: dict[int, BlockHash]


class _PinLedger:
    """Which live agent holds which pinned blocks of one cache, per tenant."""

    def __init__(self) -> None:
        self._holdings: dict[tuple[str, str], _Holding] = {}
        self._warned: set[tuple[str, str]] = set()

    def hold(self, tenant: str, agent: str, alive: Liveness,
             blocks: dict[int, BlockHash]) -> None:
        """Make ``blocks`` the agent's holding (replacing its previous one) while
        ``alive()`` is not ``None``."""
        self._holdings[(tenant, agent)] = _Holding(alive, dict(blocks))

    def held(self, cache: TQGPUCache, tenant: str) -> set[int]:
        """Block ids of ``tenant`` that a live agent holds (forgetting dead agents)."""
        out: set[int] = set()
        for owner in [o for o in self._holdings if o[0] == tenant]:
            holding = self._holdings[owner]
            if holding.alive() is None:
                del self._holdings[owner]
                continue
            for bid, key in holding.blocks.items():
                if bid in cache.metadata:
                    meta = cache.metadata.get(bid)
                    if meta.key == key and meta.tenant_slug == tenant:
                        out.add(bid)
        return out

    def warned(self, tenant: str, agent: str) -> bool:
        """Whether the agent's over-quota warning was given (then it is given once)."""
        if (tenant, agent) in self._warned:
            return True
        self._warned.add((tenant, agent))
        return False

    def agents(self, tenant: str) -> list[str]:
        """Names of the tenant's live agents holding a prefix."""
        return sorted(agent for (t, agent), h in self._holdings.items()
                      if t == tenant and h.alive() is not None)


_LEDGERS: weakref.WeakKeyDictionary[TQGPUCache, _PinLedger] = weakref.WeakKeyDictionary()
_LEDGERS_LOCK = threading.Lock()


def ledger_for(cache: TQGPUCache) -> _PinLedger:
    """The pin ledger shared by every pipeline over ``cache``."""
    with _LEDGERS_LOCK:
        ledger = _LEDGERS.get(cache)
        if ledger is None:
            ledger = _LEDGERS[cache] = _PinLedger()
        return ledger


def check_pin_quota(pins: PrefixPinManager, tenant: str, spans: Sequence[TokenSpan],
                    stable_end: int, *, strict: bool = False) -> str | None:
    """Whether the stable prefix alone is over the tenant's pin quota, before any work.

    Returns:
        ``None`` when the prefix's full blocks fit the quota; otherwise the reason
        (one line naming the sizes and the settings to raise): the call is then served
        unpinned (:func:`pin_stable` with ``over_quota``).

    Raises:
        PinCapacityError: ``strict`` and the prefix is over the quota (nothing is
            computed).
    """
    pinnable_end = 0
    for span in spans:  # the leading run of pinnable layers, within the stable prefix
        if span.start >= stable_end or span.source_layer not in PINNABLE_SOURCES:
            break
        pinnable_end = span.end
    num_blocks = min(pinnable_end, stable_end) // pins.cache.block_size
    quota = pins.tenant_quota
    if num_blocks <= quota:
        return None
    config = pins.config
    reason = (f"tenant {tenant!r}'s stable prefix is {num_blocks} blocks, over its pin "
              f"quota of {quota} (PinConfig.tenant_share={config.tenant_share} of "
              f"{pins.cache.capacity(Tier.DEVICE)} device blocks); shorten the stable "
              "layers, give the engine more num_device_blocks or a larger tenant_share")
    if strict:
        raise PinCapacityError(f"{reason}, or build the pipeline with pin_stable=False. "
                               "Nothing was computed")
    return reason


def pin_stable(pins: PrefixPinManager, alive: Liveness, tenant: str, agent: str,
               block_ids: Sequence[int], stable_end: int, over_quota: str | None = None
               ) -> tuple[str, str]:
    """Pin this call's stable prefix for ``agent`` and release the tenant's pins that
    no live agent holds (see the module doc).

    With ``over_quota`` (:func:`check_pin_quota`'s reason) nothing of this call is
    pinned: the agent's previous holding is released and the reason is logged, as a
    warning the first time for the agent.

    Args:
        pins: the pin manager over the engine's cache.
        alive: the agent's liveness probe (``weakref.ref(pipeline)``): its holding
            counts while the probe returns an object.
        tenant: the call's tenant; agent: its agent name.
        block_ids: the call's blocks in prompt order; stable_end: where the stable
            prefix ends (tokens).

    Returns:
        ``(pin_state, reason)``: ``("pinned", "")`` or ``("unpinned", why)``.
    """
    cache = pins.cache
    full = 0 if over_quota else stable_end // cache.block_size
    wanted: dict[int, BlockHash] = {}
    with cache.locked():
        for bid in block_ids[:full]:
            if bid not in cache.metadata:
                break
            meta = cache.metadata.get(bid)
            if meta.source_layer not in PINNABLE_SOURCES or meta.key is None:
                break
            wanted[bid] = meta.key
        ledger = ledger_for(cache)
        ledger.hold(tenant, agent, alive, wanted)
        pins.unpin_tenant(tenant, keep=ledger.held(cache, tenant))
        if over_quota:
            level = logging.INFO if ledger.warned(tenant, agent) else logging.WARNING
            logger.log(level, "tenant %s, agent %s: stable prefix served unpinned: %s",
                       tenant, agent, over_quota)
            return "unpinned", over_quota
        if not wanted:
            return "unpinned", ("the stable prefix fills no whole block of a pinnable "
                                "layer; nothing to pin")
        try:
            outcome = pins.try_pin(list(wanted))
        except PinCapacityError as exc:  # the tenant's agents together are over its quota
            agents = ledger.agents(tenant)
            reason = str(exc)
            if len(agents) > 1:
                reason += (f" (the quota is shared by the tenant's agents "
                           f"{', '.join(agents)}; their prefixes hold the pins)")
            level = logging.INFO if ledger.warned(tenant, agent) else logging.WARNING
            logger.log(level, "tenant %s, agent %s: stable prefix served unpinned: %s",
                       tenant, agent, reason)
            return "unpinned", reason
    if outcome.refused is not None:
        logger.info("tenant %s, agent %s: stable prefix served unpinned: %s", tenant, agent,
                    outcome.refused)
        return "unpinned", outcome.refused
    return "pinned", ""
