"""Agents whose turns alternate between two vLLM replicas: what the shared tier buys.

Runs inside the vLLM virtualenv (``make test-vllm`` creates ``.venv-vllm``, with moto's
S3 server and vllm-router). The driver, :mod:`integrations.vllm.bench.replicas_bench`,
started as a child process by module name, runs the seeded multi-agent schedule
(:class:`contextkit.workloads.agents.MultiAgentWorkload`, LangChain agents) with each
configuration on its own fresh servers, all up at once and each step sent to each
configuration in turn, the order rotating (``--sequential``: one configuration after
another), and writes raw rows; this module turns them into figures. Interleaved, the
first configuration's replies become every agent's history, so every configuration
sends the same prompts (``replies_matching_transcript`` counts who answered the same).
Turn ``k`` of agent ``i`` goes to replica ``(i + k) % 2``, so an agent's every later turn
lands on the other replica than its previous one. Configurations: ``single`` (one
replica serves everything: what one replica reuses), ``apc`` (two replicas, vLLM's prefix
cache alone), ``local`` (+ contextkit's connector, a DDR tier per replica), ``shared``
(+ the shared tier on S3), ``routed`` (``shared`` behind vllm-router) and ``failover``
(``shared`` with replica 1 stopped halfway through the schedule); ``single_chunks`` and
``shared_chunks`` are ``single`` and ``shared`` with chunk reuse (requests opt in);
``oracle`` is chunk reuse's bound: one replica with room for every agent computing only
what the tenant never sent, past its longest known prefix
(:mod:`integrations.vllm.bench.oracle`; its replies are one token, so it never gives
the transcript).

Rows are matched across configurations by their index in the schedule (every
configuration runs the same one); a lost turn (a row with ``error``) has no TTFT and is
left out of every median and sum it would enter. A p50 is the median (the mean of the two
middle values for an even count), a p95 the nearest-rank value. Figures:

- ``{c}_ttft_p50`` / ``{c}_ttft_p95``: TTFT over the steps configuration ``c`` answered;
  ``{c}_ttft_ms``: its TTFT per step, ``None`` where the turn was lost.
- cross-replica steps (``cross_replica_steps``): the indices where ``shared`` (else
  ``shared_chunks``, else ``local``) served an agent's second or later turn on a known
  replica other than the known one of its previous turn; every other configuration is
  read at the same indices.
- ``cross_replica_hit_rate``: on those steps answered by both, the prompt tokens
  ``shared`` reused (vLLM's ``cached_tokens``, which counts what the connector loaded)
  over those ``single`` reused; ``cross_replica_hit_rate_local``: the same for ``local``
  (no shared tier); ``cross_replica_shared_tokens``: the prompt tokens the connector of
  either ``shared`` replica found in the shared tier (its per-request records, warm-up
  requests dropped).
- ``speedup_shared_vs_local_p50`` / ``speedup_shared_vs_apc_p50``: the other
  configuration's median TTFT on the cross-replica steps over ``shared``'s;
  ``ceiling_fraction``: ``single``'s over ``shared``'s (1.0: as fast as one replica);
  ``ceiling_fraction_total``: the same as a ratio of TTFT sums over the steps both
  answered, or "same tokens" where both reused the same prompt tokens there;
  ``first_configuration``: the one whose server started first in the run (slower when
  run back to back); ``interleaved``: whether the steps were interleaved;
  ``bound_shared_vs_local_p50``: ``local``'s over ``single``'s, the most any shared
  tier reaches against ``local`` on these steps (one replica that saw every turn).
- ``routed_vs_shared_p50``: ``shared``'s median TTFT over the warm steps (an agent's
  second and later turns) over ``routed``'s (>= 1: routing at least as fast);
  ``routed_replica_unknown_steps``: routed steps whose replica could not be told.
- ``shared_lag_p50_s`` / ``shared_lag_p95_s``: seconds from a chunk's save to its upload
  in the shared tier, over every upload of ``shared``'s replicas.
- ``shared_tier[c]`` for each configuration with a connector: the replicas' summed
  counters, bytes down / up, GETs, PUTs and HEADs of the shared tier per answered step;
  ``deadline_misses``, ``refused``, ``errors`` (store errors) and ``load_errors`` as
  totals (``failover``'s are the surviving replica's: a stopped server is not scraped).
- with chunk reuse: ``speedup_shared_chunks_vs_local_p50`` and
  ``speedup_shared_chunks_vs_shared_p50`` (the other's median TTFT on the cross-replica
  steps over ``shared_chunks``'), ``ceiling_fraction_chunks`` (``single_chunks``' over
  ``shared_chunks``'), ``bound_shared_chunks_vs_local_p50`` (``local``'s over
  ``single_chunks``': the most a shared tier with chunks reaches against ``local``);
  with the ``oracle``: ``chunk_bound_vs_local_p50`` (``local``'s over the oracle's: the
  most chunk reuse reaches against ``local``) and ``oracle_fraction_chunks`` (the
  oracle's over ``shared_chunks``': the share of it reached);
  ``computed_tokens[c]`` over the schedule: prompt tokens not reused plus those the
  connector computed for chunk reuse (seams, changed spans), and
  ``shared_span_hits[c]``: chunks reused from span objects another replica published.
- ``failover_errors``: the failover run's driver errors; ``failover_lost_turns``: its
  rows without an answer; ``failover_recomputed_tokens_after_stop``: prompt tokens not
  reused (prompt - cached) over its answered steps after replica 1 stopped;
  ``failover_hit_rate_after_stop``: reused over prompt tokens on those of them whose
  agent was last served by replica 1 (moved off the stopped replica).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from contextkit.bench._agents_report import SAME_TOKENS
from contextkit.bench._common import (
    machine_info,
    positive_float,
    positive_int,
    print_table,
)
from contextkit.bench.agent_vllm import vllm_installed
from contextkit.bench.agents_vllm import percentile as _p

__all__ = ["CONFIGS", "HELP", "add_arguments", "result_of", "run"]

HELP = ("agents alternating between two vLLM replicas: APC, a connector per replica, the "
        "shared S3 tier, vllm-router, failover, chunk reuse across replicas, against one "
        "replica")
#: ``--out`` names a JSON file; the CLI writes the result there with its provenance.
OUT_IS_JSON = True

#: The driver's configurations.
CONFIGS = ("single", "apc", "local", "shared", "routed", "failover", "single_chunks",
           "shared_chunks", "oracle")
#: The default run, side by side: what fits in 24 GB (about 3 GiB per vLLM server):
#: one replica (the ceiling), two with local DDR tiers, two sharing the S3 tier.
DEFAULT_CONFIGS = ("single", "local", "shared")
#: Counters per answered step in ``shared_tier`` (metric stem -> figure).
PER_STEP = {"shared_bytes_down": "bytes_down_per_step", "shared_bytes_up": "bytes_up_per_step",
            "shared_gets": "gets_per_step", "shared_puts": "puts_per_step",
            "shared_heads": "heads_per_step",
            # seconds: requests waiting for lookups, the forward waiting for loads
            # (shared GETs and imports included), the save thread
            "shared_lookup_seconds": "lookup_s_per_step", "load_seconds": "load_s_per_step",
            "save_seconds": "save_s_per_step"}
TOTALS = {"shared_deadline_misses": "deadline_misses", "shared_refused": "refused",
          "shared_errors": "errors", "load_errors": "load_errors", "shared_dropped": "dropped",
          "shared_deduplicated": "deduplicated"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--agents", type=positive_int, default=6, help="agents (default 6)")
    parser.add_argument("--tenants", type=positive_int, default=3, help="tenants (default 3)")
    parser.add_argument("--steps", type=positive_int, default=24,
                        help="steps of the schedule (default 24)")
    parser.add_argument("--seed", type=int, default=0, help="schedule seed (default 0)")
    parser.add_argument("--scale", type=positive_float, default=1.0,
                        help="prompt scale (default 1.0)")
    parser.add_argument("--max-tokens", type=positive_int, default=16,
                        help="tokens generated per turn (default 16)")
    parser.add_argument("--kv-agents", type=positive_float, default=2.0,
                        help="each replica's vLLM KV space in mean agent prompts (default 2)")
    parser.add_argument("--budget-agents", type=positive_float, default=3.0,
                        help="each replica's DDR byte budget in agent prompts at fp16 "
                             "(default 3)")
    parser.add_argument("--chunk-blocks", type=positive_int, default=4,
                        help="blocks per shared-tier object (default 4)")
    parser.add_argument("--deadline-s", type=positive_float, default=1.0,
                        help="shared-tier lookup and load deadline in seconds (default 1.0)")
    parser.add_argument("--router", default=None,
                        help="the vllm-router binary (default: vllm-router on PATH, else "
                             "beside this Python)")
    parser.add_argument("--router-policy", default="consistent_hash",
                        help="vllm-router's --policy (default consistent_hash, on the agent's "
                             "session; kv_aware gives salted requests no cache credit)")
    parser.add_argument("--configs", default=None,
                        help=f"comma-separated, from {', '.join(CONFIGS)} (default: "
                             f"{','.join(DEFAULT_CONFIGS)}; with --sequential all)")
    parser.add_argument("--sequential", action="store_true",
                        help="run the configurations one after another, each alone, instead "
                             "of side by side with the steps interleaved (ratios then carry "
                             "the machine's drift between runs)")
    parser.add_argument("--dir", default=None, help="work directory for logs (default: temp)")
    parser.add_argument("--out", default=None,
                        help="also write the JSON result (with its provenance) here")
    parser.add_argument("--plot", default=None, help="write the TTFT-per-step plot (PNG) here")


# ---------------------------------------------------------------------- pure figures
def _answered(row: Mapping[str, Any] | None) -> bool:
    return row is not None and "error" not in row


def _rows(runs: Mapping[str, Any], name: str) -> list[dict[str, Any]]:
    return list((runs.get(name) or {}).get("rows") or [])


def _at(rows: Sequence[Mapping[str, Any]], i: int) -> Mapping[str, Any] | None:
    return rows[i] if i < len(rows) and _answered(rows[i]) else None


def _known(replica: Any) -> bool:
    return isinstance(replica, int) and replica >= 0


def cross_replica_steps(rows: Sequence[Mapping[str, Any]]) -> list[int]:
    """Indices of the answered later turns that a known replica other than the
    (known) previous one served."""
    return [i for i, r in enumerate(rows)
            if _answered(r) and (r.get("agent_turn") or 0) >= 1 and _known(r.get("replica"))
            and _known(r.get("previous_replica")) and r["replica"] != r["previous_replica"]]


def warm_steps(runs: Mapping[str, Any]) -> list[bool]:
    """Per schedule index, whether it is an agent's second or later turn (read from any
    configuration that answered it: the schedules are the same)."""
    length = max((len(_rows(runs, n)) for n in runs), default=0)
    warm = []
    for i in range(length):
        row = next((r for n in runs if (r := _at(_rows(runs, n), i)) is not None), None)
        warm.append(row is not None and (row.get("agent_turn") or 0) >= 1)
    return warm


def _median_ttft(rows: Sequence[Mapping[str, Any]], steps: Sequence[int]) -> float | None:
    values = [r["ttft_ms"] for i in steps if (r := _at(rows, i)) is not None]
    return statistics.median(values) if values else None


def _ratio(num: float | None, den: float | None, digits: int = 3) -> float | None:
    return round(num / den, digits) if num is not None and den else None


def _both(rows: Sequence[Mapping[str, Any]], base: Sequence[Mapping[str, Any]],
          steps: Sequence[int]) -> list[tuple[Mapping[str, Any], Mapping[str, Any]]]:
    return [(a, b) for i in steps if (a := _at(rows, i)) is not None
            and (b := _at(base, i)) is not None]


def ceiling_fraction_total(shared: Sequence[Mapping[str, Any]],
                           single: Sequence[Mapping[str, Any]],
                           steps: Sequence[int]) -> float | str | None:
    """``single``'s summed TTFT over ``shared``'s on the ``steps`` both answered (a ratio
    of sums of the same steps), or :data:`SAME_TOKENS` where both reused the same
    prompt tokens there: any timing difference is then noise."""
    both = _both(shared, single, steps)
    if not both:
        return None
    if sum(a.get("cached_tokens") or 0 for a, _ in both) == sum(
            b.get("cached_tokens") or 0 for _, b in both):
        return SAME_TOKENS
    return _ratio(sum(b["ttft_ms"] for _, b in both), sum(a["ttft_ms"] for a, _ in both))


def _hit_rate(rows: Sequence[Mapping[str, Any]], base: Sequence[Mapping[str, Any]],
              steps: Sequence[int]) -> float | None:
    """Tokens ``rows`` reused over those ``base`` reused, on the steps both answered."""
    both = _both(rows, base, steps)
    if not both:
        return None
    return _ratio(sum(a.get("cached_tokens") or 0 for a, _ in both),
                  sum(b.get("cached_tokens") or 0 for _, b in both), 4)


def _metric_sum(run: Mapping[str, Any], stem: str) -> float | None:
    name = f"vllm:contextkit_{stem}_total"
    values = [m[name] for m in run.get("metrics") or [] if name in m]
    return sum(values) if values else None


def shared_tier(run: Mapping[str, Any]) -> dict[str, Any] | None:
    """The shared tier's traffic per answered step and its failure counts (the
    replicas' counters summed); None without a connector."""
    if not any(k.startswith("vllm:contextkit_") for m in run.get("metrics") or [] for k in m):
        return None
    steps = sum(_answered(r) for r in run.get("rows") or [])
    out: dict[str, Any] = {}
    for stem, key in PER_STEP.items():
        total = _metric_sum(run, stem)
        out[key] = round(total / steps, 3) if total is not None and steps else None
    out.update({key: _metric_sum(run, stem) for stem, key in TOTALS.items()})
    return out


