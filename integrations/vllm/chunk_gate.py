"""The per-model quality gate of chunk reuse on vLLM.

Before the connector reuses a chunk at another position it checks, once per served
model, that doing so keeps the model's predictions: a previous turn's prompt (a system
line, then documents C, B, A) is computed in full; the next prompt (the system line,
A, B, a question) is served twice, by a full prefill and by chunk reuse (the system
line as a prefix, A and B moved from the previous turn with their first tokens
repaired, the question computed), both through the server's own modules
(:mod:`integrations.vllm.chunk_forward`): the full passes in the model's dtype, the
reused one as the connector computes (its projections in ``chunk_matmul_dtype``, and
its attention too where that is bfloat16 on AMX and the pass has 64 tokens or more).
The question's tokens are teacher-forced through both; chunk reuse stays on when their
top-1 agreement and mean KL meet the thresholds (:class:`GateResult`), and is off, with
the figures in its reason, when not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from integrations.vllm.chunk_forward import ContiguousKV, ServedLlama

__all__ = ["GATE_TEXTS", "GateResult", "compare_logits", "run_gate"]

#: The gate's prompt parts: a system line, three documents and a question.
GATE_TEXTS = {
    "system": "You are the on-call assistant of a payments platform. Answer from the "
              "documents below, briefly and precisely.",
    "a": "Runbook: when the checkout API's p95 latency rises above 300 ms, first check "
         "the database connection pool, then the cache hit rate of the session store, "
         "and roll back the last deploy if both look healthy.",
    "b": "Incident 4412: the fraud scoring service timed out for twelve minutes after a "
         "certificate rotation; requests were retried and no payment was lost. The "
         "follow-up moved rotations to business hours.",
    "c": "Capacity note: the ledger cluster runs at 41 percent of its write budget; the "
         "next region adds two replicas in March and doubles the queue partitions.",
    "question": "Question: the checkout API is slow since this morning's deploy and the "
                "pool looks fine. What should I check next, and when do I roll back?",
}


@dataclass(frozen=True, slots=True)
class GateResult:
    """One gate run: teacher-forced agreement and mean KL of chunk reuse against a full
    prefill over the question's tokens, and whether they pass."""

    agreement: float
    mean_kl: float
    tokens: int
    passed: bool

    def reason(self) -> str | None:
        """Why chunk reuse is off (None: it passed)."""
        if self.passed:
            return None
        return (f"the model's chunk-reuse check failed: top-1 agreement {self.agreement:.3f},"
                f" mean KL {self.mean_kl:.4f} over {self.tokens} tokens against a full "
                "prefill")


def compare_logits(reused: torch.Tensor, full: torch.Tensor, *, min_agreement: float,
                   max_kl: float) -> GateResult:
    """Agreement and mean KL(full || reused) of two ``[T, vocab]`` logit rows."""
    agree = (reused.argmax(-1) == full.argmax(-1)).float().mean().item()
    logp_full = torch.log_softmax(full.float(), -1)
    logp_reused = torch.log_softmax(reused.float(), -1)
    kl = (logp_full.exp() * (logp_full - logp_reused)).sum(-1).mean().item()
    return GateResult(agree, kl, int(full.shape[0]),
                      agree >= min_agreement and kl <= max_kl)


def run_gate(model: ServedLlama, tokenize: Callable[[str], Sequence[int]], *,
             repair_first: int, min_agreement: float, max_kl: float) -> GateResult:
    """Run the gate's two passes (see the module's docstring) on ``model``."""
    ids = {name: list(tokenize(text)) for name, text in GATE_TEXTS.items()}
    system, a, b, c, question = (ids[n] for n in ("system", "a", "b", "c", "question"))
    layers, heads, dim = model.num_layers, model.num_kv_heads, model.head_dim
    before = system + c + b + a
    source = ContiguousKV(layers, heads, len(before), dim)
    model.forward(before, range(len(before)), source, exact=True)
    a_at, b_at = len(system) + len(c) + len(b), len(system) + len(c)

    target = system + a + b + question
    full = ContiguousKV(layers, heads, len(target), dim)
    q_from = len(system) + len(a) + len(b)
    full_logits = model.forward(target, range(len(target)), full, logits=True, exact=True)
    assert full_logits is not None

    reused = ContiguousKV(layers, heads, len(target), dim)
    n_sys = len(system)
    reused.k[:, :, :n_sys] = source.k[:, :, :n_sys]
    reused.v[:, :, :n_sys] = source.v[:, :, :n_sys]
    compute: list[int] = []
    for start, length, src in ((n_sys, len(a), a_at), (n_sys + len(a), len(b), b_at)):
        delta = torch.full((length,), start - src, dtype=torch.int64)
        for layer in range(layers):
            k = source.k[layer][:, src:src + length].transpose(0, 1)  # [T, H, D]
            reused.k[layer][:, start:start + length] = model.rotate(k, delta).transpose(0, 1)
            reused.v[layer][:, start:start + length] = source.v[layer][:, src:src + length]
        compute += range(start, start + min(repair_first, length))
    compute += range(q_from, len(target))
    logits = model.forward([target[p] for p in compute], compute, reused, logits=True)
    assert logits is not None
    n_q = len(target) - q_from
    # the logits that predict the question's tokens: from the token before each
    return compare_logits(logits[-n_q:-1], full_logits[q_from:-1],
                          min_agreement=min_agreement, max_kl=max_kl)
