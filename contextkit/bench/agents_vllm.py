"""Many agents on one vLLM server whose KV space holds about two of them.

Runs inside the vLLM virtualenv (``make test-vllm`` creates ``.venv-vllm``). The
workload is :class:`contextkit.workloads.agents.MultiAgentWorkload` (6 agents of 3
tenants by default, the seeded 36-step schedule with bursts and returning agents),
each agent a ``langchain.agents.create_agent`` over ``ChatOpenAI(streaming=True)``.
Every configuration runs the same schedule on its own fresh server. The servers are up
at once and each step goes to each configuration in turn, the order rotating, after the
machine went quiet (one configuration's background saves are not timed against the
next one's request); the ceiling's replies become every agent's history, so all send
the same prompts (``reply_matches_transcript`` says who answered the same).
``--sequential`` runs them one after another instead, each alone on the machine (every
configuration fits in memory; a slow minute can decide a ratio). The configurations:

- ``apc``: vLLM's prefix caching, each prompt one plain system message in the
  workload's own layer order (``cache_salt`` = the tenant);
- ``ordering``: ``ContextKitMiddleware`` (contextkit's order, labels, the tenant's
  salt) + vLLM's prefix caching, no connector;
- ``connector``: + contextkit's KV connector, DDR byte budget B, the default
  precision policy, semantic eviction, stable prefixes pinned;
- ``connector_lru``: the same B, recency eviction and no pins;
- ``connector_fp16``: the same B with every block fp16 (what the density buys);
- ``connector_all``: the connector with a DDR budget of 8 B, which holds every block
  the schedule saves: what any eviction policy at B reaches at most (the ceiling of
  ``speedup_vs_lru_p50``);
- ``connector_chunks``: the connector with chunk reuse (the pipelines opt in): a
  layer that changed mid-prompt no longer ends the reuse, the sections after it are
  moved in from wherever they were computed and their seams recomputed;
- ``oracle``: chunk reuse's bound: vLLM (room for every agent, no connector) computing
  only the spans the tenant never sent before, placed after the ones it did (those
  warmed untimed into its prefix cache); the model call answered by the oracle
  (:mod:`integrations.vllm.bench.oracle`) from the request contextkit's middleware
  labelled, its TTFT the agent's time up to the call plus the oracle's one-token
  request;
- ``lmcache``: LMCache's multi-process connector (``lmcache server``, L1 in RAM of the
  same B, 32-token chunks = vLLM's block), the plain prompts;
- ``ceiling``: contextkit's order with a KV space that holds every agent.

vLLM's KV space is set with ``--num-gpu-blocks-override`` to about ``--kv-agents``
agents' prompts (mean first-turn prompt, 32-token blocks); B is ``--budget-agents``
agents' prompts in fp16 bytes, given to the connector as ``host_blocks`` of its tq4
key identity, so the budget is the same bytes whatever format each block takes. On a
CPU-only machine vLLM's KV and the connector's DDR tier are both host memory.

TTFT is client-side: ``agent.invoke`` to the first streamed chunk. The speedups are
ratios of per-configuration medians (and sums) over the *warm* steps (an agent's second
and later turns; first turns are cold everywhere); where both sides computed the same
prompt tokens a ratio reads "same tokens" instead. ``bounds`` compares each
configuration's prompt tokens computed with the ceiling's. Quality: after the schedule,
a probe serves a few of the workload's prompts, pushes them out of vLLM's KV with a
filler prompt and reads them back teacher-forced (the ceiling's greedy reply, 16
positions, top-20 logprobs as token ids, plus the forced token's own logprob), float32
throughout: ``teacher_forced_agreement`` (argmax equal), ``ppl_ratio`` (over the forced
tokens) and ``mean_kl`` (KL(ceiling||config) over the ceiling's top 20, a config's
missing entries at its own 20th logprob). A forced token whose own logprob the server
did not return is taken at the 20th logprob (an upper bound: ``ppl_ratio`` is then a
lower bound); ``forced_logprob_assumed`` counts those positions. """

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from contextkit.bench._agents_report import SAME_TOKENS, bounds
from contextkit.bench._common import (
    machine_info,
    positive_float,
    positive_int,
    print_table,
    the_configs,
)
from contextkit.bench.agent_vllm import vllm_installed

