"""Weights and shapes of a Llama-architecture causal LM, read from transformers."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from contextkit.engine.weights import Matrix, check_weight_format, matrix

__all__ = ["UnsupportedModelError", "tokenizer_fingerprint"]


class UnsupportedModelError(ValueError):
    """A model this engine's forward pass does not implement."""



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
    """One decoder layer's weights, with q/k/v and gate/up fused for fewer matmuls,
    the matrices in ``weight_format`` (norms stay as loaded)."""

    def __init__(self, layer: Any, weight_format: str) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        with torch.no_grad():
            self.qkv: Matrix = matrix(torch.cat(
                [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), weight_format)
            self.o: Matrix = matrix(attn.o_proj.weight, weight_format)
            self.gate_up: Matrix = matrix(torch.cat(
                [mlp.gate_proj.weight, mlp.up_proj.weight]), weight_format)
            self.down: Matrix = matrix(mlp.down_proj.weight, weight_format)
        self.norm_in = layer.input_layernorm.weight.detach()
        self.norm_post = layer.post_attention_layernorm.weight.detach()

    def matrices(self) -> tuple[Matrix, ...]:
        return self.qkv, self.o, self.gate_up, self.down

    def nbytes(self) -> int:
        """Bytes one token reads: the four matrices and the two norms."""
        norms = (self.norm_in.numel() * self.norm_in.element_size()
                 + self.norm_post.numel() * self.norm_post.element_size())
        return sum(m.nbytes for m in self.matrices()) + norms


class LlamaModel:
    """Weights and shapes of a Llama-architecture causal LM, read from transformers."""

    SUPPORTED = ("llama",)

    def __init__(self, hf_model: Any, weight_format: str = "float32",
                 _variants: dict[str, LlamaModel] | None = None) -> None:
        check_weight_format(weight_format)
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
        self.weight_format = weight_format
        self.embed = inner.embed_tokens.weight.detach()
        self.norm = inner.norm.weight.detach()
        with torch.no_grad():
            self.lm_head: Matrix = matrix(hf_model.lm_head.weight, weight_format)
        self.rotary = inner.rotary_emb
        self.layers = [_LayerWeights(layer, weight_format) for layer in inner.layers]
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        #: cos and signed sin ``[P, 1, D]`` of positions ``0..P`` for the decode step
        #: (grown by doubling); see :meth:`rope_row`.
        self._rope_cos = self._rope_sin = torch.empty(0)
        # Every format converted from one model shares this table (and the model).
        self._variants = _variants if _variants is not None else {}
        self._variants.setdefault(weight_format, self)

    def variant(self, weight_format: str) -> LlamaModel:
        """The same model with its matrices in ``weight_format`` (converted once, then
        shared by every engine that asks)."""
        check_weight_format(weight_format)
        hit = self._variants.get(weight_format)
        if hit is None:
            hit = LlamaModel(self.hf, weight_format, _variants=self._variants)
        return hit

    def weight_bytes(self) -> int:
        """Bytes of weights one decoded token reads: every layer's matrices and norms,
        the final norm and the LM head (the embedding row is left out)."""
        return (sum(layer.nbytes() for layer in self.layers) + self.lm_head.nbytes
                + self.norm.numel() * self.norm.element_size())

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, D]`` for absolute ``positions``."""
        probe = self.embed[:1]
        cos, sin = self.rotary(probe, positions[None, :])
        return cos[0, :, None, :].to(self.dtype), sin[0, :, None, :].to(self.dtype)

    def rope_row(self, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ``[1, D]`` of position ``pos``, from a table, such that
        RoPE is ``x * cos + x.roll(D // 2, -1) * sin`` (the same values as
        :meth:`rope`: ``rotate_half(x) = cat(-x2, x1) = roll(x) * [-1.., 1..]``)."""
        if pos >= self._rope_cos.shape[0]:
            size = max(64, self._rope_cos.shape[0])
            while size <= pos:
                size *= 2
            with torch.no_grad():
                cos, sin = self.rope(torch.arange(size, device=self.device))
            half = cos.shape[-1] // 2
            sin = sin.clone()
            sin[..., :half] = -sin[..., :half]
            self._rope_cos, self._rope_sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()
        return self._rope_cos[pos : pos + 1], self._rope_sin[pos : pos + 1]