def computed_tokens(run: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]
                    ) -> int | None:
    """Prompt tokens computed over the schedule: not reused (prompt - cached), plus
    what the connector computed to materialize chunks (vLLM counts those as cached);
    None when a turn was lost (the sums would not compare)."""
    if not rows or not all(_answered(r) for r in rows):
        return None
    total = sum(int(r["prompt_tokens"]) - int(r["cached_tokens"]) for r in rows)
    return total + sum(int(s.get("chunk_computed_tokens") or 0)
                       for per in run.get("connector_stats") or [] for s in per
                       if s.get("tenant") != "warmup")


def chunk_figures(runs: Mapping[str, Any], rows: Mapping[str, Sequence[Mapping[str, Any]]],
                  p50: Mapping[str, float | None]) -> dict[str, Any]:
    """The chunk-reuse figures (see the module's docstring); empty without
    ``shared_chunks``."""
    if "shared_chunks" not in runs:
        return {}
    return {
        "speedup_shared_chunks_vs_local_p50": _ratio(p50.get("local"), p50.get("shared_chunks")),
        "speedup_shared_chunks_vs_shared_p50": _ratio(p50.get("shared"),
                                                      p50.get("shared_chunks")),
        "ceiling_fraction_chunks": _ratio(p50.get("single_chunks"), p50.get("shared_chunks")),
        "bound_shared_chunks_vs_local_p50": _ratio(p50.get("local"), p50.get("single_chunks")),
        "chunk_bound_vs_local_p50": _ratio(p50.get("local"), p50.get("oracle")),
        "oracle_fraction_chunks": _ratio(p50.get("oracle"), p50.get("shared_chunks")),
        "computed_tokens": {n: computed_tokens(runs[n], rows[n]) for n in rows},
        "shared_span_hits": {n: _metric_sum(runs[n], "shared_span_hits") for n in rows
                             if runs[n].get("metrics")},
    }