__all__ = ["CONFIGS", "HELP", "add_arguments", "add_workload_arguments", "connector_costs", "drive",
           "percentile", "quality", "run", "run_driver", "speedups"]

HELP = ("many LangChain agents on one vLLM server whose KV holds ~2 of them: vLLM APC, "
        "contextkit order, + connector (semantic, LRU, fp16, one that holds everything, "
        "chunk reuse), LMCache, ceiling, chunk reuse's oracle")
#: ``--out`` names a JSON file; the CLI writes the result there with its provenance.
OUT_IS_JSON = True

CONFIGS = ("ceiling", "apc", "ordering", "connector", "connector_lru", "connector_fp16",
           "connector_int8", "connector_tq4", "connector_saves_all_cores",
           "connector_store_volatile", "connector_all", "connector_chunks", "lmcache",
           "lmcache_ordering", "oracle")
#: The default run: what fits side by side in 24 GB (about 3 GiB per vLLM server): the
#: ceiling, vLLM's prefix cache, the connector, recency eviction and the eviction
#: policies' ceiling. Other comparisons are runs of their own, each with its ceiling.
DEFAULT_CONFIGS = ("ceiling", "apc", "connector", "connector_lru", "connector_all")
#: What ``--sequential`` runs by default: every comparison of the issue, one by one.
SEQUENTIAL_CONFIGS = ("ceiling", "apc", "ordering", "connector", "connector_lru",
                      "connector_fp16", "connector_all", "lmcache")
#: The connector configuration the speedups are of, and what each is compared with.
VERSUS = {"apc": "apc", "ordering": "ordering", "lru": "connector_lru",
          "fp16": "connector_fp16", "int8": "connector_int8", "tq4": "connector_tq4",
          "saves_all_cores": "connector_saves_all_cores",
          "store_volatile": "connector_store_volatile",
          "lmcache": "lmcache", "lmcache_ordering": "lmcache_ordering"}


def add_workload_arguments(parser: argparse.ArgumentParser, *, agents: int,
                           steps: int) -> None:
    """The workload and sizing arguments :func:`run_driver` passes to the driver."""
    parser.add_argument("--agents", type=positive_int, default=agents,
                        help=f"agents (default {agents})")
    parser.add_argument("--tenants", type=positive_int, default=3, help="tenants (default 3)")
    parser.add_argument("--steps", type=positive_int, default=steps,
                        help=f"steps of the schedule (default {steps})")
    parser.add_argument("--seed", type=int, default=0, help="schedule seed (default 0)")
    parser.add_argument("--scale", type=positive_float, default=1.0,
                        help="prompt scale (default 1.0: 2.1K-2.8K tokens per agent)")
    parser.add_argument("--max-tokens", type=positive_int, default=16,
                        help="tokens generated per turn (default 16)")
    parser.add_argument("--kv-agents", type=positive_float, default=2.0,
                        help="vLLM's KV space in mean agent prompts (default 2)")
    parser.add_argument("--budget-agents", type=positive_float, default=3.0,
                        help="the DDR byte budget B in agent prompts at fp16 (default 3)")
    parser.add_argument("--model", default=None,
                        help="model directory (default: the packaged SmolLM2, converted)")
    parser.add_argument("--dir", default=None, help="work directory for logs (default: temp)")
    parser.add_argument("--out", default=None,
                        help="also write the JSON result (with its provenance) here")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser, agents=6, steps=36)
    parser.add_argument("--quality-steps", type=positive_int, default=6,
                        help="prompts read back teacher-forced, 16 positions each (default 6)")
    parser.add_argument("--configs", default=None,
                        help=f"comma-separated, from {', '.join(CONFIGS)} (default: "
                             f"{','.join(DEFAULT_CONFIGS)}; with --sequential "
                             f"{','.join(SEQUENTIAL_CONFIGS)}; the ceiling always runs)")
    parser.add_argument("--sequential", action="store_true",
                        help="run the configurations one after another, each alone, instead "
                             "of side by side with the steps interleaved (ratios then carry "
                             "the machine's drift between runs)")
    parser.add_argument("--ceiling-last", action="store_true",
                        help="with --sequential: run the ceiling again after the others and "
                             "report the drift between its two runs (ceiling_drift); the "
                             "ceiling's figures stay its first run's")
    parser.add_argument("--plot", default=None, help="write the TTFT-per-step plot (PNG) here")


