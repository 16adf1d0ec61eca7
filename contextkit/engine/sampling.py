"""Choosing the next token: greedy by default, or sampled with the usual settings.

:class:`SamplingParams` holds a request's settings (validated when made);
:class:`Sampler` applies them to one request's logits, token after token, in the
order transformers' ``generate`` does: repetition penalty, temperature, top-k, top-p,
then a draw from a ``torch.Generator`` of its own. ``temperature == 0`` (the default)
is greedy: the argmax, and every other setting but the repetition penalty is unused.

A seeded request is reproducible: the same prompt, settings and seed give the same
tokens on the same machine and weights. Without a seed each request draws a fresh one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Sampler", "SamplingParams"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a request picks its tokens.

    Attributes:
        temperature: ``0`` greedy (the default); above 0 the logits are divided by it
            before sampling (below 1 sharper, above 1 flatter).
        top_p: sample only from the smallest set of tokens whose probabilities add up
            to at least this (nucleus sampling); ``1.0`` off.
        top_k: sample only from the ``top_k`` most likely tokens; ``0`` off.
        seed: seeds the request's own generator (reproducible runs); ``None`` a fresh
            random seed per request.
        repetition_penalty: above 1 makes tokens already in the prompt or the reply
            less likely (CTRL's penalty, as transformers applies it); ``1.0`` off.
            Applies to greedy decoding too.

    Raises:
        ValueError: a setting out of its range (the message names it).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        checks = (
            ("temperature", self.temperature, self.temperature >= 0, ">= 0 (0 is greedy)"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k, self.top_k >= 0, ">= 0 (0 is off)"),
            ("repetition_penalty", self.repetition_penalty, self.repetition_penalty > 0,
             "> 0 (1 is off)"),
        )
        for name, value, ok, rule in checks:
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or not ok:
                raise ValueError(f"{name} must be a number {rule}, got {value!r}")
        if not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool)
                                      or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be an int >= 0 or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """Whether tokens are the argmax (``temperature == 0``)."""
        return self.temperature == 0


#: Greedy decoding, no penalty: what a request gets when it names no settings.
GREEDY = SamplingParams()


class Sampler:
    """Picks one request's tokens with its :class:`SamplingParams`.

    Args:
        params: the settings (default: greedy).
        device: where the logits live (the generator is made there).
    """

    def __init__(self, params: SamplingParams | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.params = params or GREEDY
        self._generator: torch.Generator | None = None
        if not self.params.greedy:
            self._generator = torch.Generator(device=device)
            seed = self.params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,)).item())
            self._generator.manual_seed(seed)

    def penalized(self, logits: torch.Tensor, seen: Sequence[int]) -> torch.Tensor:
        """``logits`` ``[V]`` with the repetition penalty applied to the ``seen`` tokens."""
        penalty = self.params.repetition_penalty
        if penalty == 1.0 or not seen:
            return logits
        ids = torch.tensor(sorted(set(seen)), dtype=torch.long, device=logits.device)
        picked = logits[ids]
        logits = logits.clone()
        logits[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
        return logits

    def __call__(self, logits: torch.Tensor, seen: Sequence[int] = ()) -> int:
        """The next token for ``logits`` ``[V]`` (float), given the ``seen`` token ids
        (prompt and reply so far, for the repetition penalty)."""
        logits = self.penalized(logits.float(), seen)
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if 0 < p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            ordered, order = torch.sort(logits, descending=True)
            cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
            # drop a token when the ones before it already reach top_p (keep the first)
            drop = cumulative - torch.softmax(ordered, dim=-1) >= p.top_p
            logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop),
                                        float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self._generator))
