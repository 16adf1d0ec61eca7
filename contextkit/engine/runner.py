"""The model runner: a Llama model's forward pass over per-request K/V views.

:class:`ModelRunner` is what :class:`~contextkit.engine.engine.Engine`, background
prefill (:mod:`contextkit.engine.background`), chunk reuse (:mod:`contextkit.engine.blend`)
and scoring (:mod:`contextkit.engine.scoring`) share: the model, its cache, the prefill
chunking, the float sink and residual window of a paged view, the lock that serialises
model runs and the gate foreground requests announce themselves through.

The forward pass is two functions that need no runner: :func:`run_layer` (one decoder
layer over a K/V view) and :func:`forward` (embed, every layer, the LM head), so another
path (e.g. chunk reuse on vLLM) can drive the same layer loop.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from contextkit.engine.attention import rotate
from contextkit.engine.inputs import check_token_ids
from contextkit.engine.kv import ContiguousKV, PagedKV, check_overlay
from contextkit.engine.llama import LlamaModel
from contextkit.engine.sequence import SequenceBlocks
from gpu_cache import TQGPUCache

__all__ = [
    "ForegroundGate",
    "ModelRunner",
    "PrefillPreempted",
    "foreground",
    "forward",
    "run_layer",
]

#: Float sink K/V kept for this many (tenant, first tokens) prefixes (~0.7 MB each
#: for SmolLM2's 16-token sink).
SINK_MEMO_SIZE = 8


class PrefillPreempted(Exception):
    """Raised by :func:`forward` at a layer boundary when ``should_stop`` says so."""


class ForegroundGate:
    """How many foreground requests are waiting for a runner's lock."""

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


