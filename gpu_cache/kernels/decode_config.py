"""How the Triton decode kernel is compiled and launched (imports no Triton).

``contextkit bench kernel --sweep`` times the alternatives on a GPU; docs/gpu.md has the
figures behind :data:`CUDA_DECODE`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["CUDA_DECODE", "EXACT_DECODE", "DecodeConfig"]


@dataclass(frozen=True)
class DecodeConfig:
    """How ``triton_ops``' decode kernel is compiled and launched.

    Attributes:
        block_n: tokens per tile (16 or more, a power of two).
        num_warps, num_stages: Triton's launch settings.
        fp16: dequantized K/V tiles, queries and softmax weights in float16 with
            float32 accumulation (one tensor-core pass) instead of float32 tiles
            multiplied as ``tf32x3`` (three); centroids and norms are far coarser than
            float16's rounding.
        lookup: how a 4-bit code becomes its centroid value. ``"load"``: one
            (L1-cached) global load per code; ``"table"``: a gather from a register copy
            of the 16 centroids (``tl.gather``). (A third way, one gather per byte from a
            256-entry table of both codes' float16 values, measured 3-6x slower than
            ``"table"`` on an H100 and was dropped.)
        splits_per_sm: split-K programs aimed at per SM.
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    fp16: bool = False
    lookup: Literal["load", "table"] = "load"
    splits_per_sm: int = 8

    def __post_init__(self) -> None:
        if self.lookup not in ("load", "table"):
            raise ValueError(f"lookup must be load or table, got {self.lookup!r}")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")

    def label(self) -> str:
        """Short name, e.g. ``n64-w4-s2-f32-load-x8``."""
        return (f"n{self.block_n}-w{self.num_warps}-s{self.num_stages}-"
                f"{'f16' if self.fp16 else 'f32'}-{self.lookup}-x{self.splits_per_sm}")


#: Float32 tiles, exact to float32 rounding: the launch under the interpreter (CPU).
EXACT_DECODE = DecodeConfig()
#: The launch on CUDA: float16 tiles, register-table lookups and two warps, the fastest
#: of ``bench kernel --sweep`` (figures in docs/gpu.md), within 4e-4 of
#: :data:`EXACT_DECODE`'s output.
CUDA_DECODE = DecodeConfig(fp16=True, lookup="table", num_warps=2)