def failover(run: Mapping[str, Any] | None) -> dict[str, Any]:
    """Lost turns and what was recomputed after replica 1 stopped."""
    if not run:
        return {k: None for k in ("failover_errors", "failover_lost_turns",
                                  "failover_recomputed_tokens_after_stop",
                                  "failover_hit_rate_after_stop")}
    rows = run.get("rows") or []
    after = [r for r in rows if _answered(r) and r.get("after_stop")]
    moved = [r for r in after if r.get("previous_replica") == 1]
    prompt = sum(r.get("prompt_tokens") or 0 for r in moved)
    return {"failover_errors": len(run.get("errors") or []),
            "failover_lost_turns": sum(not _answered(r) for r in rows),
            "failover_recomputed_tokens_after_stop": sum(
                (r.get("prompt_tokens") or 0) - (r.get("cached_tokens") or 0) for r in after),
            "failover_hit_rate_after_stop": (
                round(sum(r.get("cached_tokens") or 0 for r in moved) / prompt, 4)
                if prompt else None)}


def _plot(path: Path, ttft: Mapping[str, Sequence[float | None]], cross: Sequence[int],
          stop: int | None, title: str) -> None:
    from contextkit.config import require

    matplotlib = require("matplotlib", "plot")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    for name, values in ttft.items():
        ys = [float("nan") if v is None else v for v in values]
        ax.plot(range(len(ys)), ys, marker="o", markersize=3, linewidth=1, label=name)
    for i in cross:
        ax.axvspan(i - 0.4, i + 0.4, color="tab:gray", alpha=0.12, linewidth=0)
    if stop is not None:
        ax.axvline(stop - 0.5, color="tab:red", linestyle="--", linewidth=1,
                   label="failover: replica 1 stops")
    ax.set_yscale("log")
    ax.set_xlabel("step of the seeded schedule (shaded: cross-replica steps)")
    ax.set_ylabel("TTFT (ms, log)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> dict[str, Any]:
    given = args.configs or ",".join(CONFIGS if args.sequential else DEFAULT_CONFIGS)
    configs = [c.strip() for c in given.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown or not configs:
        raise SystemExit(f"unknown --configs {', '.join(unknown) or '(none given)'}; pick "
                         f"from {', '.join(CONFIGS)}")
    if args.plot and not str(args.plot).endswith(".png"):
        raise SystemExit(f"--plot writes a PNG: give a path ending in .png, got {args.plot}")
    needs = ["langchain_openai"] + (["moto"] if {"shared", "routed", "failover",
                                                 "shared_chunks"} & set(configs) else [])
    if not vllm_installed() or any(importlib.util.find_spec(m) is None for m in needs):
        raise SystemExit("contextkit bench replicas runs inside the vLLM virtualenv: "
                         "`make test-vllm` creates .venv-vllm, then `make bench-replicas`")
    work = Path(args.dir or tempfile.mkdtemp(prefix="ck-bench-replicas-"))
    work.mkdir(parents=True, exist_ok=True)
    raw_path = work / "raw.json"
    cmd = [sys.executable, "-m", "integrations.vllm.bench.replicas_bench",
           "--out", str(raw_path), "--dir", str(work), "--agents", str(args.agents),
           "--tenants", str(args.tenants), "--steps", str(args.steps), "--seed", str(args.seed),
           "--scale", str(args.scale), "--max-tokens", str(args.max_tokens),
           "--kv-agents", str(args.kv_agents), "--budget-agents", str(args.budget_agents),
           "--chunk-blocks", str(args.chunk_blocks), "--deadline-s", str(args.deadline_s),
           "--router-policy", str(args.router_policy), "--configs", ",".join(configs)]
    if args.router:  # else the driver's default: on PATH, else beside its Python
        cmd += ["--router", str(args.router)]
    if args.sequential:
        cmd.append("--sequential")
    proc = subprocess.run(cmd, stdout=sys.stderr, check=False)
    if proc.returncode or not raw_path.is_file():
        raise SystemExit(f"bench replicas: the driver failed ({proc.returncode}); see the "
                         f"output above and the server logs in {work}")
    return result_of(args, json.loads(raw_path.read_text()))


def result_of(args: argparse.Namespace, raw: dict[str, Any]) -> dict[str, Any]:
    """The bench's figures from the driver's raw rows (see the module docstring)."""
    runs: dict[str, Any] = raw["configs"]
    names = [c for c in CONFIGS if c in runs]
    rows = {n: _rows(runs, n) for n in names}
    ttft = {n: [r["ttft_ms"] if _answered(r) else None for r in rows[n]] for n in names}
    result: dict[str, Any] = {"bench": "replicas"}
    for n in names:
        values = [t for t in ttft[n] if t is not None]
        result[f"{n}_ttft_p50"] = statistics.median(values) if values else None
        result[f"{n}_ttft_p95"] = _p(values, 0.95)
        result[f"{n}_ttft_ms"] = ttft[n]
    shared, single, local = rows.get("shared", []), rows.get("single", []), rows.get("local", [])
    # the schedule decides the replicas: any two-replica lane that is not routed tells
    cross = cross_replica_steps(shared or rows.get("shared_chunks") or local)
    warm = warm_steps({n: runs[n] for n in names})
    warm_idx = [i for i, w in enumerate(warm) if w]
    p50 = {n: _median_ttft(rows[n], cross) for n in names}
    routed = rows.get("routed", [])
    shared_run = runs.get("shared") or {}
    lags = [u["lag_s"] for per in shared_run.get("uploads") or [] for u in per
            if u.get("lag_s") is not None]
    result.update({
        "cross_replica_steps": cross,
        "warm_steps": warm,
        "cross_replica_hit_rate": _hit_rate(shared, single, cross),
        "cross_replica_hit_rate_local": _hit_rate(local, single, cross),
        "cross_replica_shared_tokens": (
            sum(s.get("shared_hit_tokens") or 0 for per in shared_run["connector_stats"] or []
                for s in per if s.get("tenant") != "warmup")
            if shared_run.get("connector_stats") is not None else None),
        "speedup_shared_vs_local_p50": _ratio(p50.get("local"), p50.get("shared")),
        "speedup_shared_vs_apc_p50": _ratio(p50.get("apc"), p50.get("shared")),
        "ceiling_fraction": _ratio(p50.get("single"), p50.get("shared")),
        "ceiling_fraction_total": ceiling_fraction_total(shared, single, cross),
        # back to back, a run's first server lifetime is slow (cold OS caches): a ratio
        # against it is not a bound; interleaved, every step pays that alike
        "first_configuration": (raw.get("order") or [None])[0],
        "interleaved": bool(raw.get("interleaved")),
        "replies_matching_transcript": {
            n: sum(bool(r.get("reply_matches_transcript")) for r in rows[n])
            for n in names if any("reply_matches_transcript" in r for r in rows[n])},
        # the most any shared tier reaches against local on these steps: one replica
        # that saw every turn (single) over local
        "bound_shared_vs_local_p50": _ratio(p50.get("local"), p50.get("single")),
        "routed_vs_shared_p50": _ratio(_median_ttft(shared, warm_idx),
                                       _median_ttft(routed, warm_idx)),
        "routed_replica_unknown_steps": (sum(_answered(r) and not _known(r.get("replica"))
                                             for r in routed) if "routed" in runs else None),
        "shared_lag_p50_s": statistics.median(lags) if lags else None,
        "shared_lag_p95_s": _p(lags, 0.95),
        # tenant probe: probe-a's prompt on replica 0, then probe-b's identical one on
        # replica 1 must share 0 tokens (probe-a's own on replica 1 shows the tier works)
        "tenant_probe": shared_run.get("tenant_probe"),
        **failover(runs.get("failover")),
        **chunk_figures(runs, rows, p50),
        "shared_tier": {n: c for n in names if (c := shared_tier(runs[n])) is not None},
        "lost_turns": {n: sum(not _answered(r) for r in rows[n]) for n in names},
        "errors": raw.get("errors", {}),
        "order": raw.get("order"),
        "sizes": raw.get("sizes"),
        "workload": raw.get("workload"),
        "chunk_blocks": raw.get("chunk_blocks"),
        "deadline_s": raw.get("deadline_s"),
        "router_policy": raw.get("router_policy"),
        "router": (runs.get("routed") or {}).get("router"),
        "server_start_s": {n: runs[n].get("server_start_s") for n in names},
        "server_seconds": {n: runs[n].get("seconds") for n in names},
        "loadavg_1min": {n: runs[n].get("loadavg_1min") for n in names},
        "machine": machine_info(),
        "method": ("every configuration's servers up, each step sent to each in turn (the "
                   "order rotating), one transcript; " if raw.get("interleaved") else
                   "one configuration after another, each on its own servers; ")
                  + "client-side TTFT (agent.invoke -> first streamed chunk); turn k of agent "
                  "i on replica (i + k) % 2; rows matched by schedule index; medians over "
                  "the cross-replica steps (routing: over the warm steps)",
    })
    table: list[tuple[str, Any]] = [(f"ttft p50 / p95 {n} (ms)",
                                     f"{result[f'{n}_ttft_p50']} / {result[f'{n}_ttft_p95']}")
                                    for n in names]
    table += [(k, result[k]) for k in (
        "cross_replica_hit_rate", "cross_replica_hit_rate_local", "cross_replica_shared_tokens",
        "speedup_shared_vs_local_p50", "speedup_shared_vs_apc_p50", "ceiling_fraction",
        "ceiling_fraction_total", "first_configuration",
        "bound_shared_vs_local_p50", "routed_vs_shared_p50", "routed_replica_unknown_steps",
        "shared_lag_p50_s", "shared_lag_p95_s", "failover_errors", "failover_lost_turns",
        "failover_recomputed_tokens_after_stop", "failover_hit_rate_after_stop",
        "speedup_shared_chunks_vs_local_p50", "speedup_shared_chunks_vs_shared_p50",
        "ceiling_fraction_chunks", "bound_shared_chunks_vs_local_p50",
        "chunk_bound_vs_local_p50", "oracle_fraction_chunks", "computed_tokens",
        "shared_span_hits") if k in result]
    table += [(f"{n}: down/up bytes, gets/puts/heads per step; misses, refused", (
        f"{c['bytes_down_per_step']}/{c['bytes_up_per_step']}, {c['gets_per_step']}/"
        f"{c['puts_per_step']}/{c['heads_per_step']}; {c['deadline_misses']}, {c['refused']}"))
        for n, c in result["shared_tier"].items()]
    table += [(f"did not run: {n}", msg.splitlines()[0][:80] if msg else msg)
              for n, msg in result["errors"].items()]
    workload = raw.get("workload") or {}
    print_table(f"{workload.get('num_agents', '?')} agents on two vLLM replicas "
                f"({workload.get('num_steps', len(warm))} steps, "
                f"{len(cross)} cross-replica)", table)
    if args.plot:
        stop = next((i for i, r in enumerate(rows.get("failover", []))
                     if _answered(r) and r.get("after_stop")), None)
        _plot(Path(args.plot), ttft, cross, stop,
              f"{workload.get('num_agents', '?')} LangChain agents alternating between two "
              "vLLM CPU replicas")
        result["plot"] = str(args.plot)
    return result
