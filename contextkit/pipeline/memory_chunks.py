"""Memory lines computed once, when they enter the memory graph, so that a memories layer
which brings them in later reuses them as chunks (:mod:`contextkit.engine.chunks`).

Chunk reuse finds a line wherever it was computed before, but a memory the graph brings
into the prompt for the first time was never computed: without this, every memory-change
turn computes its new memories in the foreground. :class:`MemoryChunks` computes each
memory's line ahead, as CacheBlend does for retrieved documents: lines are prefilled in
groups after the memories layer's opening (``<|im_start|>system`` and ``[MEMORIES]``), with
the same token ids and label as the pipeline gives that line, so a later prompt's line
has the same chunk key; the seams are repaired as for any moved chunk. The blocks go to
the host tier (they are warmed when used) and are salted with the tenant like any other.

Use it where memories are written::

    chunks = MemoryChunks(engine)
    graph.add_nodes(texts, tenant="acme")
    chunks.sync(graph, graph_tenant="acme", tenant="acme")  # or chunks.add(texts, ...)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from contextkit.engine.types import TokenSpan
from contextkit.pipeline.building import section_pieces
from contextkit.prompt.chatml import ChatML
from contextkit.prompt.layers import LayerConfig

if TYPE_CHECKING:
    from contextkit.engine.engine import Engine

__all__ = ["MemoryChunkStats", "MemoryChunks"]


@dataclass(frozen=True)
class MemoryChunkStats:
    """What one :meth:`MemoryChunks.add` did.

    Attributes:
        lines: memory lines made ready now: computed, or found in the cache already (a
            cache restored from the shadow holds them); ``computed_tokens`` says which.
        skipped: lines given that were computed before (for this tenant) or are empty.
        computed_tokens: tokens computed (opening, lines and padding to whole blocks).
        wall_s: wall time.
        preempted: a foreground request stopped it; the unfinished lines are retried by
            the next call.
    """

    lines: int
    skipped: int
    computed_tokens: int
    wall_s: float
    preempted: bool = False


class MemoryChunks:
    """Prefills memory lines as reusable chunks of the memories layer.

    Args:
        engine: the engine whose cache receives the chunks (chunk reuse on).
        config: the pipeline's layer configuration (gives the layer's label).
        layer: the layer the memories go to.
        group_tokens: lines computed together, up to about this many tokens each.
        to_host: leave the blocks in the host tier.
    """

    def __init__(self, engine: Engine, *, config: LayerConfig | None = None,
                 layer: str = "memories", group_tokens: int = 512,
                 to_host: bool = True) -> None:
        if group_tokens < 1:
            raise ValueError(f"group_tokens must be >= 1, got {group_tokens}")
        self.engine = engine
        spec = (config or LayerConfig()).get(layer)
        self.label = spec.source
        self.layer = spec.name
        self._head = [*engine.encode(ChatML.open("system")),
                      *engine.encode(section_pieces(spec.name, [])[0])]
        self._pad = engine.encode("\n")
        self.group_tokens = group_tokens
        self.to_host = to_host
        self._done: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def pending(self, texts: Sequence[str], tenant: str = "default") -> list[str]:
        """The texts of ``texts`` not computed yet for ``tenant`` (in order, once each)."""
        with self._lock:
            out: list[str] = []
            for text in dict.fromkeys(texts):
                if text.strip() and (tenant, text) not in self._done:
                    out.append(text)
            return out

    def add(self, texts: Sequence[str], tenant: str = "default", *,
            should_stop: Callable[[], bool] | None = None) -> MemoryChunkStats:
        """Compute the lines of ``texts`` not computed yet for ``tenant``.

        Runs on the calling thread and yields to foreground requests like any background
        prefill (pass it to a :class:`~contextkit.engine.background.BackgroundPrefiller`
        to run it there).
        """
        t0 = time.perf_counter()
        todo = self.pending(texts, tenant)
        skipped = len(texts) - len(todo)
        computed = done = 0
        preempted = False
        for group in self._groups(todo):
            ids = list(self._head)
            spans = []
            for piece in group:
                spans.append(TokenSpan(len(ids), len(ids) + len(piece), self.label, 0.5))
                ids.extend(piece)
            short = -len(ids) % self.engine.cache.block_size  # only whole blocks are kept
            ids.extend((self._pad * short)[:short])
            out = self.engine.prefill_prefix(ids, tenant=tenant, spans=spans,
                                             to_host=self.to_host, should_stop=should_stop)
            computed += out.computed_tokens
            if out.preempted or out.computed_tokens + out.reused_tokens < len(ids):
                preempted = out.preempted
                break
            with self._lock:
                self._done.update((tenant, todo[done + i]) for i in range(len(group)))
            done += len(group)
        return MemoryChunkStats(done, skipped, computed, time.perf_counter() - t0, preempted)

    def sync(self, graph: Any, *, graph_tenant: str = "default",
             tenant: str | None = None) -> MemoryChunkStats:
        """:meth:`add` the texts of every node ``graph`` holds for ``graph_tenant``
        (the KV tenant is ``tenant``, default the same name)."""
        texts = [node.text for node in graph.nodes(graph_tenant)]
        return self.add(texts, graph_tenant if tenant is None else tenant)

    def _groups(self, texts: Sequence[str]) -> list[list[list[int]]]:
        """Token ids of each line (as the pipeline splits a layer's section), grouped up
        to :attr:`group_tokens`."""
        groups: list[list[list[int]]] = []
        size = self.group_tokens
        for text in section_pieces(self.layer, texts)[1:-1]:
            piece = self.engine.encode(text)
            if not groups or size + len(piece) > self.group_tokens:
                groups.append([])
                size = 0
            groups[-1].append(piece)
            size += len(piece)
        return groups
