"""Weight formats of the engine's matrices: float32, bfloat16 and int8 (weight-only).

A decode step reads every weight once per token, so on a CPU its speed is the
memory bandwidth over the bytes of weights (SmolLM2-135M: ~540 MB in float32). Each
format is a small matrix class with one call, ``matrix(x)`` for activations ``x``
``[T, K]`` (float32), returning ``[T, N]`` (float32, or bfloat16 for the reduced
formats: callers add it to the float32 residual stream or cast it):

- ``float32``: the weights as loaded (exact; the reference), stored transposed;
- ``bfloat16``: weights stored bf16 (half the bytes), activations cast to bf16, a bf16
  GEMM (AVX-512 BF16 where the CPU has it);
- ``int8``: per-output-channel symmetric weight-only quantization (a quarter of the
  bytes): ``W ~ q * s`` with ``q`` int8 in ``[-127, 127]`` and one scale per row,
  rounded *up* to a bfloat16 value so that the kernels' bf16 scales are exact and
  ``|W - q s| <= s / 2`` holds element-wise. One token (``T = 1``) runs
  ``torch._weight_int8pack_mm`` (bf16 activations); more tokens (prefill) convert
  ``q`` to bf16 (exact: |q| <= 127) for a bf16 GEMM and scale the float32 result, which
  is several times faster than that kernel there. Both read the same ``q`` and ``s``.

:func:`fidelity` compares an engine's weights with a float32 reference on prompts
(teacher-forced top-1 agreement and perplexity ratio).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from contextkit.config.settings import WEIGHT_FORMATS, check_weight_format

__all__ = ["WEIGHT_FORMATS", "check_weight_format", "fidelity", "matrix"]

#: ``int8`` matrices run ``torch._weight_int8pack_mm`` up to this many tokens and a
#: bf16 GEMM over the converted weights above (measured on AVX-512: the GEMM wins from
#: a few tokens on).
_INT8_KERNEL_MAX_TOKENS = 1


class Matrix(Protocol):
    """A weight matrix ``[N, K]`` in some format."""

    shape: torch.Size

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def numel(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def dense(self) -> torch.Tensor: ...


class Float32Matrix:
    """The weights as loaded (float32), kept transposed: ``x @ W_t`` with ``W_t``
    ``[K, N]`` contiguous. For one token MKL's GEMV over that layout reads the weights
    ~1.3-1.5x faster than over ``W`` ``[N, K]`` (``x @ W.T``) on AVX-512; for many
    tokens both layouts run alike."""

    def __init__(self, w: torch.Tensor) -> None:
        self.wt = w.detach().t().contiguous()
        self.shape = w.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.wt

    def numel(self) -> int:
        return self.wt.numel()

    @property
    def nbytes(self) -> int:
        return self.wt.numel() * self.wt.element_size()

    def dense(self) -> torch.Tensor:
        """The weights as float32 ``[N, K]``."""
        return self.wt.t().float()


class BFloat16Matrix:
    """Weights stored bfloat16; activations cast to bf16; bf16 result."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w.detach().to(torch.bfloat16).contiguous()
        self.shape = self.w.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16) @ self.w.T

    def numel(self) -> int:
        return self.w.numel()

    @property
    def nbytes(self) -> int:
        return self.w.numel() * 2

    def dense(self) -> torch.Tensor:
        return self.w.float()


