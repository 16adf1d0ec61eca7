"""The tensors of one cache tier, their free-slot map, and move counters."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from gpu_cache._errors import BlockStateError
from gpu_cache.format_specs import TENSOR_NAMES, tensor_specs
from gpu_cache.identity import CacheIdentity

__all__ = ["TENSOR_NAMES", "LayerView", "MoveStats", "TierStorage", "contiguous_run"]


@dataclass(frozen=True, slots=True)
class LayerView:
    """One layer of one tier: views ``[num_blocks, block_size, heads, ...]``."""

    k_packed: torch.Tensor
    k_norms: torch.Tensor
    v_packed: torch.Tensor
    v_norms: torch.Tensor


class TierStorage:
    """The four tensors of a tier (laid out by :func:`gpu_cache.format_specs.tensor_specs`)
    plus its free-slot map."""

    def __init__(self, identity: CacheIdentity, num_blocks: int, device: torch.device,
                 pin: bool) -> None:
        lead = (identity.num_layers, num_blocks, identity.block_size)
        opts = {"device": device, "pin_memory": pin} if pin else {"device": device}
        specs = tensor_specs(identity)
        made = {name: torch.zeros((*lead, *shape), dtype=dtype, **opts)
                for name, (shape, dtype) in specs.items()}
        self.k_packed, self.k_norms = made["k_packed"], made["k_norms"]
        self.v_packed, self.v_norms = made["v_packed"], made["v_norms"]
        self.num_blocks = num_blocks
        self.device = device
        self.pinned = pin
        self.free = np.ones(num_blocks, dtype=bool)
        self._num_free = num_blocks

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.k_packed, self.k_norms, self.v_packed, self.v_norms)

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def take(self, n: int) -> np.ndarray | None:
        """Reserve ``n`` free slots, one contiguous run when there is one."""
        idx = np.flatnonzero(self.free)
        if idx.size < n:
            return None
        chosen = idx[:n]
        if n > 1:
            spans = idx[n - 1:] - idx[: idx.size - n + 1]
            runs = np.flatnonzero(spans == n - 1)
            if runs.size:
                chosen = idx[runs[0]: runs[0] + n]
        self.free[chosen] = False
        self._num_free -= n
        return chosen

    def give_back(self, slots: Iterable[int]) -> None:
        arr = np.fromiter(slots, dtype=np.int64)
        if arr.size and self.free[arr].any():
            raise BlockStateError(f"slots {arr[self.free[arr]].tolist()} are already free")
        self.free[arr] = True
        self._num_free += arr.size


@dataclass(slots=True)
class MoveStats:
    """Counters of tier moves since the cache was created."""

    warms: int = 0
    spills: int = 0
    removes: int = 0
    evictions: int = 0
    blocks_warmed: int = 0
    blocks_spilled: int = 0
    bytes_moved: int = 0
    copies: int = 0
    last_move_copies: int = 0


def contiguous_run(slots: np.ndarray) -> tuple[int, int] | None:
    """``(start, stop)`` when ``slots`` is one ascending contiguous run."""
    if slots.size == 0:
        return None
    start = int(slots[0])
    if int(slots[-1]) - start + 1 == slots.size and (slots.size == 1 or
                                                      bool(np.all(np.diff(slots) == 1))):
        return start, start + slots.size
    return None
