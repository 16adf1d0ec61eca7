"""Reuse beyond the prefix on vLLM: a RAG agent whose retrieved documents change order
and membership every turn, placed before the conversation.

Runs inside the vLLM virtualenv, through :mod:`integrations.vllm.bench.chunks_bench`
(all servers up, each step sent to each configuration in turn, one transcript: the
full prefill's replies). With ``--ingest`` each document is prefilled once before the
schedule, as an application does when a document enters its store. On the turns
where ``connector_chunks`` reused chunks, it
reports each configuration's TTFT (a one-token request, client side), the tokens it
computed (for chunk reuse: the prompt tokens vLLM computed plus those the connector
computed itself, the changed spans and seams), and the teacher-forced agreement,
perplexity ratio and mean KL of chunk reuse and of prefix reuse against the full
prefill on the same turns. Ratios are medians of the TTFTs over those turns. The
``oracle`` configuration measures chunk reuse's bound in the same run: vLLM computing
only the tokens no earlier prompt of the tenant held; ``bound_chunks_vs_prefix_p50``
is the prefix-only connector over it, ``ceiling_fraction`` the share of it reached.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from contextkit.bench._common import (
    machine_info,
    non_negative_int,
    positive_float,
    positive_int,
    print_table,
    the_configs,
    unit_float,
)
from contextkit.bench.agents_vllm import drive, quality

__all__ = ["CONFIGS", "DEFAULT_CONFIGS", "HELP", "add_arguments", "probed_quality", "result_of",
           "run"]

HELP = ("reuse beyond the prefix on vLLM: a RAG agent whose documents change order and "
        "membership every turn; chunk reuse vs prefix reuse, LMCache, full prefill and "
        "the oracle (chunk reuse's bound)")
#: ``--out`` names a JSON file; the CLI writes the result there with its provenance.
OUT_IS_JSON = True

CONFIGS = ("full", "ceiling", "apc", "connector", "connector_chunks", "lmcache", "oracle")
#: What runs by default: six vLLM servers fit in 24 GB, seven do not (APC is the one left
#: out: prefix reuse's bound, ``ceiling``, is the figure the goals compare with)
DEFAULT_CONFIGS = tuple(c for c in CONFIGS if c != "apc")
#: The issue's targets (checked in the report, never in a test).
GOALS = {"speedup_chunks_vs_prefix_p50": (">=", 2.5),
         "tokens_computed_vs_prefix": ("<=", 0.4),
         "teacher_forced_agreement": (">=", 0.97), "ppl_ratio": ("<=", 1.03),
         "mean_kl": ("<=", 0.02), "speedup_vs_lmcache_p50": (">=", 2.0)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--agents", type=positive_int, default=3, help="agents (default 3)")
    parser.add_argument("--tenants", type=positive_int, default=2, help="tenants (default 2)")
    parser.add_argument("--steps", type=positive_int, default=24,
                        help="steps, one agent turn each, round robin (default 24)")
    parser.add_argument("--docs", type=positive_int, default=5,
                        help="documents retrieved per turn (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--max-tokens", type=positive_int, default=24,
                        help="tokens of each reply (default 24)")
    parser.add_argument("--kv-agents", type=positive_float, default=1.5,
                        help="vLLM's KV space in agent prompts, but for full and ceiling "
                             "(default 1.5)")
    parser.add_argument("--quality-turns", type=positive_int, default=8,
                        help="chunk turns teacher-forced (default 8)")
    parser.add_argument("--quality-tokens", type=positive_int, default=16,
                        help="forced positions per turn (default 16)")
    parser.add_argument("--ingest", action="store_true",
                        help="prefill each document once before the schedule, as an "
                             "application does when a document enters its store")
    parser.add_argument("--repair-first", type=int, default=4,
                        help="connector_chunks' chunk_repair_first: each moved chunk's "
                             "first tokens recomputed (default 4, the connector's)")
    parser.add_argument("--seam-lead", type=non_negative_int, default=16,
                        help="connector_chunks' chunk_seam_lead: a moved chunk after the "
                             "same this-many tokens as where it was computed keeps no seam "
                             "(default 16, the connector's; 0: only a chunk continuing the "
                             "one before it)")
    parser.add_argument("--repair-ratio", type=unit_float, default=0.0,
                        help="connector_chunks' chunk_repair_ratio: the share of moved "
                             "tokens recomputed where their K/V deviate most (default 0)")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"comma-separated, from {', '.join(CONFIGS)} (default: all "
                             "but apc, which needs a seventh server; full always runs; "
                             "oracle is chunk reuse's bound: vLLM computing only the tokens "
                             "no earlier prompt of the tenant held)")
    parser.add_argument("--model", default=None,
                        help="model directory (default: the packaged SmolLM2, converted)")
    parser.add_argument("--dir", default=None, help="work directory for logs (default: temp)")
    parser.add_argument("--out", default=None,
                        help="also write the JSON result (with its provenance) here")


# ---------------------------------------------------------------------- pure figures
def computed_tokens(row: Mapping[str, Any]) -> int:
    """Prompt tokens a configuration computed on a step: those vLLM computed, plus
    those contextkit's connector computed itself (chunk reuse's spans and seams)."""
    prompt, cached = int(row["prompt_tokens"]), int(row.get("cached_tokens") or 0)
    report = row.get("report") or {}
    return prompt - cached + int(report.get("repaired_tokens") or 0)


def probed_quality(probes: Sequence[Mapping[str, Any]], name: str, reference: str = "full"
                   ) -> dict[str, Any] | None:
    """Teacher-forced agreement, perplexity ratio and mean KL of ``name`` against
    ``reference`` over the probed turns (:func:`contextkit.bench.agents_vllm.quality`
    over the driver's probes), or None when ``name`` was not probed."""
    probed = [p for p in probes if name in p["tops"] and reference in p["tops"]]
    if not probed:
        return None
    return quality([p["tops"][reference] for p in probed], [p["tops"][name] for p in probed],
                   [p["forced"] for p in probed])


def _p50(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def _met(value: Any, goal: tuple[str, float]) -> str:
    op, bound = goal
    if not isinstance(value, int | float):
        return f"{value} (goal {op} {bound:g})"
    ok = value >= bound if op == ">=" else value <= bound
    return f"{value} ({'met' if ok else 'not met'}: goal {op} {bound:g})"


def result_of(args: argparse.Namespace, raw: Mapping[str, Any]) -> dict[str, Any]:
    """The bench's figures from the driver's raw rows."""
    runs: Mapping[str, Any] = raw["configs"]
    chunk_rows = runs.get("connector_chunks", {}).get("rows", [])
    turns = [i for i, r in enumerate(chunk_rows) if (r.get("report") or {}).get("reuse") == "chunk"]
    ttft = {n: [float(runs[n]["rows"][i]["ttft_ms"]) for i in turns] for n in runs}
    computed = {n: sum(computed_tokens(runs[n]["rows"][i]) for i in turns) for n in runs}
    p50 = {n: _p50(t) for n, t in ttft.items()}
    chunks = p50.get("connector_chunks")
    probes = raw.get("probes", [])
    q_chunks = probed_quality(probes, "connector_chunks")
    q_prefix = probed_quality(probes, "connector")
    reused = sum(int((chunk_rows[i].get("report") or {}).get("chunk_reused_tokens") or 0)
                 for i in turns)
    result: dict[str, Any] = {
        "bench": "chunks-vllm",
        "chunk_turns": len(turns), "steps": len(chunk_rows),
        "speedup_chunks_vs_prefix_p50": _ratio(p50.get("connector"), chunks),
        "tokens_computed_vs_prefix": (round(computed["connector_chunks"]
                                            / computed["connector"], 3)
                                      if computed.get("connector") and "connector_chunks"
                                      in computed else None),
        "speedup_vs_apc_p50": _ratio(p50.get("apc"), chunks),
        "speedup_vs_lmcache_p50": _ratio(p50.get("lmcache"), chunks),
        "speedup_vs_full_p50": _ratio(p50.get("full"), chunks),
        "speedup_vs_prefix_ceiling_p50": _ratio(p50.get("ceiling"), chunks),
        "prefix_ceiling_vs_connector_p50": _ratio(p50.get("connector"), p50.get("ceiling")),
        "bound_chunks_vs_prefix_p50": _ratio(p50.get("connector"), p50.get("oracle")),
        "bound_vs_lmcache_p50": _ratio(p50.get("lmcache"), p50.get("oracle")),
        "ceiling_fraction": _ratio(p50.get("oracle"), chunks),
        "chunk_reused_tokens": reused,
        **(q_chunks or {}),
        "quality_prefix_only": q_prefix,
        "goals": {k: f"{op} {v:g}" for k, (op, v) in GOALS.items()},
        "ttft_p50_ms": p50,
        "computed_tokens": computed,
        "chunk_turn_steps": turns,
        "ttft_ms": {n: [r["ttft_ms"] for r in runs[n]["rows"]] for n in runs},
        "prompt_tokens": {n: [r["prompt_tokens"] for r in runs[n]["rows"]] for n in runs},
        "cached_tokens": {n: [r["cached_tokens"] for r in runs[n]["rows"]] for n in runs},
        "reports": [r.get("report") for r in chunk_rows],
        "counters": {n: {k.removeprefix("vllm:contextkit_"): v
                         for k, v in runs[n].get("metrics", {}).items()
                         if "chunk" in k or "reuse_" in k}
                     for n in runs if n.startswith("connector")},
        "interleaved": bool(raw.get("interleaved")),
        "not_run": raw.get("errors", {}),
        "sizes": raw.get("sizes"),
        "workload": raw.get("workload"),
        "machine": machine_info(),
        "load_after": raw.get("loadavg_1min"),
        "model": "packaged SmolLM2-135M-Instruct (float32)" if not args.model else args.model,
        "method": "every server up, each step sent to each configuration in turn, one "
                  "transcript (the full prefill's replies); TTFT = a one-token "
                  "/v1/completions request, client side; figures over the turns where "
                  "connector_chunks reused chunks; quality teacher-forced against full; "
                  "oracle: the tenant's known spans warmed untimed as a prefix, the new "
                  "tokens after them",
    }
    table: list[tuple[str, Any]] = [
        (f"ttft p50 {n} (ms)", v) for n, v in p50.items()]
    table += [(f"tokens computed {n}", c) for n, c in computed.items()]
    table += [(k, _met(result.get(k), goal)) for k, goal in GOALS.items()]
    table += [("bound_chunks_vs_prefix_p50 (oracle)", result["bound_chunks_vs_prefix_p50"]),
              ("ceiling_fraction (oracle / chunk reuse)", result["ceiling_fraction"]),
              ("speedup_vs_apc_p50", result["speedup_vs_apc_p50"]),
              ("speedup_vs_prefix_ceiling_p50", result["speedup_vs_prefix_ceiling_p50"]),
              ("prefix only: agreement / ppl ratio / KL",
               None if q_prefix is None else
               f"{q_prefix['teacher_forced_agreement']} / {q_prefix['ppl_ratio']} / "
               f"{q_prefix['mean_kl']}")]
    print_table(f"RAG agent, {len(turns)} chunk turns of {len(chunk_rows)} steps", table)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    configs = the_configs(args.configs, CONFIGS)
    cmd = ["--agents", str(args.agents), "--tenants", str(args.tenants),
           "--steps", str(args.steps), "--docs", str(args.docs), "--seed", str(args.seed),
           "--max-tokens", str(args.max_tokens), "--kv-agents", str(args.kv_agents),
           "--quality-turns", str(args.quality_turns),
           "--quality-tokens", str(args.quality_tokens), "--configs", ",".join(configs)]
    if args.ingest:
        cmd.append("--ingest")
    cmd += ["--repair-first", str(args.repair_first), "--repair-ratio", str(args.repair_ratio),
            "--seam-lead", str(args.seam_lead)]
    return result_of(args, drive("integrations.vllm.bench.chunks_bench", cmd, args,
                                 "chunks-vllm"))
