"""The server quality probe asks for the forced token's own logprob, and the figures
say where they had to assume it (no server: a fake one answers /v1/completions)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from contextkit.bench.agents_vllm import quality
from integrations.vllm.bench.agents_bench import Probe, quality_probe

VOCAB = 40


def distribution(best: int) -> dict[int, float]:
    """Logprobs over ``VOCAB`` tokens: ``best`` first, then falling with the id."""
    logits = {t: (5.0 if t == best else -0.1 * t) for t in range(VOCAB)}
    norm = math.log(sum(math.exp(v) for v in logits.values()))
    return {t: v - norm for t, v in logits.items()}


class CompletionsServer:
    """``post`` of the OpenAI server, as vLLM answers a one-token completion with
    ``logprobs``: the top 20 (rank order) and the sampled token's own logprob, which
    the top 20 leave out below rank 20. Greedy, with ``logit_bias`` applied after the
    logprobs are taken, as vLLM v1 does."""

    def __init__(self, best: int) -> None:
        self.logprobs = distribution(best)
        self.bodies: list[dict[str, Any]] = []

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        assert path == "/v1/completions"
        self.bodies.append(body)
        bias = {int(k): v for k, v in body.get("logit_bias", {}).items()}
        sampled = max(self.logprobs, key=lambda t: self.logprobs[t] + bias.get(t, 0.0))
        top = sorted(self.logprobs, key=lambda t: -self.logprobs[t])[:body["logprobs"]]
        return {"choices": [{"logprobs": {
            "tokens": [f"token_id:{sampled}"],
            "token_logprobs": [self.logprobs[sampled]],
            "top_logprobs": [{f"token_id:{t}": self.logprobs[t] for t in top}]}}]}


def probe_tops(server: CompletionsServer, reference: list[int] | None) -> list[dict[str, float]]:
    """The probe's logprobs at each forced position of one prompt."""
    out = quality_probe(server, [Probe([1, 2, 3], "tenant", None)],
                        None if reference is None else [reference], 2, filler=[9] * 64)
    return list(out["tops"][0])


def test_the_probe_returns_the_forced_tokens_own_logprob_outside_the_top_20() -> None:
    server = CompletionsServer(best=3)
    tops = probe_tops(server, [35, 3])  # token 35 ranks 36th of 40
    assert [b.get("logit_bias") for b in server.bodies if b["prompt"][0] == 1][-2:] == [
        {"35": 100}, {"3": 100}]
    assert len(tops[0]) == 21 and tops[0]["35"] == server.logprobs[35]
    assert max(tops[0], key=lambda t: tops[0][t]) == "3"  # the argmax is still the model's
    assert len(tops[1]) == 20  # token 3 is in the top 20


def test_the_reference_probe_forces_nothing_and_keeps_the_top_20() -> None:
    server = CompletionsServer(best=3)
    tops = probe_tops(server, None)
    assert all("logit_bias" not in b for b in server.bodies)
    assert [len(t) for t in tops] == [20, 20]


def as_keys(logprobs: dict[int, float]) -> dict[str, float]:
    return {str(t): v for t, v in logprobs.items()}


def test_a_forced_token_with_its_own_logprob_is_not_assumed() -> None:
    reference = as_keys({t: v for t, v in distribution(3).items() if t < 20})
    server = CompletionsServer(best=7)
    own = probe_tops(server, [3, 3])[0]
    assert "3" in own  # token 3 ranks 4th here: in the top 20 anyway
    figures = quality([[reference]], [[own]], [[3]])
    assert figures["forced_logprob_assumed"] == 0 and figures["teacher_forced_agreement"] == 0


def test_a_forced_token_missing_from_the_probe_is_counted_and_taken_at_the_20th() -> None:
    full = distribution(3)
    reference = as_keys({t: full[t] for t in sorted(full, key=lambda t: -full[t])[:20]})
    probe_full = distribution(0)
    ranked = sorted(probe_full, key=lambda t: -probe_full[t])
    top20 = as_keys({t: probe_full[t] for t in ranked[:20]})
    forced = ranked[30]  # outside the probe's top 20
    with_own = dict(top20, **{str(forced): probe_full[forced]})
    reference[str(forced)] = reference.get(str(forced), -1.0)
    assumed = quality([[reference]], [[top20]], [[forced]])
    exact = quality([[reference]], [[with_own]], [[forced]])
    assert assumed["forced_logprob_assumed"] == 1 and exact["forced_logprob_assumed"] == 0
    # the 20th logprob is above the token's own: assuming it understates the ratio
    assert assumed["ppl_ratio"] < exact["ppl_ratio"]
    assert exact["ppl_ratio"] == pytest.approx(
        math.exp(-probe_full[forced] + reference[str(forced)]), rel=1e-3)
