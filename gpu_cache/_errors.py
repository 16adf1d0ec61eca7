"""Typed errors raised by gpu_cache. Every message says what to do about it."""

from __future__ import annotations

__all__ = [
    "BlockStateError",
    "CacheIdentityError",
    "CodecInputError",
    "GPUCacheError",
    "InvalidNameError",
    "PinCapacityError",
    "UnknownBlockError",
]


class GPUCacheError(Exception):
    """Base class of every error gpu_cache raises on purpose."""


class CodecInputError(GPUCacheError, ValueError):
    """A tensor handed to the codec or a kernel has the wrong dtype, shape or device."""


class UnknownBlockError(GPUCacheError, KeyError):
    """A block id that the cache never allocated, or already freed."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the sentence readable
        return str(self.args[0]) if self.args else "unknown block"


class BlockStateError(GPUCacheError, RuntimeError):
    """An operation that does not fit the block's state (double free, moving a pinned block)."""


class PinCapacityError(GPUCacheError, RuntimeError):
    """Pinned blocks alone would exceed the device tier."""


class CacheIdentityError(GPUCacheError, ValueError):
    """Data produced for another cache identity (model, codec, block size, schema)."""


class InvalidNameError(GPUCacheError, ValueError):
    """A tenant or session id that breaks the naming rule of :mod:`gpu_cache.ids`."""
