"""Background prefill: reused by the next request, preempted by a foreground one, no leaks."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from contextkit._background import BackgroundPrefiller, PrefillOutcome
from contextkit.engine import Engine, TokenSpan
from gpu_cache import Tier

pytestmark = pytest.mark.slow

SYSTEM = ("You are Atlas, a site reliability assistant. Answer briefly, cite the metric you "
          "used, and never run destructive commands without confirmation. Memories: the "
          "payments database pool was raised to 40 connections last week. ") * 2


def chat(engine: Engine, user: str, system: str = SYSTEM) -> list[int]:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": user}],
        add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def prefix_of(engine: Engine) -> list[int]:
    """The system message: what the next prompt starts with (and it ends mid-block)."""
    full = chat(engine, "Why do services use connection pools?")
    other = chat(engine, "List two signs of pool exhaustion.")
    common = next(i for i, (a, b) in enumerate(zip(full, other, strict=False)) if a != b)
    return full[:common]


def free(engine: Engine) -> tuple[int, int]:
    return engine.cache.num_free(Tier.DEVICE), engine.cache.num_free(Tier.HOST)


def test_prefilled_blocks_are_reused_and_the_reply_is_unchanged(
        fresh: Callable[..., Engine]) -> None:
    eng = fresh("tq4")
    prefix = prefix_of(eng)
    prompt = chat(eng, "Why do services use connection pools?")
    bs = eng.cache.block_size
    full_blocks = len(prefix) // bs
    spans = [TokenSpan(0, len(prefix), "memories", 0.8)]

    out = eng.prefill_prefix(prefix, tenant="acme", spans=spans)
    assert isinstance(out, PrefillOutcome)
    assert (out.prompt_tokens, out.reused_tokens) == (len(prefix), 0)
    assert out.computed_tokens == full_blocks * bs and len(out.block_ids) == full_blocks
    assert out.tier == "device" and not out.preempted and out.reason == ""
    assert out.cpu_s > 0 and out.wall_s > 0
    assert all(eng.cache.metadata.get(b).ref_count == 0 for b in out.block_ids)
    assert eng.cache.metadata.get(out.block_ids[0]).source_layer == "memories"
    # A second prefill finds everything cached.
    again = eng.prefill_prefix(prefix, tenant="acme")
    assert again.reused_tokens == full_blocks * bs and again.block_ids == ()

    res = eng.generate(prompt, max_new_tokens=12, tenant="acme")
    assert res.reused_tokens == full_blocks * bs
    assert res.block_ids[:full_blocks] == list(out.block_ids)
    # Exactly what a foreground request of those full blocks would have cached: the
    # same bytes, hence the same reply.
    warm = fresh("tq4")
    warm.generate(prefix[: full_blocks * bs], max_new_tokens=1, tenant="acme")
    theirs = warm.cache.lookup(warm.cache.block_keys(prefix, "acme"), "acme")
    assert len(theirs) == full_blocks
    mine_bytes = eng.cache.export_blocks(list(out.block_ids))
    their_bytes = warm.cache.export_blocks(theirs)
    assert all(torch.equal(mine_bytes[k], their_bytes[k]) for k in mine_bytes)
    again_warm = warm.generate(prompt, max_new_tokens=12, tenant="acme")
    assert again_warm.reused_tokens == full_blocks * bs
    assert res.token_ids == again_warm.token_ids


def test_native_prefill_reply_equals_a_cold_full_prefill(fresh: Callable[..., Engine]) -> None:
    eng = fresh("native")
    prefix = prefix_of(eng)
    prompt = chat(eng, "Why do services use connection pools?")
    out = eng.prefill_prefix(prefix, tenant="acme", chunk=32)  # several chunks
    bs = eng.cache.block_size
    assert out.computed_tokens == len(prefix) // bs * bs and not out.preempted
    res = eng.generate(prompt, max_new_tokens=12, tenant="acme")
    assert res.reused_tokens == out.computed_tokens
    cold = eng.generate(prompt, max_new_tokens=12, tenant="acme", use_cache=False)
    assert res.token_ids == cold.token_ids


def test_background_prefiller_runs_jobs_in_order(fresh: Callable[..., Engine]) -> None:
    eng = fresh("tq4")
    prefix = prefix_of(eng)
    order: list[str] = []
    with BackgroundPrefiller(eng) as bg:
        first = bg.submit(lambda stop: order.append("a") or eng.prefill_prefix(
            prefix, tenant="acme", should_stop=stop), label="a")
        second = bg.submit(lambda stop: order.append("b") or 7, label="b")
        assert bg.wait_idle(timeout=60)
        assert second.result() == 7
        out = first.result()
        assert out.computed_tokens == len(prefix) // eng.cache.block_size * 16
        stats = bg.stats()
    assert order == ["a", "b"]
    assert stats["jobs_done"] == 2 and stats["jobs_preempted"] == 0
    assert stats["cpu_s"] >= out.cpu_s > 0
