"""Typed configuration of :class:`gpu_cache.TQGPUCache` (defaults live here)."""

from __future__ import annotations

from dataclasses import dataclass

from gpu_cache.metadata import EVICTION_POLICIES

__all__ = ["CacheConfig"]


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
    """

    num_device_blocks: int
    num_host_blocks: int
    device: str | None = None
    pin_host_memory: bool | None = None
    eviction_policy: str = "semantic"
    default_priority: int = 50

    def __post_init__(self) -> None:
        if self.num_device_blocks < 1 or self.num_host_blocks < 0:
            raise ValueError(
                "num_device_blocks must be >= 1 and num_host_blocks >= 0, got "
                f"{self.num_device_blocks} and {self.num_host_blocks}"
            )
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {sorted(EVICTION_POLICIES)}, "
                             f"got {self.eviction_policy!r}")
