"""``contextkit bench quant``: TQ4 size, distortion, attention quality and codec speed."""

from __future__ import annotations

import argparse
import logging
from typing import Any

import torch

from contextkit.bench._common import (
    machine_info,
    median_seconds,
    non_negative_int,
    positive_int,
    print_table,
)
from gpu_cache import CacheConfig, CacheIdentity, Tier, TQ4Codec, TQGPUCache

__all__ = ["HELP", "SHAPES", "add_arguments", "run"]

HELP = "TQ4 bytes per token, MSE, attention cosine (random and real SmolLM2 KV), codec speed"

logger = logging.getLogger(__name__)

#: (layers, kv heads, head dim) of the model shapes the figures are given for.
SHAPES = {
    "llama3_8b": (32, 8, 128),
    "smollm2_135m": (30, 3, 64),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vectors", type=positive_int, default=65536,
                        help="batch size for the encode/decode speed test (default 65536)")
    parser.add_argument("--no-real", action="store_true",
                        help="skip the real-model KV capture (attn_cosine_real)")
    parser.add_argument("--real-tokens", type=positive_int, default=1024,
                        help="length of the text the real KV is captured from (default 1024)")
    parser.add_argument("--seed", type=non_negative_int, default=0)


def _bytes_per_token(shape: tuple[int, int, int]) -> tuple[int, int]:
    """TQ4 bytes per token measured on an allocated cache, and the fp16 equivalent."""
    layers, heads, dim = shape
    cache = TQGPUCache(CacheIdentity("shape", layers, heads, dim),
                       CacheConfig(num_device_blocks=1, num_host_blocks=0, device="cpu"))
    return cache.storage(Tier.DEVICE).nbytes // cache.block_size, 2 * layers * heads * dim * 2


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               causal_offset: int | None = None) -> torch.Tensor:
    """float32 attention; q ``[Hq, Tq, D]``, k/v ``[Hkv, Tk, D]`` (GQA by repetition)."""
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, 0)
    v = v.repeat_interleave(group, 0)
    mask = None
    if causal_offset is not None:
        tq, tk = q.shape[1], k.shape[1]
        qpos = torch.arange(tq)[:, None] + causal_offset
        mask = torch.arange(tk)[None, :] <= qpos
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _roundtrip(codec: TQ4Codec, x: torch.Tensor) -> torch.Tensor:
    return codec.decode(codec.encode(x))


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.flatten(0, -2), b.flatten(0, -2), dim=-1)


def attn_cosine_random(seed: int, context: int = 1024, num_queries: int = 16) -> float:
    """Mean cosine of TQ4 vs float32 attention output over random Gaussian Q/K/V."""
    _layers, kv_heads, dim = SHAPES["llama3_8b"]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(32, num_queries, dim, generator=gen)
    k = torch.randn(kv_heads, context, dim, generator=gen)
    v = torch.randn(kv_heads, context, dim, generator=gen)
    codec = TQ4Codec(dim, seed=seed)
    ref = _attention(q, k, v)
    out = _attention(q, _roundtrip(codec, k), _roundtrip(codec, v))
    return float(_cosine(out, ref).mean())


def _pydoc_tokens(num_tokens: int, tokenizer: Any, reverse: bool) -> list[int]:
    """Token ids of English prose that ships with CPython (the pydoc topic texts).

    ``reverse`` reads the topics from the other end, giving a disjoint text for
    calibration.
    """
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics, reverse=reverse))
    ids: list[int] = tokenizer(text[: num_tokens * 8])["input_ids"]
    if len(ids) < num_tokens:
        raise RuntimeError(f"reference text has only {len(ids)} tokens, need {num_tokens}")
    return ids[:num_tokens]


