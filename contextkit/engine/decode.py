"""The decode step: one token through the model, with as few ops per layer as it takes.

A decode step of a small model on a CPU is bound by the bytes of weights it reads
(:mod:`contextkit.engine.weights`), and after them by per-op overhead: dozens of small ops
per layer times 30 layers. This step does, per layer: RMSNorm, the fused q/k/v
matrix, RoPE on q and k together (one ``addcmul`` over the table row of the position:
no per-token rotary computation, no ``cat``), the attention call
(``kv.attend(layer, q, k, v, pos, scale)``), the output matrix added in place into the
residual stream, RMSNorm, the fused gate/up matrix, SiLU times up in place, the down
matrix added in place. It computes what :meth:`ModelRunner.forward` computes for one token
(``tests/contextkit/engine/test_weights.py`` checks them against each other).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from contextkit.engine.llama import LlamaModel

__all__: list[str] = []


@torch.inference_mode()
def decode_step(model: LlamaModel, token: int, pos: int, kv: Any, scale: float) -> torch.Tensor:
    """Logits ``[V]`` (float32) of the token after ``token``, which sits at ``pos``;
    writes its K/V through ``kv.attend`` as the forward pass does."""
    m = model
    nq, nkv, d = m.num_heads, m.num_kv_heads, m.head_dim
    nqk = (nq + nkv) * d
    hidden, eps = (m.hidden,), m.eps
    half = d // 2
    cos, sin = m.rope_row(pos)
    h = m.embed[token : token + 1].clone()  # [1, H]: the residual stream, updated in place
    for i, w in enumerate(m.layers):
        qkv = w.qkv(F.rms_norm(h, hidden, w.norm_in, eps)).float()
        qk = qkv[:, :nqk].view(nq + nkv, d)
        qk = torch.addcmul(qk * cos, qk.roll(half, -1), sin).view(1, nq + nkv, d)
        attn = kv.attend(i, qk[:, :nq], qk[:, nq:], qkv[:, nqk:].view(1, nkv, d), pos, scale)
        h.add_(w.o(attn.reshape(1, nq * d)))
        gate_up = w.gate_up(F.rms_norm(h, hidden, w.norm_post, eps))
        inter = gate_up.shape[1] // 2
        h.add_(w.down(F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])))
    return m.lm_head(F.rms_norm(h, hidden, m.norm, eps))[0].float()
