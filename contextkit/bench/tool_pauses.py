"""Agents whose user turns end in a tool call, on one vLLM server whose KV holds about
two of them: is a paused agent's KV still there when its tool returns?

Runs inside the vLLM virtualenv, through the driver of ``bench agents-vllm``
(:mod:`integrations.vllm.bench.agents_bench` with ``--tool-pauses`` and
``--tool-rounds``): 8 LangChain agents of 3 tenants on the seeded multi-agent schedule.
An agent's user turn ends in a tool call; its next step is the tool round that resumes
it (the call and the tool's result appended to the same prompt, under the same system
prompt), after the tool's pause: drawn from 1-60 s, seeded, times ``--time-scale``
(0.05 by default: 0.05-3 s; the other agents' steps in between add to it). The step
after that is the agent's next user turn. The configurations run side by side, each
step sent to each in turn, on one transcript:

- ``apc``: vLLM's prefix caching alone;
- ``connector``: contextkit's connector, no hints;
- ``connector_hints``: the same connector; the agents send the ``x-session-id``
  header (the connector learns each session's pause and keeps its blocks through the
  next one), Dynamo's ``nvext.cache_control`` TTL and an SGLang ``priority``;
- ``lmcache``: LMCache's multi-process connector, its L1 in RAM of the connector's
  DDR budget (see ``bench agents-vllm``);
- ``ceiling``: a server whose KV holds every agent.

Figures over the resume turns (the tool rounds):
``resumed_hit_fraction`` (the prompt tokens of the agent's previous turn reused on its
resume: cached tokens, at most that many, summed, over the previous prompts' sum),
their TTFT median and sum, ``speedup_hints_vs_nohints_p50`` and
``speedup_vs_apc_p50`` (the other configuration's median over ``connector_hints``'),
the ceiling's, and, where two configurations computed the same tokens on those turns,
"same tokens" instead of a ratio. The connectors' counters say what the hints pinned,
what the tenants' pin quotas refused, and what pauses kept and released.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from contextkit.bench._agents_report import SAME_TOKENS
from contextkit.bench._common import (
    machine_info,
    positive_float,
    positive_int,
    print_table,
    the_configs,
)
from contextkit.bench.agents_vllm import add_workload_arguments, run_driver

__all__ = ["CONFIGS", "HELP", "add_arguments", "result_of", "resume_figures", "run"]

HELP = ("agents whose user turns end in a tool call, on one vLLM server: is the paused "
        "agent's KV there when the tool's result comes back? APC, the connector, with "
        "agent hints, LMCache, ceiling")
#: ``--out`` names a JSON file; the CLI writes the result there with its provenance.
OUT_IS_JSON = True

CONFIGS = ("ceiling", "apc", "connector", "connector_hints", "lmcache")
#: The issue's targets, checked in the report (never in a test: a loaded machine).
GOALS = {"resumed_hit_fraction_hints": 0.95, "speedup_hints_vs_nohints_p50": 1.5,
         "speedup_vs_apc_p50": 3.0}
#: The connector's counters per configuration (the last one is a figure of its own).
SHOWN = ("hint_pinned_blocks", "hint_pins_refused", "pause_kept_blocks",
         "pause_released_blocks", "pause_warmed_blocks")
COUNTERS = (*SHOWN, "hint_other_pins_lost")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser, agents=8, steps=32)
    parser.add_argument("--time-scale", type=positive_float, default=0.05,
                        help="the tools' pauses (1-60 s) times this (default 0.05)")
    parser.add_argument("--device-blocks", type=positive_int, default=None,
                        help="the connectors' device_blocks, where pins live (default: "
                             "the connector's default)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, from {', '.join(CONFIGS)} (default: all; "
                             "the ceiling always runs)")


# ---------------------------------------------------------------------- pure figures
def resume_figures(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One configuration's resume turns (the rows of tool rounds): their indices, the
    reused share of each agent's previous prompt, TTFTs and computed tokens."""
    previous: dict[str, int] = {}
    resumes: list[int] = []
    reused = owed = computed = 0
    for i, row in enumerate(rows):
        agent, prompt = str(row["agent"]), int(row.get("prompt_tokens") or 0)
        cached = int(row.get("cached_tokens") or 0)
        if row.get("tool_result") and agent in previous:
            resumes.append(i)
            owed += previous[agent]
            reused += min(cached, previous[agent])
            computed += prompt - cached
        previous[agent] = prompt
    ttft = [float(rows[i]["ttft_ms"]) for i in resumes]
    return {"resume_steps": resumes,
            "resumed_hit_fraction": round(reused / owed, 4) if owed else None,
            "resume_ttft_p50": statistics.median(ttft) if ttft else None,
            "resume_ttft_sum": round(sum(ttft), 1), "resume_computed_tokens": computed}