def capture_real_qkv(model: Any, token_ids: list[int]
                     ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Post-RoPE (q, k, v) of every layer of a transformers Llama-family model.

    Returns per layer ``q [Hq, T, D]``, ``k [Hkv, T, D]``, ``v [Hkv, T, D]`` (float32).
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    ids = torch.tensor([token_ids])
    captured: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"]
        bsz, seqlen, _ = hidden.shape
        dim = module.head_dim
        q = module.q_proj(hidden).view(bsz, seqlen, -1, dim).transpose(1, 2)
        k = module.k_proj(hidden).view(bsz, seqlen, -1, dim).transpose(1, 2)
        v = module.v_proj(hidden).view(bsz, seqlen, -1, dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        captured.append((q[0].float(), k[0].float(), v[0].float()))

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True)
               for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return captured


def attn_cosine_real(num_tokens: int, seed: int, num_queries: int = 64,
                     model: Any = None) -> dict[str, float]:
    """TQ4 vs float32 attention on real SmolLM2 Q/K/V at the last ``num_queries`` positions.

    Key offsets (gpu_cache.calibration) are calibrated on a disjoint text, as a
    deployment would calibrate once per model; the uncentered figure is reported too.
    """
    from contextkit.engine.models import load_model, load_tokenizer
    from gpu_cache.calibration import mean_key_offsets

    tokenizer = load_tokenizer()
    model = load_model() if model is None else model
    calib = capture_real_qkv(model, _pydoc_tokens(512, tokenizer, reverse=True))
    offsets = mean_key_offsets([k for _, k, _ in calib])
    qkv = capture_real_qkv(model, _pydoc_tokens(num_tokens, tokenizer, reverse=False))
    centered, plain = [], []
    with torch.no_grad():
        for layer, (q, k, v) in enumerate(qkv):
            codec = TQ4Codec(k.shape[-1], seed=seed)
            mu = offsets[layer].unsqueeze(1)  # [Hkv, 1, D]
            offset = k.shape[1] - num_queries
            qs = q[:, offset:]
            ref = _attention(qs, k, v, causal_offset=offset)
            v_hat = _roundtrip(codec, v)
            # The cache holds TQ4(k - mu); attention over it is attention over k_hat - mu,
            # which softmax cannot tell from k_hat.
            out = _attention(qs, _roundtrip(codec, k - mu), v_hat, causal_offset=offset)
            centered.append(_cosine(out, ref))
            out = _attention(qs, _roundtrip(codec, k), v_hat, causal_offset=offset)
            plain.append(_cosine(out, ref))
    allc, allp = torch.cat(centered), torch.cat(plain)
    return {"mean": float(allc.mean()), "p01": float(torch.quantile(allc, 0.01)),
            "min": float(allc.min()), "uncentered_mean": float(allp.mean()),
            "layers": len(qkv)}


def codec_speed(num_vectors: int, dim: int, seed: int, cpu_kernels: bool) -> tuple[float, float]:
    codec = TQ4Codec(dim, seed=seed, cpu_kernels=cpu_kernels)
    x = torch.randn(num_vectors, dim, generator=torch.Generator().manual_seed(seed))
    enc = codec.encode(x)
    t_enc = median_seconds(lambda: codec.encode(x), repeats=7, warmup=2)
    t_dec = median_seconds(lambda: codec.decode(enc), repeats=7, warmup=2)
    return num_vectors / t_enc, num_vectors / t_dec


def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"bench": "quant", "machine": machine_info()}
    shapes = {}
    for name, shape in SHAPES.items():
        tq4, fp16 = _bytes_per_token(shape)
        shapes[name] = {"layers": shape[0], "kv_heads": shape[1], "head_dim": shape[2],
                        "bytes_per_token_tq4": tq4, "bytes_per_token_fp16": fp16,
                        "compression": fp16 / tq4}
    result["shapes"] = shapes
    result["bytes_per_token_tq4"] = shapes["llama3_8b"]["bytes_per_token_tq4"]
    result["bytes_per_token_fp16"] = shapes["llama3_8b"]["bytes_per_token_fp16"]

    codec = TQ4Codec(128, seed=args.seed)
    u = torch.randn(args.vectors, 128, generator=torch.Generator().manual_seed(args.seed + 1))
    u = u / u.norm(dim=-1, keepdim=True)
    result["mse_unit"] = float(((u - _roundtrip(codec, u)) ** 2).sum(-1).mean())
    result["mse_unit_theory"] = codec.codebook.mse_unit_vector
    result["attn_cosine_random"] = attn_cosine_random(args.seed)
    if not args.no_real:
        real = attn_cosine_real(args.real_tokens, args.seed)
        result["attn_cosine_real"] = real["mean"]
        result["attn_cosine_real_p01"] = real["p01"]
        result["attn_cosine_real_min"] = real["min"]
        result["attn_cosine_real_uncentered"] = real["uncentered_mean"]
        result["real_tokens"] = args.real_tokens

    enc, dec = codec_speed(args.vectors, 128, args.seed, cpu_kernels=True)
    enc_t, dec_t = codec_speed(args.vectors, 128, args.seed, cpu_kernels=False)
    result.update(encode_vectors_per_s=enc, decode_vectors_per_s=dec,
                  encode_vectors_per_s_torch=enc_t, decode_vectors_per_s_torch=dec_t,
                  speed_vectors=args.vectors, speed_head_dim=128)

    rows: list[tuple[str, Any]] = []
    for name, s in shapes.items():
        rows.append((f"{name} bytes/token tq4 | fp16",
                     f"{s['bytes_per_token_tq4']:,} | {s['bytes_per_token_fp16']:,} "
                     f"({s['compression']:.2f}x)"))
    rows += [("mse_unit (d=128, 4 bit)", result["mse_unit"]),
             ("attn_cosine_random", result["attn_cosine_random"])]
    if "attn_cosine_real" in result:
        rows.append(("attn_cosine_real (mean | p01 | no key offset)",
                     f"{result['attn_cosine_real']:.5f} | {result['attn_cosine_real_p01']:.5f}"
                     f" | {result['attn_cosine_real_uncentered']:.5f}"))
    rows += [("encode vectors/s (fused cpu | torch)", f"{enc:,.0f} | {enc_t:,.0f}"),
             ("decode vectors/s (fused cpu | torch)", f"{dec:,.0f} | {dec_t:,.0f}")]
    print_table("bench quant", rows)
    return result
