"""Typed configuration of :class:`gpu_cache.TQGPUCache` (defaults live here)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpu_cache.metadata import EVICTION_POLICIES

__all__ = ["NO_PIN_QUOTA", "CacheConfig", "PinConfig"]


@dataclass(frozen=True, slots=True)
class PinConfig:
    """How much of the device tier pinned blocks may hold, per tenant and in all.

    Args:
        tenant_share: one tenant's pins may take at most this share of the device
            tier (at least one block). Pinning beyond it raises
            :class:`~gpu_cache.PinCapacityError`.
        total_share: all tenants' pins together may take at most this share, so the
            rest always serves unpinned work (a new tenant's first request). Past it,
            :meth:`~gpu_cache.PrefixPinManager.try_pin` serves a prefix unpinned.
        idle_ttl_s: a pinned block nobody attended (nor pinned again) for this many
            seconds is demoted to an ordinary block of its layer's priority, which
            eviction may then spill to the host tier. ``None``: pins never expire.
    """

    tenant_share: float = 0.25
    total_share: float = 0.75
    idle_ttl_s: float | None = 600.0

    def __post_init__(self) -> None:
        if not 0.0 < self.tenant_share <= 1.0:
            raise ValueError(f"tenant_share must be in (0, 1], got {self.tenant_share}")
        if not self.tenant_share <= self.total_share <= 1.0:
            raise ValueError(f"total_share must be in [tenant_share, 1] = "
                             f"[{self.tenant_share}, 1], got {self.total_share}")
        if self.idle_ttl_s is not None and not self.idle_ttl_s > 0:
            raise ValueError(f"idle_ttl_s must be > 0 or None (never), got {self.idle_ttl_s}")

    def tenant_quota(self, num_device_blocks: int) -> int:
        """Most blocks one tenant may pin in a device tier of this size."""
        return max(1, math.floor(self.tenant_share * num_device_blocks + 1e-9))

    def total_cap(self, num_device_blocks: int) -> int:
        """Most blocks all tenants together may pin in a device tier of this size."""
        return max(self.tenant_quota(num_device_blocks),
                   math.floor(self.total_share * num_device_blocks + 1e-9))


#: Pins limited only by the device tier and never expiring (the behaviour before
#: quotas): for single-tenant tools such as an offline recovery into a scratch cache.
NO_PIN_QUOTA = PinConfig(tenant_share=1.0, total_share=1.0, idle_ttl_s=None)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Sizes and placement of a :class:`TQGPUCache`.

    Args:
        num_device_blocks: blocks in the device ("VRAM") tier.
        num_host_blocks: blocks in the host ("DDR") tier.
        device: accelerator device; ``None`` picks CUDA when present, else CPU.
        pin_host_memory: pin the host tier; ``None`` pins when CUDA is present
            (pinning needs a CUDA driver; without one host memory stays pageable).
        eviction_policy: key of :data:`gpu_cache.metadata.EVICTION_POLICIES`.
        default_priority: eviction priority of source layers without an entry.
        pins: pin quotas and idle TTL (:class:`PinConfig`).
    """

    num_device_blocks: int
    num_host_blocks: int
    device: str | None = None
    pin_host_memory: bool | None = None
    eviction_policy: str = "semantic"
    default_priority: int = 50
    pins: PinConfig = PinConfig()

    def __post_init__(self) -> None:
        if self.num_device_blocks < 1 or self.num_host_blocks < 0:
            raise ValueError(
                "num_device_blocks must be >= 1 and num_host_blocks >= 0, got "
                f"{self.num_device_blocks} and {self.num_host_blocks}"
            )
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {sorted(EVICTION_POLICIES)}, "
                             f"got {self.eviction_policy!r}")
