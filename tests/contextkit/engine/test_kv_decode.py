"""The engine's TQ4 decode on CPU through the fused kernel equals the torch path.

Greedy decode of the packaged SmolLM2 over a real prompt, once through the paged
view as the engine builds it (fused CPU kernel, one call per layer, sink and
window folded into the same softmax) and once through a view whose decode runs
the chunked torch kernel and merges the float ranges by log-sum-exp (the path
before the fused kernel): the same tokens, logits within float32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from contextkit.engine.engine import Engine
from contextkit.engine.kv import PagedKV
from contextkit.engine.sequence import close_sequence, open_sequence
from gpu_cache.kernels import cpu_decode

PROMPT = (
    "You are Atlas, the platform team's SRE assistant. Tell the truth about what you "
    "checked. The on-call log for the payments service: at 02:14 the p95 latency of "
    "the checkout endpoint rose from 180 ms to 2.3 s; the database connection pool "
    "was saturated at 200 connections; a deploy of the ledger service had landed at "
    "02:09 with a new retry policy (five retries, no jitter); the cache hit rate fell "
    "from 94% to 61% after a config push that shortened TTLs to 30 seconds; the "
    "Kafka consumer lag for the settlement topic grew to 1.2 million messages. "
    "Question: list the three most likely causes of the latency spike, in order, and "
    "say which single change you would roll back first and why."
)


class TorchPathKV(PagedKV):
    """The paged view with the chunked torch decode kernel (the pre-fused path)."""

    decode_backend = "torch"


def greedy(engine: Engine, ids: list[int], num_new: int, kv_cls: type[PagedKV],
           residual: int, sink: int) -> tuple[list[int], torch.Tensor]:
    """Prefill, then ``num_new - 1`` decode steps; tokens and logits of every step."""
    seq = open_sequence(engine.cache, ids, num_new, "default", None, reuse=False)
    kv = kv_cls(engine.cache, seq.block_ids, seq.cached_tokens, max(0, len(ids) - residual),
                sink)
    tokens: list[int] = []
    logits = [engine.runner.prefill(ids, 0, kv)]
    written = len(ids)
    try:
        tokens.append(int(torch.argmax(logits[-1])))
        while len(tokens) < num_new:
            pos = len(ids) + len(tokens) - 1
            logits.append(engine.runner.forward([tokens[-1]], pos, kv))
            written = pos + 1
            tokens.append(int(torch.argmax(logits[-1])))
    finally:
        close_sequence(engine.cache, seq, ids + tokens, written)
    return tokens, torch.stack(logits)


@pytest.mark.parametrize(("residual", "sink"), [(32, 16), (0, 0)],
                         ids=["window32-sink16", "packed-only"])
def test_fused_cpu_decode_equals_the_torch_path(fresh: Callable[..., Engine], residual: int,
                                                sink: int) -> None:
    engine = fresh("tq4", device=64, host=16)
    ids = engine.encode(PROMPT)
    assert len(ids) > 3 * engine.cache.block_size + residual + sink  # a packed middle
    tokens, logits = greedy(engine, ids, 12, PagedKV, residual, sink)
    ref_tokens, ref_logits = greedy(engine, ids, 12, TorchPathKV, residual, sink)
    assert tokens == ref_tokens
    assert torch.equal(logits[0], ref_logits[0])  # prefill does not use the decode kernel
    err = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
    assert err < 1e-5, f"decode logits differ by {err:.2e} of their scale"


def test_engine_generate_decodes_through_the_fused_kernel(
        fresh: Callable[..., Engine]) -> None:
    """``generate`` (the engine's own paged view) gives the tokens the torch path gives."""
    engine = fresh("tq4", device=64, host=16)
    ids = engine.encode(PROMPT)
    out = engine.generate(ids, max_new_tokens=8, reuse=False)
    ref_tokens, _ = greedy(engine, ids, 8, TorchPathKV, engine.residual_tokens,
                           engine.sink_tokens)
    assert out.token_ids[: len(ref_tokens)] == ref_tokens[: len(out.token_ids)]
    assert len(out.token_ids) >= 2  # at least one decode step ran
    assert cpu_decode.backend() in ("cpp", "numba")


def test_window_buffers_grow_by_doubling_and_keep_their_rows(
        fresh: Callable[..., Engine]) -> None:
    engine = fresh("tq4", device=16, host=4)
    seq = open_sequence(engine.cache, list(range(40)), 200, "default", None, reuse=False)
    try:
        kv = PagedKV(engine.cache, seq.block_ids, seq.cached_tokens, window_start=0, sink=0)
        h, d = engine.cache.identity.num_kv_heads, engine.cache.identity.head_dim
        gen = torch.Generator().manual_seed(0)
        rows_k, rows_v, caps = [], [], set()
        start = 0
        for n in [40] + [1] * 150:
            k, v = torch.randn(n, h, d, generator=gen), torch.randn(n, h, d, generator=gen)
            kv._keep(0, k, v, start)
            start += n
            rows_k.append(kv._centered(0, k))
            rows_v.append(v)
            buf = kv.win_k[0]
            assert buf is not None
            caps.add(buf.shape[0])
        assert kv.win_len[0] == 190
        assert len(caps) <= 3  # 104 -> 208: the window is not re-copied per token
        lo, hi, ks, vs = kv._float_parts(0, 190)
        assert (lo, hi) == (0, 0)
        assert torch.equal(ks[0], torch.cat(rows_k)) and torch.equal(vs[0], torch.cat(rows_v))
        with pytest.raises(RuntimeError, match="contiguous"):
            kv._keep(0, k, v, start + 1)
    finally:
        close_sequence(engine.cache, seq, list(range(40)), 0)
