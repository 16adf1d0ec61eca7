"""Weight formats (float32, bfloat16, int8) and the lean decode step, on the real model."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from contextkit.config import ConfigError, load_config
from contextkit.engine.decode import decode_step
from contextkit.engine.engine import WEIGHT_FORMATS, Engine
from contextkit.engine.kv import ContiguousKV
from contextkit.engine.llama import LlamaModel
from contextkit.engine.weights import Float32Matrix, Int8Matrix, fidelity, matrix
from gpu_cache import CacheIdentityError

pytestmark = pytest.mark.slow

FRANCE = "What is the capital of France?"
TEXT = ("The on-call engineer opened the checkout latency dashboard: p95 rose from 180 ms "
        "to 620 ms after the v2.31 rollout, and the pricing client's pool shrank to 8.")


def chat(engine: Engine, user: str) -> list[int]:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


@pytest.fixture(scope="module")
def variants(engine: Engine) -> dict[str, Engine]:
    """One engine per weight format over the session's model (native K/V: only the
    weights differ), float32 first."""
    return {fmt: engine.sibling("native", weight_format=fmt, num_device_blocks=64,
                                num_host_blocks=16) for fmt in WEIGHT_FORMATS}


def _hidden_states(engine: Engine, ids: list[int]) -> dict[str, torch.Tensor]:
    """Real activations entering each matrix of layer 3: ``{name: [T, K]}``."""
    hf = engine.model.hf
    seen: dict[str, torch.Tensor] = {}
    layer = hf.model.layers[3]
    hooks = [layer.self_attn.q_proj.register_forward_pre_hook(
                 lambda _m, a: seen.setdefault("qkv", a[0][0].detach().clone())),
             layer.self_attn.o_proj.register_forward_pre_hook(
                 lambda _m, a: seen.setdefault("o", a[0][0].detach().clone())),
             layer.mlp.gate_proj.register_forward_pre_hook(
                 lambda _m, a: seen.setdefault("gate_up", a[0][0].detach().clone())),
             layer.mlp.down_proj.register_forward_pre_hook(
                 lambda _m, a: seen.setdefault("down", a[0][0].detach().clone()))]
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return seen


# bf16 has 8 significant bits: rounding is within 2^-9 relative. Products accumulate in
# float32 (2^-24 per addition, at most K additions).
_BF16 = 2.0 ** -9
_F32 = 2.0 ** -24


@pytest.mark.parametrize("tokens", [1, 9], ids=["decode-1", "prefill-9"])
def test_int8_matmul_is_within_its_reasoned_bound(engine: Engine, tokens: int) -> None:
    """``|y8 - y| <= s/2 |x|_1 + 2^-8 sum |x||q s| + K 2^-24 sum |x||q s|`` per output:
    weights within half a step (the scale is rounded up, so nothing clips), activations
    rounded to bf16 on the way in, the result rounded to bf16 on the way out, float32
    accumulation. Real weights of layer 3 and the real activations that reach them."""
    ids = chat(engine, FRANCE)
    xs = _hidden_states(engine, ids)
    layer = engine.model.variant("float32").layers[3]
    for name in ("qkv", "o", "gate_up", "down"):
        w = getattr(layer, name).dense().double()
        q = Int8Matrix(w.float())
        assert int(q.q.abs().max()) <= 127 and q.q.dtype == torch.int8
        assert torch.equal(q.scale.to(torch.bfloat16).float(), q.scale)  # exact bf16
        deq = q.dense().double()
        assert bool(((deq - w).abs() <= q.scale.double()[:, None] / 2 + 1e-12).all())
        x = xs[name][-tokens:].double()
        exact = x @ w.T
        got = q(x.float()).double()
        k = w.shape[1]
        mag = x.abs() @ deq.abs().T
        bound = (x.abs().sum(1, keepdim=True) * q.scale.double() / 2
                 + (2 * _BF16 + 2 * _BF16 ** 2 + k * _F32) * mag)
        excess = ((got - exact).abs() - bound).max().item()
        assert excess <= 0, f"{name}: the int8 error exceeds its bound by {excess}"


def test_bfloat16_matmul_is_within_its_reasoned_bound(engine: Engine) -> None:
    """Weights, activations and the result each rounded to bf16 once:
    ``|y16 - y| <= (3 2^-9 + K 2^-24) sum |x||w|`` (plus second-order terms)."""
    xs = _hidden_states(engine, chat(engine, FRANCE))
    layer = engine.model.variant("float32").layers[3]
    for name in ("qkv", "o", "gate_up", "down"):
        w = getattr(layer, name).dense()
        m = matrix(w, "bfloat16")
        for tokens in (1, 9):
            x = xs[name][-tokens:]
            exact = x.double() @ w.double().T
            got = m(x).double()
            mag = x.double().abs() @ w.double().abs().T
            bound = (3 * _BF16 + 3 * _BF16 ** 2 + w.shape[1] * _F32) * mag
            assert bool(((got - exact).abs() <= bound).all()), name


def test_weight_bytes_count_what_a_token_reads(variants: dict[str, Engine]) -> None:
    f32 = variants["float32"].model
    matrices = sum(m.numel() for layer in f32.layers for m in layer.matrices())
    rows = sum(m.shape[0] for layer in f32.layers for m in layer.matrices())
    matrices += f32.lm_head.numel()
    rows += f32.lm_head.shape[0]
    norms = sum(layer.norm_in.numel() + layer.norm_post.numel()
                for layer in f32.layers) + f32.norm.numel()
    assert f32.weight_bytes() == 4 * (matrices + norms)
    assert variants["bfloat16"].model.weight_bytes() == 2 * matrices + 4 * norms
    # int8: one byte a weight, a bf16 scale a row
    assert variants["int8"].model.weight_bytes() == matrices + 2 * rows + 4 * norms
    assert 0.24 < variants["int8"].model.weight_bytes() / f32.weight_bytes() < 0.26


def _logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    return engine.runner.prefill(ids, 0, ContiguousKV(engine.model.num_layers), all_logits=True)


def _dense_twin(engine: Engine, fmt: str) -> Engine:
    """An engine whose float32 matrices hold exactly ``fmt``'s (dequantized) weights:
    the float32 forward of the very weights ``fmt`` stores."""
    twin = engine.sibling("native", weight_format="float32", num_device_blocks=16,
                          num_host_blocks=16)
    model = LlamaModel(engine.model.hf)
    stored = engine.model.variant(fmt)
    for mine, theirs in zip(model.layers, stored.layers, strict=True):
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(mine, name, Float32Matrix(getattr(theirs, name).dense()))
    model.lm_head = Float32Matrix(stored.lm_head.dense())
    twin.runner.model = model
    return twin


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
def test_each_format_forward_is_the_float32_forward_of_its_weights(
        variants: dict[str, Engine], fmt: str) -> None:
    """Every position's logits of a real prompt against the float32 forward of the
    same (rounded or quantized) weights: what differs is the bf16 activations going
    into each matmul and its bf16 result, 2^-9 relative each. About 120 matmuls in a
    row, their roundings adding independently in the residual stream, stay within a
    few percent of the logits' spread: bound 5 % RMS (bf16 weights against float32
    measure 3.2 %, rounding the weights too). The weight error itself is the
    format's, measured by :func:`fidelity` (int8 per-channel: ~10 % RMS here)."""
    f32 = variants["float32"]
    ids = chat(f32, FRANCE) + f32.encode(TEXT)
    ref = _logits(_dense_twin(variants[fmt], fmt), ids)
    got = _logits(variants[fmt], ids)
    spread = (ref - ref.mean(dim=-1, keepdim=True)).pow(2).mean().sqrt()
    err = (got - ref).pow(2).mean().sqrt()
    assert err / spread < 0.05, f"{fmt}: relative RMS error {float(err / spread):.4f}"
    # The argmax may differ only where the reference's top two logits are within the
    # error of each other (a near-tie): at every position whose lead is over four RMS
    # errors, it is the same. (A share of agreeing positions would count near-ties, which
    # depend on the CPU's bf16 kernels: AMX and AVX-512 BF16 round differently.)
    assert_same_argmax_where_decided(got, ref, err, fmt)
    # ... and against float32 weights, the same argmax at most positions.
    exact = _logits(f32, ids)
    assert float((got.argmax(-1) == exact.argmax(-1)).float().mean()) >= 0.85


