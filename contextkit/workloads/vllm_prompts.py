"""Agent-like labelled prompts for ``contextkit bench vllm``.

Each prompt is one turn of :class:`contextkit.workloads.replay.AgentReplay` (the layered SRE
assistant's system prompt, a scripted conversation, the turn's user message) assembled
by :meth:`contextkit.pipeline.pipeline.CacheAwareContextPipeline.assemble` on the embedded
engine: the token ids are the served SmolLM2 tokenizer's and chat template's, and the
``TokenSpan`` layer labels travel to the connector as ``kv_transfer_params``. Prompt
``i`` is turn ``i`` of a replay seeded ``i`` (its own platform snapshot, clock, topic,
memories and history) and carries its own ``cache_salt`` (``agent-<i>``), so no prompt
shares a stored block with another and a cold run never hits the store.

The stable layers alone are about 2.3K tokens, so a prompt is brought to about
``prompt_tokens`` by lowering the budgets of the layers that trim well
(:data:`TRIM_ORDER`: ``capabilities`` first, then ``neurons``, ``memories`` ...) and
letting the pipeline drop their least important lines; the identity-bearing layers
(axioms, identity, rules) stay whole.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["TRIM_ORDER", "agent_prompts", "scripted_reply", "trimmed_layers"]

logger = logging.getLogger(__name__)

#: layers whose budgets are lowered, in order, to bring a prompt to its length, and the
#: least each keeps (tokens)
TRIM_ORDER: tuple[tuple[str, int], ...] = (
    ("capabilities", 120), ("neurons", 100), ("memories", 100), ("awareness", 80),
    ("affect", 80), ("system_state", 80))
#: conversation turns before the measured one (scripted user messages and replies)
HISTORY_TURNS = 2


def scripted_reply(topic: str, turn: int) -> str:
    """A deterministic assistant reply for the conversation history (no generation)."""
    return (f"Checked the {topic} side for you (turn {turn + 1}). I compared the last 30 "
            f"minutes with the same window yesterday and noted the services that moved. "
            f"Next I will confirm with the dashboards and tell you before changing anything.")


def trimmed_layers(layers: Any, lengths: Mapping[str, int], excess: int) -> Any:
    """``layers`` (a :class:`~contextkit.prompt.layers.LayerConfig`) with the budgets of
    :data:`TRIM_ORDER` lowered by ``excess`` tokens in all, first layers first, none
    below its floor; ``lengths`` are the layers' token counts in the last prompt (a
    layer's effective budget is the smaller of its budget and its length)."""
    from contextkit.prompt.layers import LayerConfig

    new = {spec.name: spec for spec in layers}
    for name, floor in TRIM_ORDER:
        if excess <= 0 or name not in new or name not in lengths:
            continue
        have = min(new[name].budget_for(True), new[name].budget_for(False), lengths[name])
        cut = min(excess, have - floor)
        if cut > 0:
            new[name] = dataclasses.replace(new[name], budget=have - cut,
                                            expanded_budget=have - cut)
            excess -= cut
    return LayerConfig(tuple(new.values()))


def _layer_lengths(spans: Sequence[Any], config: Any) -> dict[str, int]:
    by_source = {spec.source: spec.name for spec in config}
    out: dict[str, int] = {}
    for s in spans:
        name = by_source.get(s.source_layer)
        if name is not None:
            out[name] = out.get(name, 0) + s.end - s.start
    return out


def _assemble(engine: Any, index: int, config: Any, scale: float
              ) -> tuple[list[int], list[Any]]:
    from contextkit.pipeline.building import layer_spans
    from contextkit.pipeline.pipeline import CacheAwareContextPipeline
    from contextkit.workloads.replay import AgentReplay

    turn = index % 20
    replay = AgentReplay(turn + 1, seed=index, scale=scale)
    pipeline = CacheAwareContextPipeline(engine, layers=config, tenant=f"agent-{index}")
    history: list[tuple[str, str]] = []
    for t in range(max(0, turn - HISTORY_TURNS), turn):
        past = replay.turn(t)
        history += [("user", past.user_message), ("assistant", scripted_reply(past.topic, t))]
    pipeline.wrap(replay.build_system_message)(turn)
    ids, spans, _ = pipeline.assemble(replay.turn(turn).user_message, history)
    return ids, layer_spans(spans)  # the connector labels layers, not lines


def agent_prompts(engine: Any, num: int, prompt_tokens: int, *, scale: float = 0.3
                  ) -> list[dict[str, Any]]:
    """``num`` labelled agent prompts of about ``prompt_tokens`` tokens (at most).

    Returns per prompt ``{"token_ids", "cache_salt", "spans", "turn"}`` (an entry of
    the harness's prompts file): ``spans`` are the layer labels ``{"layer", "start",
    "end", "importance", "pinned"}`` (``pinned``: a pinnable layer, axioms, identity,
    rules, capabilities, soul). The harness sends them to the connector as
    ``kv_transfer_params`` (``integrations.vllm.planning.semantic_params`` with the
    prompt's fingerprint; contextkit imports nothing from integrations).

    Raises:
        ValueError: a prompt cannot be brought under ``prompt_tokens`` (too short a
            target for the replay's untrimmed layers).
    """
    from contextkit.prompt.layers import LayerConfig
    from gpu_cache import PINNABLE_SOURCES

    out: list[dict[str, Any]] = []
    for i in range(num):
        config = LayerConfig()
        ids, spans = _assemble(engine, i, config, scale)
        for _ in range(8):  # lines drop whole, budgets count a bit apart: a few rounds
            if len(ids) <= prompt_tokens:
                break
            config = trimmed_layers(config, _layer_lengths(spans, config),
                                    len(ids) - prompt_tokens)
            ids, spans = _assemble(engine, i, config, scale)
        if len(ids) > prompt_tokens:
            raise ValueError(f"agent prompt {i} is {len(ids)} tokens even trimmed; use "
                             f"--prompt-tokens {len(ids)} or more")
        labels = [{"layer": s.source_layer, "start": s.start, "end": s.end,
                   "importance": round(float(s.importance), 4),
                   "pinned": s.source_layer in PINNABLE_SOURCES} for s in spans]
        out.append({"token_ids": list(ids), "cache_salt": f"agent-{i}", "spans": labels,
                    "turn": i % 20})
        logger.info("agent prompt %d: %d tokens, %d labelled spans", i, len(ids), len(spans))
    return out
