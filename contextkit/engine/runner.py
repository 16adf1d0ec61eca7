"""What background prefill, chunk blending and scoring need of the engine that runs them.

:class:`ModelRunner` is the model-running surface of
:class:`~contextkit.engine.engine.Engine` (the model, its forward and prefill over a KV
view, the request's paged KV, the lock and the foreground gate), declared here so
those modules depend on this surface rather than on the Engine module that imports
them. :class:`ForegroundGate` is the counter background work yields to.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from contextkit.engine.chunks import ChunkReuse
from contextkit.engine.kv import ContiguousKV, PagedKV
from contextkit.engine.llama import LlamaModel
from contextkit.engine.sequence import SequenceBlocks
from gpu_cache import TQGPUCache

__all__ = ["ForegroundGate", "ModelRunner"]


class ForegroundGate:
    """How many foreground requests are waiting for an engine's lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting = 0

    @property
    def waiting(self) -> int:
        return self._waiting

    def arrive(self) -> None:
        with self._lock:
            self._waiting += 1

    def leave(self) -> None:
        with self._lock:
            self._waiting -= 1


class ModelRunner(Protocol):
    """The engine as the code that runs its model sees it."""

    cache: TQGPUCache
    model: LlamaModel
    scale: float
    chunk_reuse: ChunkReuse
    prefill_chunk: int
    last_foreground_wait_ms: float

    @property
    def foreground_gate(self) -> ForegroundGate: ...

    def locked(self) -> AbstractContextManager[None]: ...

    def check_token_ids(self, token_ids: Sequence[int], what: str = "token_ids") -> list[int]:
        ...

    def check_prompt(self, ids: Sequence[int], extra: int) -> None: ...

    def forward_tokens(self, ids: Sequence[int], start: int, kv: ContiguousKV | PagedKV,
                       all_logits: bool = False,
                       collect_keys: list[torch.Tensor] | None = None,
                       should_stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """Logits of the last token ``[V]`` (or of all ``[T, V]``) of ``ids`` at
        positions ``start..``, their K/V written through ``kv``."""
        ...

    def prefill_tokens(self, ids: Sequence[int], start: int, kv: ContiguousKV | PagedKV,
                       all_logits: bool = False) -> torch.Tensor:
        """:meth:`forward_tokens` in steps of ``prefill_chunk`` tokens."""
        ...

    def paged_kv(self, block_ids: list[int], cached: int, prompt: Sequence[int],
                 compute_start: int, tenant: str, residual: int | None = None,
                 sink: int | None = None) -> PagedKV:
        """A request's view of its blocks, with the float sink and residual window."""
        ...

    def prefill_into(self, seq: SequenceBlocks, ids: Sequence[int], *,
                     should_stop: Callable[[], bool] | None = None) -> None:
        """Compute the K/V of ``ids`` past ``seq.cached_tokens`` into ``seq``'s blocks."""
        ...