def assert_same_argmax_where_decided(got: torch.Tensor, ref: torch.Tensor,
                                     err: torch.Tensor, fmt: str) -> None:
    """``got`` and ``ref`` ``[T, V]`` pick the same token wherever ``ref`` decides."""
    top2 = ref.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 4 * err
    assert int(decided.sum()) >= ref.shape[0] // 2, f"{fmt}: too few decided positions"
    same = got.argmax(-1) == ref.argmax(-1)
    assert bool(same[decided].all()), (
        f"{fmt}: argmax differs at decided positions {decided.nonzero().flatten().tolist()}")


def close_logits(got: torch.Tensor, ref: torch.Tensor, fmt: str) -> None:
    """Float32: a few ulps (the same kernels; RoPE's rounding order). Reduced formats:
    5 % RMS of the logits' spread (see the forward test)."""
    if fmt == "float32":
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
        return
    spread = (ref - ref.mean()).pow(2).mean().sqrt()
    err = (got - ref).pow(2).mean().sqrt()
    assert err / spread < 0.05, f"{fmt}: relative RMS error {float(err / spread):.4f}"


def same_pick(got: torch.Tensor, ref: torch.Tensor, fmt: str) -> None:
    """One position's logits ``[V]``: the same argmax, or (reduced formats, a near-tie)
    a token whose reference logit is within four RMS errors of the best."""
    if int(got.argmax()) == int(ref.argmax()):
        return
    assert fmt != "float32", "float32: the decode step picked another token"
    err = (got - ref).pow(2).mean().sqrt()
    assert float(ref.max() - ref[int(got.argmax())]) <= 4 * float(err), (
        f"{fmt}: picked {int(got.argmax())}, not within the error of {int(ref.argmax())}")


