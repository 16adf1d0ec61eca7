"""Floating-point operations of a prefill: what a reused prefix saves.

A count from the model's shapes alone (no forward runs), used by
:meth:`contextkit.engine.engine.Engine.prefill_flops` and the TTFT benchmark.
"""

from __future__ import annotations

from contextkit.engine.llama import LlamaModel

__all__ = ["prefill_flops"]


def prefill_flops(model: LlamaModel, prompt_tokens: int, reused_tokens: int = 0) -> int:
    """Floating-point operations of a prefill that reuses the first
    ``reused_tokens`` and computes the rest, up to the first token's logits.

    Counts the projections and MLP of every computed token (2 per weight), the
    attention scores and weighted values of each computed token over the keys
    it sees (``4 * heads * head_dim`` per key and layer) and the LM head of the
    last token; norms, RoPE and softmax are left out (a few percent). The ratio
    of two counts is the speedup a reuse can give when both runs reach the same
    fraction of the machine's peak.

    Raises:
        ValueError: not ``0 <= reused_tokens < prompt_tokens``.
    """
    if not 0 <= reused_tokens < prompt_tokens:
        raise ValueError(f"need 0 <= reused_tokens < prompt_tokens, got {reused_tokens} "
                         f"and {prompt_tokens}")
    m = model
    weights = sum(w.qkv.numel() + w.o.numel() + w.gate_up.numel() + w.down.numel()
                  for w in m.layers)
    computed = prompt_tokens - reused_tokens
    # token j (0-based) attends to keys 0..j: sum over the computed tokens
    keys_seen = computed * reused_tokens + computed * (computed + 1) // 2
    attention = 4 * m.num_layers * m.num_heads * m.head_dim * keys_seen
    return 2 * weights * computed + attention + 2 * m.lm_head.numel()