def run_layer(model: LlamaModel, i: int, h: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, kv: Any, start: int, scale: float,
              collect_keys: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Decoder layer ``i`` on hidden states ``h [T, hidden]`` at positions ``start..``
    (``cos``/``sin`` their RoPE), attending through ``kv.attend``; the new ``h``."""
    m, w = model, model.layers[i]
    n = h.shape[0]
    nq, nkv, d = m.num_heads, m.num_kv_heads, m.head_dim
    x = F.rms_norm(h, (m.hidden,), w.norm_in, m.eps)
    qkv = w.qkv(x).float()
    q = qkv[:, : nq * d].view(n, nq, d)
    k = qkv[:, nq * d : (nq + nkv) * d].view(n, nkv, d)
    v = qkv[:, (nq + nkv) * d :].view(n, nkv, d)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    if collect_keys is not None:
        collect_keys.append(k.float())
    attn = kv.attend(i, q, k, v, start, scale)
    h = h + w.o(attn.reshape(n, nq * d))
    x = F.rms_norm(h, (m.hidden,), w.norm_post, m.eps)
    gate, up = w.gate_up(x).chunk(2, dim=-1)
    return h + w.down(F.silu(gate) * up)


@torch.inference_mode()
def forward(model: LlamaModel, ids: Sequence[int], start: int, kv: Any, scale: float,
            all_logits: bool = False, collect_keys: list[torch.Tensor] | None = None,
            should_stop: Callable[[], bool] | None = None) -> torch.Tensor:
    """Run tokens at positions ``start..`` through ``model``; logits of the last token
    ``[V]`` (or of all tokens ``[T, V]``). ``should_stop`` is polled before each layer;
    when true, :class:`PrefillPreempted` is raised."""
    m = model
    n = len(ids)
    tokens = torch.tensor(list(ids), dtype=torch.long, device=m.device)
    h = F.embedding(tokens, m.embed)
    cos, sin = m.rope(torch.arange(start, start + n, device=m.device))
    for i in range(m.num_layers):
        if should_stop is not None and should_stop():
            raise PrefillPreempted(f"stopped before layer {i}")
        h = run_layer(m, i, h, cos, sin, kv, start, scale, collect_keys)
    last = h if all_logits else h[-1:]
    logits = m.lm_head(F.rms_norm(last, (m.hidden,), m.norm, m.eps))
    return logits.float() if all_logits else logits[0].float()


class ModelRunner:
    """Runs one model over one block cache.

    Args:
        model: the (weight-format variant of the) model.
        cache: the block cache paged views read and write.
        prefill_chunk: prompt tokens run per forward step.
        residual_tokens: default float32 recent window of a paged view (TQ4).
        sink_tokens: default float32 attention sink of a paged view (TQ4).
        max_positions: longest prompt plus reply a request may span.
    """

    def __init__(self, model: LlamaModel, cache: TQGPUCache, *, prefill_chunk: int,
                 residual_tokens: int, sink_tokens: int, max_positions: int) -> None:
        self.model = model
        self.cache = cache
        self.prefill_chunk = prefill_chunk
        self.residual_tokens = residual_tokens
        self.sink_tokens = sink_tokens
        self.max_positions = max_positions
        self.scale = 1.0 / math.sqrt(model.head_dim)
        self.sink_memo: OrderedDict[tuple[str, tuple[int, ...]],
                                    list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self.foreground_gate = ForegroundGate()
        #: How long the last foreground request waited for the lock, in ms.
        self.last_foreground_wait_ms = 0.0
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ checks
    @property
    def vocab_size(self) -> int:
        """Rows of the model's embedding: valid token ids are ``[0, vocab_size)``."""
        return int(self.model.embed.shape[0])

    def check_token_ids(self, token_ids: Sequence[int], what: str = "token_ids") -> list[int]:
        """``token_ids`` as a list, each checked to be in ``[0, vocab_size)``."""
        return check_token_ids(token_ids, self.vocab_size, what)

    def check_prompt(self, ids: Sequence[int], extra: int) -> None:
        """Raise ValueError for an empty prompt or one that with ``extra`` new tokens
        exceeds :attr:`max_positions`."""
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        total = len(ids) + extra
        if total > self.max_positions:
            raise ValueError(
                f"prompt of {len(ids)} tokens plus {extra} new tokens exceeds the model's "
                f"{self.max_positions} positions; shorten the prompt (lower layer "
                "budgets) or max_new_tokens")

    # ------------------------------------------------------------------ locking
    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the (reentrant) lock: nothing else runs the model meanwhile."""
        with self._lock:
            yield

    # ------------------------------------------------------------------ K/V views
    def contiguous(self) -> ContiguousKV:
        """Empty float K/V for a request that neither reads nor writes the cache."""
        return ContiguousKV(self.model.num_layers)

    def paged(self, block_ids: list[int], cached: int, prompt: Sequence[int],
              compute_start: int, tenant: str, residual: int | None = None,
              sink: int | None = None) -> PagedKV:
        """The request's view of its blocks, with the float sink and residual window
        (the sink recomputed here when the request does not compute it itself)."""
        residual = self.residual_tokens if residual is None else residual
        sink = self.sink_tokens if sink is None else sink
        check_overlay(residual, sink, self.cache.block_size)
        window_start = max(compute_start, len(prompt) - residual)
        kv = PagedKV(self.cache, block_ids, cached, window_start, sink)
        if kv.sink and (compute_start > 0 or self.prefill_chunk < kv.sink):
            for layer, (k, v) in enumerate(self.sink_kv(prompt[: kv.sink], tenant)):
                kv.set_sink(layer, k, v)
        return kv

    def sink_kv(self, ids: Sequence[int], tenant: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Float K/V of the first tokens, per layer: a short forward, remembered for
        the last few prefixes (they depend on those tokens alone)."""
        key = (tenant, tuple(ids))
        hit = self.sink_memo.get(key)
        if hit is not None:
            self.sink_memo.move_to_end(key)
            return hit
        kv = self.contiguous()
        self.forward(ids, 0, kv)
        pairs = [(k, v) for k, v in zip(kv.k, kv.v, strict=True)
                 if k is not None and v is not None]
        self.sink_memo[key] = pairs
        while len(self.sink_memo) > SINK_MEMO_SIZE:
            self.sink_memo.popitem(last=False)
        return pairs

    # ------------------------------------------------------------------ forward
    def forward(self, ids: Sequence[int], start: int, kv: ContiguousKV | PagedKV,
                all_logits: bool = False,
                collect_keys: list[torch.Tensor] | None = None,
                should_stop: Callable[[], bool] | None = None) -> torch.Tensor:
        """:func:`forward` with this runner's model and attention scale."""
        return forward(self.model, ids, start, kv, self.scale, all_logits=all_logits,
                       collect_keys=collect_keys, should_stop=should_stop)

    def prefill(self, ids: Sequence[int], start: int, kv: ContiguousKV | PagedKV,
                all_logits: bool = False) -> torch.Tensor:
        """:meth:`forward` over ``ids[start:]`` in steps of ``prefill_chunk`` tokens."""
        outs = []
        for c0 in range(start, len(ids), self.prefill_chunk):
            c1 = min(c0 + self.prefill_chunk, len(ids))
            outs.append(self.forward(ids[c0:c1], c0, kv, all_logits=all_logits))
        return torch.cat(outs) if all_logits else outs[-1]

    def prefill_into(self, seq: SequenceBlocks, ids: Sequence[int], *,
                     should_stop: Callable[[], bool] | None = None) -> None:
        """Compute the K/V of ``ids`` past ``seq.cached_tokens`` into ``seq``'s blocks
        (no float residual window); ``should_stop`` raises :class:`PrefillPreempted`."""
        cached = seq.cached_tokens
        kv = self.paged(seq.block_ids, cached, ids, cached, seq.tenant, residual=0)
        self.forward(ids[cached:], cached, kv, should_stop=should_stop)


@contextmanager
def foreground(runner: ModelRunner) -> Iterator[None]:
    """Hold ``runner``'s lock for a foreground request, counted as waiting until it
    holds it (a background prefill yields as soon as it sees the count); the wait is
    recorded in ``runner.last_foreground_wait_ms``."""
    gate = runner.foreground_gate
    t0 = time.perf_counter()
    with ExitStack() as stack:
        gate.arrive()
        try:
            stack.enter_context(runner.locked())
        finally:
            gate.leave()
        runner.last_foreground_wait_ms = (time.perf_counter() - t0) * 1000
        yield