def _stacked(per_layer: list[torch.Tensor | None]) -> torch.Tensor:
    assert all(t is not None for t in per_layer)
    return torch.stack([t for t in per_layer if t is not None])


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_the_decode_step_computes_what_the_forward_computes(
        variants: dict[str, Engine], fmt: str) -> None:
    eng = variants[fmt]
    ids = chat(eng, FRANCE)
    kv_a, kv_b = ContiguousKV(eng.model.num_layers), ContiguousKV(eng.model.num_layers)
    eng.runner.forward(ids[:-1], 0, kv_a)
    eng.runner.forward(ids[:-1], 0, kv_b)
    pos = len(ids) - 1
    ref = eng.runner.forward(ids[-1:], pos, kv_a)
    got = decode_step(eng.model, ids[-1], pos, kv_b, eng.scale)
    # Same weights; for float32 the same kernels, only RoPE's rounding order differs (a
    # few float32 ulps). The reduced formats' bf16 GEMMs are oneDNN's, which picks its
    # kernel by shape and CPU: on AMX CPUs the two paths measured 2^-6.7 of the largest
    # logit apart (2^-7.7 with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16), so their bound is
    # the forward test's (bf16 roundings adding through the layers, 5 % RMS of the
    # spread), and the pick may differ only at a near-tie.
    close_logits(got, ref, fmt)
    same_pick(got, ref, fmt)
    # The first layer's V does not go through RoPE: identical; later layers carry the
    # ulps of the residual stream.
    ka, kb, va, vb = (_stacked(kv) for kv in (kv_a.k, kv_b.k, kv_a.v, kv_b.v))
    assert torch.equal(va[0], vb[0])
    if fmt == "float32":
        assert torch.allclose(ka, kb, rtol=1e-5, atol=1e-5)
        assert torch.allclose(va, vb, rtol=1e-5, atol=1e-5)
    else:  # per layer, within the bf16 roundings of the residual stream (as the logits)
        for a, b in ((ka, kb), (va, vb)):
            rel = (a - b).flatten(1).pow(2).mean(1).sqrt() / a.flatten(1).pow(2).mean(1).sqrt()
            assert float(rel.max()) < 0.05, f"{fmt}: K/V relative RMS {float(rel.max()):.4f}"
    # ... and the next position too (the RoPE table row of another position), fed the
    # same token on both paths.
    token = int(ref.argmax())
    ref2 = eng.runner.forward([token], pos + 1, kv_a)
    got2 = decode_step(eng.model, token, pos + 1, kv_b, eng.scale)
    close_logits(got2, ref2, fmt)


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_greedy_reply_over_the_tq4_cache_still_says_paris(
        fresh: Callable[..., Engine], fmt: str) -> None:
    eng = fresh("tq4", weight_format=fmt)
    assert eng.weight_format == fmt == eng.model.weight_format
    result = eng.generate(chat(eng, FRANCE), max_new_tokens=12)
    assert "Paris" in result.text, result.text