# ---------------------------------------------------------------------- pure figures
def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    at = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[at]


def speedups(ttft: Mapping[str, Sequence[float]], warm: Sequence[bool],
             computed: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The TTFT ratios over the warm steps.

    ``speedup_vs_<x>_p50``: configuration ``x``'s median over the connector's;
    ``ceiling_fraction``: the ceiling's over the connector's (``ceiling_fraction_total``:
    the same over summed TTFT); ``bound_vs_<x>_p50``: ``x``'s over the ceiling's, the
    most a connector as fast as a KV space holding everyone reaches against ``x``;
    ``eviction_bound_vs_lru_p50``: connector_lru's over connector_all's, the most any
    eviction policy at the same budget reaches against recency
    (``eviction_ceiling_fraction``: connector_all's over the connector's);
    ``speedup_vs_lru_total`` and ``eviction_bound_vs_lru_total``: the same over summed
    TTFT. The ceiling is its own run only; a second run (``ceiling_last``) is reported
    as ``ceiling_drift`` (its median over the first's), never taken in its place.

    ``computed``: prompt tokens each configuration computed. Where the two sides of a
    ratio computed the same tokens, the ratio is :data:`SAME_TOKENS` instead: its
    timing difference is noise. A configuration that did not run gives ``None``.
    """
    def warm_values(name: str) -> list[float]:
        return [t for t, w in zip(ttft.get(name, ()), warm, strict=False) if w]

    def p50(name: str) -> float | None:
        values = warm_values(name)
        return statistics.median(values) if values else None

    def total(name: str) -> float | None:
        values = warm_values(name)
        return sum(values) if values else None

    def ratio(num: str, den: str, of: Any = p50) -> float | str | None:
        a, b = of(num), of(den)
        if a is None or not b:
            return None
        if computed is not None and num in computed and computed.get(num) == computed.get(den):
            return SAME_TOKENS
        return round(a / b, 3)

    out: dict[str, Any] = {}
    for key, name in VERSUS.items():
        out[f"speedup_vs_{key}_p50"] = ratio(name, "connector")
    out["ceiling_fraction"] = ratio("ceiling", "connector")
    out["ceiling_fraction_total"] = ratio("ceiling", "connector", total)
    for key, name in VERSUS.items():
        out[f"bound_vs_{key}_p50"] = ratio(name, "ceiling")
    first, again = p50("ceiling"), p50("ceiling_last")
    out["ceiling_drift"] = round(again / first, 3) if first and again is not None else None
    # the eviction policy's own ceiling: the same connector with a DDR tier that
    # holds everything (loads cost what they cost; only what is kept differs)
    out["eviction_bound_vs_lru_p50"] = ratio("connector_lru", "connector_all")
    out["eviction_ceiling_fraction"] = ratio("connector_all", "connector")
    # the same over the warm steps' total time: the median hides the few steps where
    # what an eviction policy kept decides (a returning agent), the total does not
    out["speedup_vs_lru_total"] = ratio("connector_lru", "connector", total)
    out["eviction_bound_vs_lru_total"] = ratio("connector_lru", "connector_all", total)
    return out


def quality(reference: Sequence[Sequence[Mapping[str, float]]],
            probe: Sequence[Sequence[Mapping[str, float]]],
            forced: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Teacher-forced agreement, perplexity ratio and mean KL of ``probe``'s top-20
    next-token logprobs against ``reference``'s at the same forced positions."""
    agree = total = assumed = 0
    nll_ref = nll_probe = kl = 0.0
    for ref_prompt, probe_prompt, tokens in zip(reference, probe, forced, strict=True):
        for ref, got, token in zip(ref_prompt, probe_prompt, tokens, strict=True):
            floor = _twentieth(got)  # the forced token's own logprob may rank lower
            total += 1
            agree += max(ref, key=lambda t: ref[t]) == max(got, key=lambda t: got[t])
            key = str(token)
            assumed += key not in ref or key not in got
            nll_ref -= ref.get(key, _twentieth(ref))
            nll_probe -= got.get(key, floor)
            kl += sum(math.exp(lp) * (lp - got.get(t, floor)) for t, lp in ref.items())
    if not total:
        return {"teacher_forced_agreement": None, "ppl_ratio": None, "mean_kl": None}
    return {"teacher_forced_agreement": round(agree / total, 4),
            "ppl_ratio": round(math.exp((nll_probe - nll_ref) / total), 4),
            "mean_kl": round(max(0.0, kl / total), 5), "positions": total,
            "forced_logprob_assumed": assumed}


def _twentieth(logprobs: Mapping[str, float]) -> float:
    """The 20th-highest logprob (the lowest of fewer): what a token outside the top 20
    is taken at when its own logprob is missing."""
    return sorted(logprobs.values(), reverse=True)[:20][-1]


def _step_stats(config: Mapping[str, Any], *, probe: bool = False
                ) -> list[Mapping[str, Any]]:
    """The connector's per-request records of the schedule's steps (``probe``: of the
    quality probe after them), the server's warm-up requests dropped."""
    stats = config.get("connector_stats") or []
    skip = int(config.get("warmup_requests") or 0)
    steps = len(config["rows"])
    return list(stats[skip + steps:] if probe else stats[skip:skip + steps])


def _hits(config: Mapping[str, Any]) -> dict[str, int]:
    """Prompt tokens served per tier over the schedule: vLLM's own cache, the
    connector's DDR tier, the shadow (read at startup only: 0 per request), chunks moved
    in; computed counts the tokens the connector computed for chunk reuse too."""
    rows = config["rows"]
    cached = sum(r.get("cached_tokens") or 0 for r in rows)
    stats = _step_stats(config)
    ddr = sum(s.get("external_hit_tokens") or 0 for s in stats)
    chunk = sum(s.get("chunk_reused_tokens") or 0 for s in stats)
    repaired = sum(s.get("chunk_computed_tokens") or 0 for s in stats)
    external = config.get("metrics", {})
    if not stats and config.get("lmcache"):
        ddr = int(external.get("vllm:external_prefix_cache_hits_total", 0)
                  or external.get("vllm:external_prefix_cache_hits", 0))
    return {"vllm": cached - ddr - chunk - repaired, "ddr": ddr, "shadow": 0, "chunk": chunk,
            "computed": repaired + sum((r.get("prompt_tokens") or 0)
                                       - (r.get("cached_tokens") or 0) for r in rows)}


def _chunk_figures(ttft: Mapping[str, Sequence[float]], warm: Sequence[bool],
                   computed: Mapping[str, int], runs: Mapping[str, Any]) -> dict[str, Any]:
    """``connector_chunks`` against the others: warm-step TTFT medians' ratios (the
    other's over chunk reuse's), over all warm steps and over those where chunks were
    moved in, and the tokens each computed. With the ``oracle`` in the run,
    ``<steps>_bound_vs_<x>_p50`` is ``x``'s median over the oracle's (the most chunk
    reuse reaches against ``x``) and ``<steps>_speedup_vs_oracle_p50`` the share of it
    reached (the oracle's median over chunk reuse's)."""
    stats = _step_stats(runs["connector_chunks"])
    moved = [bool(s.get("chunk_reused_tokens")) for s in stats]
    out: dict[str, Any] = {"computed_tokens": dict(computed),
                           "chunk_reused_tokens": sum(s.get("chunk_reused_tokens") or 0
                                                      for s in stats),
                           "chunk_steps": sum(moved)}
    for label, mask in (("warm", warm), ("chunk_steps", [
            w and m for w, m in zip(warm, moved + [False] * len(warm), strict=False)])):
        def p50(name: str, mask: Sequence[bool] = mask) -> float | None:
            values = [t for t, w in zip(ttft.get(name, ()), mask, strict=False) if w]
            return statistics.median(values) if values else None

        mine, bound = p50("connector_chunks"), p50("oracle")
        for other in ("apc", "connector", "ceiling", "lmcache", "oracle"):
            theirs = p50(other)
            out[f"{label}_speedup_vs_{other}_p50"] = (round(theirs / mine, 3)
                                                      if theirs and mine else None)
        for other in ("apc", "connector"):
            theirs = p50(other)
            out[f"{label}_bound_vs_{other}_p50"] = (round(theirs / bound, 3)
                                                    if theirs and bound else None)
    return out


def _ratio_of(runs: Mapping[str, Any], num: str, den: str) -> float | None:
    """Prompt tokens ``num`` computed over those ``den`` computed: the speedup the
    workload allows if TTFT were proportional to computed tokens."""
    if num not in runs or den not in runs:
        return None
    a, b = _hits(runs[num])["computed"], _hits(runs[den])["computed"]
    return round(a / b, 3) if b else None


def connector_costs(metrics: Mapping[str, float], steps: int) -> dict[str, Any] | None:
    """What a connector configuration's loads and saves cost over the schedule, from
    its ``vllm:contextkit_*`` counters: ms per step the forward waited on loads, ms per
    loaded block, ms per step spent storing (a background thread beside the forward),
    blocks saved, evicted, and skipped (volatile tails not stored for want of room).
    None without a connector."""
    def total(name: str) -> float | None:
        return metrics.get(f"vllm:contextkit_{name}_total")

    load, save, loaded = total("load_seconds"), total("save_seconds"), total("loaded_blocks")
    if load is None and loaded is None:
        return None
    return {"load_ms_per_step": round(1000 * load / steps, 1) if load is not None else None,
            "load_ms_per_block": (round(1000 * load / loaded, 3)
                                  if load is not None and loaded else None),
            "save_ms_per_step": round(1000 * save / steps, 1) if save is not None else None,
            "saved_blocks": total("saved_blocks"), "evicted_blocks": total("evicted_blocks"),
            "skipped_blocks": total("skipped_blocks"), "loaded_blocks": loaded}


def _plot(path: Path, ttft: Mapping[str, Sequence[float]], warm: Sequence[bool],
          title: str) -> None:
    from contextkit.config import require

    matplotlib = require("matplotlib", "plot")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), width_ratios=[3, 1])
    for name, values in ttft.items():
        ax.plot(range(len(values)), values, marker="o", markersize=3, linewidth=1,
                label=name)
    ax.set_yscale("log")
    ax.set_xlabel("step (agents in the seeded schedule)")
    ax.set_ylabel("TTFT (ms, log)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    names = list(ttft)
    medians = [statistics.median([t for t, w in zip(ttft[n], warm, strict=False) if w])
               for n in names]
    bx.barh(names, medians, color="tab:blue")
    bx.invert_yaxis()
    bx.set_xlabel("warm-step TTFT p50 (ms)")
    bx.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> dict[str, Any]:
    given = args.configs or ",".join(SEQUENTIAL_CONFIGS if args.sequential
                                     else DEFAULT_CONFIGS)
    if args.ceiling_last and not args.sequential:
        raise SystemExit("--ceiling-last measures the drift between back-to-back runs: add "
                         "--sequential (side by side, the steps interleave and need no "
                         "drift check)")
    configs = the_configs(given, CONFIGS)
    if args.plot and not str(args.plot).endswith(".png"):
        raise SystemExit(f"--plot writes a PNG: give a path ending in .png, got {args.plot}")
    return result_of(args, run_driver(args, configs, "agents-vllm"))


def run_driver(args: argparse.Namespace, configs: Sequence[str], bench: str,
               extra: Sequence[str] = ()) -> dict[str, Any]:
    """Run the driver (:mod:`integrations.vllm.bench.agents_bench`) in a child process
    with ``args``' workload and sizes and ``configs``; its raw result. ``extra``: more
    driver arguments."""
    if importlib.util.find_spec("langchain_openai") is None:
        raise SystemExit(f"contextkit bench {bench} runs inside the vLLM virtualenv: "
                         f"`make test-vllm` creates .venv-vllm, then `make bench-{bench}`")
    cmd = ["--agents", str(args.agents), "--tenants", str(args.tenants),
           "--steps", str(args.steps), "--seed", str(args.seed), "--scale", str(args.scale),
           "--max-tokens", str(args.max_tokens), "--kv-agents", str(args.kv_agents),
           "--budget-agents", str(args.budget_agents),
           "--quality-steps", str(args.quality_steps), "--configs", ",".join(configs),
           *extra]
    if getattr(args, "ceiling_last", False):
        cmd.append("--ceiling-last")
    if getattr(args, "sequential", False):
        cmd.append("--sequential")
    return drive("integrations.vllm.bench.agents_bench", cmd, args, bench)


def drive(module: str, argv: Sequence[str], args: argparse.Namespace, bench: str
          ) -> dict[str, Any]:
    """Run a bench's driver module in a child process of this interpreter (the vLLM
    virtualenv) with ``argv`` (and ``--model`` from ``args``), in ``args.dir`` or a
    temporary work directory; its raw result (``--out``)."""
    if not vllm_installed():
        raise SystemExit(f"contextkit bench {bench} runs inside the vLLM virtualenv: "
                         f"`make test-vllm` creates .venv-vllm, then `make bench-{bench}`")
    work = Path(args.dir or tempfile.mkdtemp(prefix=f"ck-bench-{bench}-"))
    work.mkdir(parents=True, exist_ok=True)
    raw_path = work / "raw.json"
    cmd = [sys.executable, "-m", module, "--out", str(raw_path), "--dir", str(work), *argv]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.run(cmd, stdout=sys.stderr, check=False)
    if proc.returncode:
        raise SystemExit(f"bench {bench}: the driver failed ({proc.returncode}); see the "
                         f"output above and the server logs in {work}")
    return dict(json.loads(raw_path.read_text()))


def result_of(args: argparse.Namespace, raw: dict[str, Any]) -> dict[str, Any]:
    """The bench's figures from the driver's raw rows."""
    runs: dict[str, Any] = raw["configs"]
    names = [c for c in (*CONFIGS, "ceiling_last") if c in runs]
    first = runs[names[0]]["rows"]
    warm = [r["agent_turn"] >= 1 for r in first]
    ttft = {n: [r["ttft_ms"] for r in runs[n]["rows"]] for n in names}
    hits = {n: _hits(runs[n]) for n in names}
    computed = {n: h["computed"] for n, h in hits.items()}
    result: dict[str, Any] = {"bench": "agents-vllm", **speedups(ttft, warm, computed)}
    baseline = next((n for n in ("connector_lru", "apc") if n in runs), names[0])
    if "ceiling" in runs:
        warm_total = {n: sum(t for t, w in zip(ttft[n], warm, strict=True) if w)
                      for n in names}
        result["bounds"] = bounds({n: c for n, c in computed.items() if n != "ceiling_last"},
                                  warm_total, ceiling="ceiling", baseline=baseline)
    for n in names:
        values = ttft[n]
        warm_values = [t for t, w in zip(values, warm, strict=True) if w]
        result[f"{n}_ttft_p50"] = statistics.median(values)
        result[f"{n}_ttft_p95"] = percentile(values, 0.95)
        result[f"{n}_warm_ttft_p50"] = statistics.median(warm_values) if warm_values else None
    reference = (runs.get("ceiling") or {}).get("probe")
    qualities = {}
    for n in names:
        probe = runs[n].get("probe")
        if n.startswith("ceiling") or not probe or not reference:
            continue
        qualities[n] = quality(reference["tops"], probe["tops"], reference["forced"])
        qualities[n]["probe_connector_hit_tokens"] = sum(
            s.get("external_hit_tokens") or 0 for s in _step_stats(runs[n], probe=True))
    if "connector_chunks" in runs:
        result["chunks"] = _chunk_figures(ttft, warm, computed, runs)
        result["chunks"]["quality"] = qualities.get("connector_chunks")
    main = qualities.get("connector", {})
    costs = {n: connector_costs(runs[n].get("metrics", {}), len(runs[n]["rows"]))
             for n in names}
    result.update({k: main.get(k) for k in ("teacher_forced_agreement", "ppl_ratio",
                                            "mean_kl")})
    result.update({
        "quality": qualities,
        "hit_tokens": hits,
        "ttft_ms": ttft,
        "warm_steps": warm,
        "prompt_tokens": {n: [r["prompt_tokens"] for r in runs[n]["rows"]] for n in names},
        "cached_tokens": {n: [r["cached_tokens"] for r in runs[n]["rows"]] for n in names},
        "connector_metrics": {n: {k: v for k, v in runs[n].get("metrics", {}).items()
                                  if k.startswith("vllm:contextkit_")} for n in names},
        "connector_costs": {n: c for n, c in costs.items() if c is not None},
        "not_run": raw.get("errors", {}),
        "order": raw.get("order"),
        "interleaved": bool(raw.get("interleaved")),
        "replies_matching_transcript": {
            n: sum(bool(r.get("reply_matches_transcript")) for r in runs[n]["rows"])
            for n in names if any("reply_matches_transcript" in r for r in runs[n]["rows"])},
        "lru_computed_ratio": _ratio_of(runs, "connector_lru", "connector"),
        "apc_computed_ratio": _ratio_of(runs, "apc", "connector"),
        "sizes": raw["sizes"],
        "sizing": (f"vLLM KV: --num-gpu-blocks-override {raw['sizes']['kv_blocks_pressure']} "
                   f"blocks of 32 tokens (~{args.kv_agents:g} mean agent prompts of "
                   f"{raw['sizes']['prompt_tokens_mean']} tokens), ceiling "
                   f"{raw['sizes']['kv_blocks_ceiling']}; DDR budget B = "
                   f"{raw['sizes']['budget_bytes']:,} bytes (~{args.budget_agents:g} agent "
                   f"prompts at fp16), connector host_blocks {raw['sizes']['host_blocks']} of "
                   "its tq4 identity; on this CPU-only machine both are host memory"),
        "workload": raw["workload"],
        "server_seconds": {n: runs[n]["seconds"] for n in names},
        "loadavg_1min": {n: runs[n]["loadavg_1min"] for n in names},
        "lmcache": (runs.get("lmcache") or {}).get("lmcache"),
        "model": "packaged SmolLM2-135M-Instruct (float32)" if not args.model else args.model,
        "omp_num_threads": raw.get("omp_num_threads"),
        "machine": machine_info(),
        "method": ("every server up, each step sent to each configuration in turn (the "
                   "order rotating), one transcript; " if raw.get("interleaved") else
                   "one configuration after another, each on its own server; ")
                  + "client-side TTFT (agent.invoke -> first streamed chunk); speedups: "
                  "medians over warm steps (agent_turn >= 1), 'same tokens' where both "
                  "sides computed the same prompt tokens; bounds: prompt tokens computed "
                  "against the ceiling's; quality: teacher-forced probe against the "
                  "ceiling, top-20 logprobs, float32",
    })
    table: list[tuple[str, Any]] = [(f"warm ttft p50 {n} (ms)", result[f"{n}_warm_ttft_p50"])
                                    for n in names]
    table += [(f"speedup_vs_{k}_p50 (bound)",
               f"{result[f'speedup_vs_{k}_p50']} ({result[f'bound_vs_{k}_p50']})")
              for k in VERSUS]
    table += [(k, result[k]) for k in ("eviction_bound_vs_lru_p50", "speedup_vs_lru_total",
                                      "eviction_bound_vs_lru_total", "ceiling_fraction",
                                      "ceiling_fraction_total", "ceiling_drift",
                                      "eviction_ceiling_fraction", "teacher_forced_agreement",
                                      "ppl_ratio", "mean_kl")]
    chunks = result.get("chunks") or {}
    table += [(f"chunk reuse, {steps}: speedup_vs_{x}_p50 (oracle's bound)",
               f"{chunks.get(f'{steps}_speedup_vs_{x}_p50')} "
               f"({chunks.get(f'{steps}_bound_vs_{x}_p50')})")
              for steps in ("warm", "chunk_steps") for x in ("apc", "connector") if chunks]
    table += [(f"{n}: load ms/step, ms/block; save ms/step; saved, skipped blocks",
               f"{c['load_ms_per_step']}, {c['load_ms_per_block']}; {c['save_ms_per_step']}; "
               f"{c.get('saved_blocks')}, {c.get('skipped_blocks')}")
              for n, c in result["connector_costs"].items()]
    print_table(f"{raw['workload']['num_agents']} agents on one vLLM server "
                f"({raw['workload']['num_steps']} steps)", table)
    if args.plot:
        _plot(Path(args.plot), ttft, warm,
              f"{raw['workload']['num_agents']} LangChain agents on one vLLM CPU server, "
              f"KV for ~{args.kv_agents:g}")
        result["plot"] = str(args.plot)
    return result