def _ratio(figures: Mapping[str, Mapping[str, Any]], num: str, den: str,
           key: str = "resume_ttft_p50") -> float | str | None:
    a, b = figures.get(num), figures.get(den)
    if not a or not b or not b.get(key) or a.get(key) is None:
        return None
    if a["resume_computed_tokens"] == b["resume_computed_tokens"]:
        return SAME_TOKENS
    return round(float(a[key]) / float(b[key]), 3)


def _met(value: Any, goal: float) -> str:
    if not isinstance(value, int | float):
        return f"{value} (goal >= {goal:g})"
    return f"{value} ({'met' if value >= goal else 'not met'}: goal >= {goal:g})"


def result_of(args: argparse.Namespace, raw: Mapping[str, Any]) -> dict[str, Any]:
    """The bench's figures from the driver's raw rows."""
    runs: Mapping[str, Any] = raw["configs"]
    figures = {n: resume_figures(runs[n]["rows"]) for n in runs}
    counters = {n: {c: runs[n].get("metrics", {}).get(f"vllm:contextkit_{c}_total")
                    for c in COUNTERS}
                for n in runs if n.startswith("connector")}
    hints = figures.get("connector_hints", {})
    result: dict[str, Any] = {
        "bench": "tool-pauses",
        "resumed_hit_fraction": {n: f["resumed_hit_fraction"] for n, f in figures.items()},
        "resumed_hit_fraction_hints": hints.get("resumed_hit_fraction"),
        "speedup_hints_vs_nohints_p50": _ratio(figures, "connector", "connector_hints"),
        "speedup_vs_apc_p50": _ratio(figures, "apc", "connector_hints"),
        "speedup_vs_lmcache_p50": _ratio(figures, "lmcache", "connector_hints"),
        "speedup_hints_vs_nohints_total": _ratio(figures, "connector", "connector_hints",
                                                 "resume_ttft_sum"),
        "ceiling_vs_apc_p50": _ratio(figures, "apc", "ceiling"),
        "ceiling_fraction": _ratio(figures, "ceiling", "connector_hints"),
        # counted by the connector on every hint's and keep's pin (goal: 0)
        "other_tenant_pins_lost_to_hints": counters.get("connector_hints", {}).get(
            "hint_other_pins_lost"),
        "goals": GOALS,
        "resume": figures,
        "counters": counters,
        "ttft_ms": {n: [r["ttft_ms"] for r in runs[n]["rows"]] for n in runs},
        "prompt_tokens": {n: [r["prompt_tokens"] for r in runs[n]["rows"]] for n in runs},
        "cached_tokens": {n: [r["cached_tokens"] for r in runs[n]["rows"]] for n in runs},
        "tool_pause_s": [r.get("tool_pause_s") for r in runs[next(iter(runs))]["rows"]],
        "time_scale": raw.get("tool_pauses_scale"),
        "interleaved": bool(raw.get("interleaved")),
        "not_run": raw.get("errors", {}),
        "sizes": raw.get("sizes"),
        "workload": raw.get("workload"),
        "machine": machine_info(),
        "model": "packaged SmolLM2-135M-Instruct (float32)" if not args.model else args.model,
        "method": "every server up, each step sent to each configuration in turn, one "
                  "transcript; a user turn ends in a tool call whose pause (1-60 s x "
                  "time_scale, seeded) passes before the agent's next step, the tool "
                  "round (the call and its result appended to the same prompt); figures "
                  "over the tool rounds; client-side TTFT",
        "tool_rounds": bool(raw.get("tool_rounds")),
        "device_blocks": raw.get("device_blocks"),
    }
    table: list[tuple[str, Any]] = [
        (f"resumed_hit_fraction {n}", f["resumed_hit_fraction"]) for n, f in figures.items()]
    table += [(f"resume ttft p50 {n} (ms)", f["resume_ttft_p50"]) for n, f in figures.items()]
    table += [(k, _met(result[k], GOALS[k])) for k in GOALS]
    table += [("ceiling_fraction", result["ceiling_fraction"]),
              ("speedup_vs_lmcache_p50", result["speedup_vs_lmcache_p50"]),
              ("other tenants' pins lost to hints (goal 0)",
               result["other_tenant_pins_lost_to_hints"])]
    table += [(f"{n}: hint pinned / refused, pause kept / released / warmed",
               " / ".join(str(c[k]) for k in SHOWN)) for n, c in counters.items()]
    print_table(f"{raw['workload']['num_agents']} agents, each user turn a tool call "
                f"({raw['workload']['num_steps']} steps)", table)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    configs = the_configs(args.configs, CONFIGS)
    args.quality_steps = 1  # the driver's probe: one prompt (this bench reports no quality)
    extra = ["--tool-pauses", str(args.time_scale), "--tool-rounds"]
    if args.device_blocks:
        extra += ["--device-blocks", str(args.device_blocks)]
    raw = run_driver(args, configs, "tool-pauses", extra)
    return result_of(args, raw)