def _ceil_bf16(x: torch.Tensor) -> torch.Tensor:
    """Positive float32 values rounded up to the next bfloat16 value (as float32)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32)


class Int8Matrix:
    """Per-output-channel symmetric int8 weights: ``W ~ q * s[:, None]``.

    ``s`` is a bfloat16 value (``max |W[n]| / 127`` rounded up), so ``|q| <= 127`` and
    every element is within ``s / 2`` of the original weight.
    """

    def __init__(self, w: torch.Tensor) -> None:
        w32 = w.detach().float()
        amax = w32.abs().amax(dim=1)
        s = _ceil_bf16(amax / 127.0)
        s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero row: q = 0
        self.q = torch.round(w32 / s[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        self.scale = s  # float32, exactly bf16-representable
        self.scale_bf16 = s.to(torch.bfloat16)
        self.shape = self.q.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if x.shape[0] <= _INT8_KERNEL_MAX_TOKENS:
            return torch._weight_int8pack_mm(xb, self.q, self.scale_bf16)
        return (xb @ self.q.to(torch.bfloat16).T) * self.scale

    def numel(self) -> int:
        return self.q.numel()

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale_bf16.numel() * 2

    def dense(self) -> torch.Tensor:
        """The dequantized weights ``q * s`` as float32 ``[N, K]``."""
        return self.q.float() * self.scale[:, None]


_MATRICES: dict[str, type[Float32Matrix] | type[BFloat16Matrix] | type[Int8Matrix]] = {
    "float32": Float32Matrix, "bfloat16": BFloat16Matrix, "int8": Int8Matrix}


def matrix(w: torch.Tensor, weight_format: str) -> Matrix:
    """``w`` ``[N, K]`` as a :class:`Matrix` of ``weight_format``."""
    return _MATRICES[check_weight_format(weight_format)](w)


# --------------------------------------------------------------------------- fidelity
def _nll(logits: torch.Tensor, target: Sequence[int]) -> float:
    """Summed negative log-likelihood of ``target`` under ``logits`` ``[T, V]``."""
    return float(torch.nn.functional.cross_entropy(
        logits.float(), torch.tensor(list(target)), reduction="sum"))


def fidelity(reference: Any, candidate: Any, prompts: Sequence[Sequence[int]], *,
             new_tokens: int = 32, held_out: Sequence[int] | None = None) -> dict[str, Any]:
    """How closely ``candidate`` (an :class:`~contextkit.engine.engine.Engine`, e.g. int8
    weights) follows ``reference`` (float32 weights) on ``prompts``, teacher-forced.

    Per prompt, the reference greedily writes ``new_tokens`` (a full prefill, no
    cache); both engines score that reply (``use_cache=False``: only the weights
    differ). ``top1_agreement`` is the fraction of reply positions where the
    candidate's argmax is the reference's token. Perplexities are of ``held_out``
    after each prompt (a natural continuation), or of the replies without it;
    ``ppl_ratio`` is candidate over reference.

    Returns:
        ``{"top1_agreement", "ppl_ratio", "ppl_reference", "ppl_candidate",
        "tokens", "prompts", "weight_format"}``.
    """
    if not prompts:
        raise ValueError("fidelity needs at least one prompt")
    hits = total = 0
    nll_ref = nll_cand = 0.0
    ppl_tokens = 0
    for prompt in prompts:
        reply = reference.generate(list(prompt), max_new_tokens=new_tokens,
                                   use_cache=False).token_ids
        ref = reference.score(prompt, reply, use_cache=False)
        cand = candidate.score(prompt, reply, use_cache=False)
        target = torch.tensor(reply)
        hits += int((cand.argmax(dim=-1) == target).sum())
        total += len(reply)
        ppl_target = list(held_out) if held_out is not None else reply
        if held_out is not None:
            ref = reference.score(prompt, ppl_target, use_cache=False)
            cand = candidate.score(prompt, ppl_target, use_cache=False)
        nll_ref += _nll(ref, ppl_target)
        nll_cand += _nll(cand, ppl_target)
        ppl_tokens += len(ppl_target)
    ppl_ref = math.exp(nll_ref / ppl_tokens)
    ppl_cand = math.exp(nll_cand / ppl_tokens)
    return {"top1_agreement": hits / total, "ppl_ratio": ppl_cand / ppl_ref,
            "ppl_reference": ppl_ref, "ppl_candidate": ppl_cand, "tokens": total,
            "prompts": len(prompts),
            "weight_format": getattr(candidate, "weight_format", None)}
