"""Engine: the hand-written forward matches transformers, and prefill reuses cached blocks."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from contextkit.engine.engine import (
    CacheFullError,
    ContiguousKV,
    Engine,
    TokenSpan,
    UnsupportedModelError,
    tokenizer_fingerprint,
)
from contextkit.engine.models import embedding_model_dir, load_tokenizer, smollm2_gguf
from gpu_cache import CacheIdentityError, Tier

pytestmark = pytest.mark.slow

QUESTION = "In one sentence, why do services use connection pools?"


def chat(engine: Engine, system: str, user: str = QUESTION) -> list[int]:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": user}],
        add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


SYSTEM = ("You are Atlas, a site reliability assistant. Answer briefly, cite the metric you "
          "used, and never run destructive commands without confirmation. ") * 4


def test_forward_matches_transformers(engine: Engine) -> None:
    ids = chat(engine, SYSTEM)
    with torch.inference_mode():
        ref = engine.model.hf(torch.tensor([ids])).logits[0].float()
    mine = engine.runner.prefill(ids, 0, ContiguousKV(engine.model.num_layers), all_logits=True)
    assert mine.shape == ref.shape
    assert float((mine - ref).abs().max()) < 2e-3
    # Chunked prefill (K/V carried between chunks) gives the same logits.
    chunked = Engine(engine.model.hf, engine.tokenizer, kv_format="native", prefill_chunk=37,
                     _shared=engine.model)
    mine2 = chunked.runner.prefill(ids, 0, ContiguousKV(engine.model.num_layers), all_logits=True)
    assert float((mine2 - ref).abs().max()) < 2e-3


def test_native_cache_reuses_prefix_and_matches_full_prefill(
        engine: Engine, fresh: Callable[..., Engine]) -> None:
    native = fresh("native")
    ids = chat(native, SYSTEM)
    full = native.generate(ids, max_new_tokens=12, use_cache=False)
    first = native.generate(ids, max_new_tokens=12)
    assert first.reused_tokens == 0 and first.computed_tokens == len(ids)
    second = native.generate(ids, max_new_tokens=12)
    bs = native.cache.block_size
    assert second.reused_tokens == (len(ids) // bs) * bs - (bs if len(ids) % bs == 0 else 0)
    assert second.computed_tokens == len(ids) - second.reused_tokens
    assert second.kv_reuse_ratio == pytest.approx(second.reused_tokens / len(ids))
    assert first.token_ids == full.token_ids == second.token_ids
    # Another user question after the same system prompt reuses the system blocks.
    other = chat(native, SYSTEM, "List two signs of pool exhaustion.")
    common = next(i for i, (a, b) in enumerate(zip(ids, other, strict=False)) if a != b)
    third = native.generate(other, max_new_tokens=4)
    assert third.reused_tokens == (common // bs) * bs
    assert third.token_ids == native.generate(other, max_new_tokens=4, use_cache=False).token_ids


def test_tq4_generation_tracks_native_and_registers_blocks(
        engine: Engine, fresh: Callable[..., Engine]) -> None:
    tq4 = fresh("tq4")
    ids = chat(tq4, SYSTEM)
    spans = [TokenSpan(0, len(ids) - 20, "axioms", 0.9), TokenSpan(len(ids) - 20, len(ids),
                                                                    "user_turn", 0.2)]
    full = tq4.generate(ids, max_new_tokens=10, use_cache=False)
    first = tq4.generate(ids, max_new_tokens=10, spans=spans)
    again = tq4.generate(ids, max_new_tokens=10)
    assert again.reused_tokens > 0.8 * len(ids)
    assert first.token_ids == again.token_ids
    # 4-bit K/V keeps the greedy reply on short prompts and the logits close.
    assert first.token_ids[:5] == full.token_ids[:5]
    assert first.first_logits is not None and full.first_logits is not None
    cos = torch.nn.functional.cosine_similarity(first.first_logits, full.first_logits, dim=0)
    assert float(cos) > 0.99
    metas = {m.block_id: m for m in tq4.cache.metadata.all()}
    kept = [metas[b] for b in first.block_ids if b in metas]
    assert len(kept) == (len(ids) + len(first.token_ids) - 1) // tq4.cache.block_size
    assert all(m.key is not None and m.tenant_slug == "default" for m in kept)
    assert kept[0].source_layer == "axioms" and kept[0].importance == pytest.approx(0.9)
    assert kept[0].token_range == (0, tq4.cache.block_size)
    assert all(m.ref_count == 0 for m in kept)  # released after the request
    assert tq4.cache.bytes_per_block < fresh("native").cache.bytes_per_block / 6


def test_tenants_never_share_blocks(fresh: Callable[..., Engine]) -> None:
    eng = fresh("tq4")
    ids = chat(eng, SYSTEM)
    eng.generate(ids, max_new_tokens=1, tenant="acme")
    other = eng.generate(ids, max_new_tokens=1, tenant="globex")
    assert other.reused_tokens == 0
    mine = eng.generate(ids, max_new_tokens=1, tenant="acme")
    assert mine.reused_tokens > 0
    tenants = {m.tenant_slug for m in eng.cache.metadata.all()}
    assert tenants == {"acme", "globex"}


def test_host_tier_hits_are_warmed_not_recomputed(fresh: Callable[..., Engine]) -> None:
    eng = fresh("tq4")
    ids = chat(eng, SYSTEM)
    first = eng.generate(ids, max_new_tokens=1)
    kept = [b for b in first.block_ids if b in eng.cache.metadata]
    assert eng.cache.spill_blocks(kept) is not None
    assert all(eng.cache.metadata.get(b).tier is Tier.HOST for b in kept)
    again = eng.generate(ids, max_new_tokens=1)
    assert again.reused_tokens == len(kept) * eng.cache.block_size - (
        eng.cache.block_size if len(kept) * eng.cache.block_size == len(ids) else 0)
    assert all(eng.cache.metadata.get(b).tier is Tier.DEVICE for b in kept)
    assert again.token_ids == first.token_ids


def test_oversize_prompt_fails_clearly_and_keeps_the_cache(fresh: Callable[..., Engine]) -> None:
    eng = fresh("tq4", device=16, host=8)
    ids = chat(eng, "Short system prompt.")
    eng.generate(ids, max_new_tokens=2)
    before = sorted((m.block_id, m.key) for m in eng.cache.metadata.all())
    big = chat(eng, SYSTEM * 3)
    with pytest.raises(CacheFullError, match="num_device_blocks"):
        eng.generate(big, max_new_tokens=2)
    assert sorted((m.block_id, m.key) for m in eng.cache.metadata.all()) == before
    assert all(m.ref_count == 0 for m in eng.cache.metadata.all())
    assert eng.generate(ids, max_new_tokens=2).reused_tokens > 0


def test_bad_requests_say_what_to_do(engine: Engine) -> None:
    with pytest.raises(ValueError, match="empty"):
        engine.generate([], max_new_tokens=1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([1, 2, 3], max_new_tokens=0)
    with pytest.raises(ValueError, match="positions"):
        engine.generate([1] * 10, max_new_tokens=engine.model.max_positions)
    with pytest.raises(ValueError, match="kv_format"):
        engine.sibling("fp8")


def test_token_ids_outside_the_vocabulary_are_refused_before_any_allocation(
        fresh: Callable[..., Engine]) -> None:
    eng = fresh("tq4", device=32, host=32)
    vocab = eng.model.embed.shape[0]
    ids = chat(eng, "Short system prompt.")
    rule = rf"\[0, {vocab}\)"
    for bad in ([*ids, vocab], [-1, *ids], [*ids[:3], vocab + 1000, *ids[3:]]):
        with pytest.raises(ValueError, match=rule) as err:
            eng.generate(bad, max_new_tokens=1)
        assert "\n" not in str(err.value) and "tokenizer" in str(err.value)
        with pytest.raises(ValueError, match=rule):
            eng.score(bad, [1])
        with pytest.raises(ValueError, match=rule):
            eng.score(ids, bad)
        with pytest.raises(ValueError, match=rule):
            eng.generate(bad, max_new_tokens=1, use_cache=False)
    with pytest.raises(ValueError, match="integer"):
        eng.generate([*ids, 2.5], max_new_tokens=1)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="position 3"):
        eng.generate([1, 2, 3, -7], max_new_tokens=1)
    assert len(eng.cache.metadata) == 0
    assert eng.cache.num_used(Tier.DEVICE) == eng.cache.num_used(Tier.HOST) == 0
    assert eng.generate(ids, max_new_tokens=1).prompt_tokens == len(ids)  # still serves


def test_tenants_are_checked_and_results_count_the_callers_blocks(
        fresh: Callable[..., Engine]) -> None:
    eng = fresh("tq4", device=64, host=64)
    ids = chat(eng, SYSTEM)
    for bad in ("", "a\nb", "acme corp", "../x"):
        with pytest.raises(ValueError, match="tenant"):
            eng.generate(ids, max_new_tokens=1, tenant=bad)
        with pytest.raises(ValueError, match="tenant"):
            eng.score(ids, [1], tenant=bad)
    assert len(eng.cache.metadata) == 0
    first = eng.generate(ids, max_new_tokens=1, tenant="acme")
    other = eng.generate(chat(eng, "Short system prompt."), max_new_tokens=1, tenant="globex")
    for result, tenant in ((first, "acme"), (other, "globex")):
        mine = [m for m in eng.cache.metadata.all() if m.tenant_slug == tenant]
        assert sum(result.blocks_per_tier.values()) == len(mine)
    assert sum(other.blocks_per_tier.values()) < len(eng.cache.metadata)


def test_cache_of_another_tokenizer_is_refused(engine: Engine) -> None:
    from transformers import AutoTokenizer

    bert = AutoTokenizer.from_pretrained(str(embedding_model_dir()))
    assert tokenizer_fingerprint(bert) != engine.tokenizer_id
    with pytest.raises(CacheIdentityError, match="tokenizer"):
        Engine(engine.model.hf, bert, cache=engine.cache, _shared=engine.model,
               _offsets=engine._offsets)
    with pytest.raises(CacheIdentityError, match="codec"):
        Engine(engine.model.hf, engine.tokenizer, kv_format="native", cache=engine.cache,
               _shared=engine.model)


def test_converted_tokenizer_is_the_gguf_tokenizer(engine: Engine) -> None:
    from transformers import AutoTokenizer

    directory, name = smollm2_gguf()
    gguf = AutoTokenizer.from_pretrained(str(directory), gguf_file=name)
    assert tokenizer_fingerprint(gguf) == tokenizer_fingerprint(load_tokenizer())
    text = "<|im_start|>system\n[AXIOMS]\nBe exact: 17:05 CET, p95 712 ms.\n[/AXIOMS]\n"
    assert gguf.encode(text) == load_tokenizer().encode(text)


def test_unsupported_architecture_is_refused(engine: Engine) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        Engine(gpt2, engine.tokenizer)


def test_teacher_forced_scores(engine: Engine, fresh: Callable[..., Engine]) -> None:
    eng = fresh("tq4")
    ids = chat(eng, SYSTEM)
    reply = eng.generate(ids, max_new_tokens=8, use_cache=False).token_ids
    exact = eng.score(ids, reply, use_cache=False)
    assert exact.shape == (len(reply), eng.model.hf.config.vocab_size)
    assert exact.argmax(-1).tolist() == reply  # greedy reply = argmax of its own logits
    cached = eng.score(ids, reply)
    agree = float((cached.argmax(-1) == torch.tensor(reply)).float().mean())
    assert agree >= 0.75
    ce_exact = torch.nn.functional.cross_entropy(exact, torch.tensor(reply))
    ce_tq4 = torch.nn.functional.cross_entropy(cached, torch.tensor(reply))
    assert abs(float(ce_tq4 - ce_exact)) < 0.5


def test_residual_window_is_float_and_decode_agrees_with_scoring(
        engine: Engine, fresh: Callable[..., Engine]) -> None:
    ids = chat(engine, SYSTEM)
    exact = engine.score(ids, engine.generate(ids, max_new_tokens=8, use_cache=False).token_ids,
                         use_cache=False)
    reply = exact.argmax(-1).tolist()
    # A window covering the whole request: nothing is read back from TQ4, so the
    # logits are the full-precision ones; with no window they are not.
    wide = fresh("tq4", residual_tokens=4096)
    assert wide.residual_tokens == 4096
    all_float = wide.score(ids, reply)
    assert (all_float - exact).abs().max() < 1e-3 * exact.abs().max()
    packed = wide.score(ids, reply, max_reuse_tokens=0, residual_tokens=0)
    assert (packed - exact).abs().max() > 1e-2 * exact.abs().max()
    full = wide.generate(ids, max_new_tokens=8, reuse=False)
    assert full.token_ids == reply

    # A reused prefix (packed) plus a 16-token window: decode merges the fused
    # kernel's packed attention with the float window by log-sum-exp; teacher-forced
    # scoring of the same path reads the same K/V, so the two agree.
    eng = fresh("tq4", residual_tokens=16)
    eng.generate(ids, max_new_tokens=8)
    again = eng.generate(ids, max_new_tokens=8)
    assert again.reused_tokens > 0.8 * len(ids)
    scored = eng.score(ids, again.token_ids, max_reuse_tokens=again.reused_tokens)
    assert scored.argmax(-1).tolist() == again.token_ids
    assert again.first_logits is not None
    assert torch.allclose(scored[0], again.first_logits, atol=1e-3 * float(scored[0].abs().max()))
    # The recomputed sink is remembered per tenant (keys never cross tenants).
    eng.generate(ids, max_new_tokens=1, tenant="acme")
    eng.generate(ids, max_new_tokens=1, tenant="acme")
    assert sorted(t for t, _ in eng.runner.sink_memo) == ["acme", "default"]
    # The recomputed sink is the prefill's own: with a window and sink covering the
    # prompt, scoring that reuses the whole prefix matches scoring that reuses none.
    both = fresh("tq4", residual_tokens=4096, sink_tokens=4096)
    both.generate(ids, max_new_tokens=8)
    reused = both.score(ids, reply)  # the sink is the whole reused prefix, recomputed
    assert (reused - exact).abs().max() < 1e-3 * exact.abs().max()
    with pytest.raises(ValueError, match="residual_tokens must be an integer >= 0, got -1"):
        fresh("tq4", residual_tokens=-1)
    with pytest.raises(ValueError, match="sink_tokens must be a multiple of block_size"):
        fresh("tq4", sink_tokens=8)


def test_prefill_flops_count_what_the_forward_runs(engine: Engine) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    ids = chat(engine, SYSTEM)
    n, reused = len(ids), 48
    m = engine.model
    params = [p for p in m.hf.parameters() if p.requires_grad]
    for p in params:  # the flop counter's module hooks need weights without grad
        p.requires_grad_(False)
    try:
        kv = ContiguousKV(m.num_layers)
        engine.runner.forward(ids[:reused], 0, kv)
        with FlopCounterMode(display=False) as counter:
            engine.runner.forward(ids[reused:], reused, kv)
        # prefill_flops leaves RoPE out; on CUDA the counter sees the rotary
        # embedding's inv_freq x positions matmul (64 FLOPs a token), on CPU nothing.
        with FlopCounterMode(display=False) as rope:
            m.rope(torch.arange(reused, n, device=m.device))
    finally:
        for p in params:
            p.requires_grad_(True)
    # The counter sees the matmuls (projections, MLP, LM head), not the attention
    # kernel: count the query-key pairs the causal attention visits from its mask.
    computed = n - reused
    pairs = int(torch.ones(computed, n, dtype=torch.bool).tril(reused).sum())
    attention = 4 * m.num_layers * m.num_heads * m.head_dim * pairs
    counted = counter.get_total_flops() - rope.get_total_flops()
    assert engine.prefill_flops(n, reused) == counted + attention
    full = engine.prefill_flops(n)
    assert full > engine.prefill_flops(n, reused) > engine.prefill_flops(n, n - 1)
    with pytest.raises(ValueError, match="reused_tokens < prompt_tokens"):
        engine.prefill_flops(n, n)
