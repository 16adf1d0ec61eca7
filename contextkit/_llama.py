"""Weights and shapes of a Llama-architecture causal LM, read from transformers."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

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
