"""Kernels over the packed TQ4 cache: Triton, fused CPU, and float32 torch references."""

from gpu_cache.kernels.ops import (
    Backend,
    quantize_into_cache,
    tq4_decode_attention,
    tq4_extend_attention,
)

__all__ = ["Backend", "quantize_into_cache", "tq4_decode_attention", "tq4_extend_attention"]
