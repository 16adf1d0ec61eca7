"""Kernels over the packed TQ4 cache: Triton, fused CPU, and float32 torch references."""