def test_siblings_share_a_format_and_convert_another_once(
        engine: Engine, fresh: Callable[..., Engine]) -> None:
    a = fresh("tq4", weight_format="int8")
    b = fresh("native", weight_format="int8")
    f = fresh("tq4")
    assert a.model is b.model is engine.model.variant("int8")
    assert f.model is engine.model and f.weight_format == "float32"
    assert isinstance(a.model, LlamaModel) and a.model.hf is engine.model.hf
    # back from int8 to float32 reaches the loaded weights, not a re-conversion
    assert a.sibling(weight_format="float32").model is engine.model
    # Another format's K/V differ: the cache identity says so, and a float32 cache is
    # refused rather than mixed.
    assert a.identity.model_id == f"{engine.model_id}+int8"
    assert f.identity.model_id == engine.model_id
    with pytest.raises(CacheIdentityError):
        Engine(engine.model.hf, engine.tokenizer, weight_format="int8", cache=f.cache,
               _shared=engine.model)


def test_a_bad_weight_format_is_one_line_naming_the_choices(
        engine: Engine, fresh: Callable[..., Engine]) -> None:
    for build in (lambda: fresh("tq4", weight_format="fp8"),
                  lambda: Engine.from_pretrained("/nonexistent", weight_format="int4"),
                  lambda: Engine(engine.model.hf, engine.tokenizer, weight_format="q4")):
        with pytest.raises(ValueError) as info:
            build()
        message = str(info.value)
        assert "\n" not in message and "float32, bfloat16, int8" in message


def test_config_env_and_code_set_the_weight_format(engine: Engine) -> None:
    assert load_config(env={}).engine.weight_format == "float32"
    config = load_config(env={"CONTEXTKIT_ENGINE_WEIGHT_FORMAT": "int8"})
    assert config.engine.weight_format == "int8"
    assert config.sources["engine.weight_format"] == "env CONTEXTKIT_ENGINE_WEIGHT_FORMAT"
    with pytest.raises(ConfigError, match=r"engine: weight_format must be one of float32, "
                                          r"bfloat16, int8; got 'int4'") as info:
        load_config(env={"CONTEXTKIT_ENGINE_WEIGHT_FORMAT": "int4"})
    assert "\n" not in str(info.value)
    built = Engine.from_config(config, engine={"weight_format": "bfloat16"},
                               cache={"num_device_blocks": 32, "num_host_blocks": 16})
    assert built.weight_format == built.settings.weight_format == "bfloat16"
    assert built.model.weight_bytes() < 0.51 * engine.model.weight_bytes()


def test_fidelity_of_a_format_against_float32(variants: dict[str, Engine]) -> None:
    f32 = variants["float32"]
    prompts = [chat(f32, FRANCE), chat(f32, TEXT)]
    same = fidelity(f32, f32, prompts, new_tokens=6)
    assert same["top1_agreement"] == 1.0 and same["ppl_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert same["tokens"] == 12 and same["prompts"] == 2
    held = f32.encode(TEXT)
    int8 = fidelity(f32, variants["int8"], prompts, new_tokens=6, held_out=held)
    assert int8["weight_format"] == "int8"
    assert int8["top1_agreement"] >= 0.8
    assert 0.9 < int8["ppl_ratio"] < 1.1 and int8["ppl_ratio"] != 1.0
    with pytest.raises(ValueError, match="at least one prompt"):
        fidelity(f32, f32, [])
