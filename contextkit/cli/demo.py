"""``contextkit demo``: the main job on embedded defaults.

An SRE agent (the deterministic replay of :mod:`contextkit.workloads.replay`) talks to the
packaged SmolLM2 for several turns. Its ~6K-token, ten-layer system prompt goes
through :class:`~contextkit.pipeline.pipeline.CacheAwareContextPipeline` onto the TQ4 cache;
its memories layer comes from a :class:`memory_graph.MemoryGraph` in SQLite; the
cache is shadowed to a local directory, so a second run starts warm. Every turn is
also served by a full prefill without any cache, and the demo prints and plots both
TTFTs, with contextkit's decode tokens/s beside them (per turn and the median).
Between turns (a think time of ``--think-s``) the pipeline prefills in the background
the next turn's prompt and, for the memory neighborhoods the conversation is heading
to (predicted from the conversation so far and the graph), reserves and prefills their
KV in the host tier; the summary counts the reservations made, hit and expired.

Then a short multi-agent run (:class:`contextkit.workloads.agents.MultiAgentWorkload`: 6 agents
of 3 tenants taking turns on one engine whose device tier holds 2 of their prompts and
whose host tier holds 1, so the policy decides what is computed again): a
:class:`~contextkit.loop.tiers.ContextTierManager` knows every agent's blocks and who is
due next, and before each turn prefetches the blocks that turn reuses from the host tier
and makes its room from the blocks nobody is due to read and the lowest priorities. The
same steps run on LRU and on a cache that holds every agent (the ceiling), and the
summary says what the policy bought in prompt tokens computed and in TTFT
(``contextkit bench agents`` measures this at scale).

Outputs under ``--out``: ``demo.json`` (per-turn records and summary, the multi-agent
steps under ``agents``), ``ttft.png`` (TTFT per turn), ``agents.png`` (TTFT and tier
occupancy per multi-agent step) and ``memory.db`` (the graph). The shadow goes to ``--store``
(default: the same store ``contextkit status`` and ``contextkit recover`` read).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from contextkit.config.settings import WEIGHT_FORMATS

__all__ = ["SESSION_ID", "add_demo_arguments", "run_demo"]

SESSION_ID = "contextkit-demo"
#: agents and tenants of the demo's multi-agent run, and the size of their prompts: more
#: agents than the tiers hold, so the eviction policy decides what is computed again
AGENTS, TENANTS, AGENT_SCALE = 6, 3, 0.3


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--turns", type=int, default=6,
                        help="replay turns (default 6: the whole demo took ~2.5 minutes on 2 CPU "
                             "cores; the benchmark runs 20)")
    parser.add_argument("--max-new-tokens", type=int, default=32,
                        help="reply length limit per turn (default 32, greedy)")
    parser.add_argument("--out", default="runs/demo",
                        help="directory for demo.json, ttft.png and memory.db "
                             "(default: runs/demo)")
    parser.add_argument("--store", default=None, metavar="URL",
                        help="shadow store for the cache (default: $CONTEXTKIT_SHADOW_URL or "
                             "file://~/.cache/contextkit/shadow)")
    parser.add_argument("--cold", action="store_true",
                        help="do not restore the previous run's shadow first")
    parser.add_argument("--think-s", type=float, default=30.0,
                        help="think time between turns in seconds, when background prefill "
                             "and memory reservations run (default 30; waits only as long "
                             "as the work takes)")
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default="int8",
                        help="the engine's weight format (default int8: per-channel "
                             "weight-only, a quarter of float32's bytes per decoded token)")
    parser.add_argument("--no-reserve", action="store_true",
                        help="no background prefill or memory reservations between turns")
    parser.add_argument("--agent-steps", type=int, default=2 * AGENTS,
                        help=f"steps of the multi-agent run ({AGENTS} agents, 2 turns each by "
                             "default: about a minute on 2 CPU cores; 0 skips it)")


def _say(message: str) -> None:
    from contextkit.config import require

    tqdm = require("tqdm", "bench").tqdm
    tqdm.write(message, file=sys.stderr)


def run_demo(args: argparse.Namespace) -> int:
    from contextkit.bench.ttft import plot_ttft, run_replay
    from contextkit.engine.engine import Engine
    from contextkit.workloads.replay import AgentReplay
    from gpu_cache import CacheIdentityError
    from memory_graph import MemoryGraph, SentenceTransformerEmbedder
    from shadow import CacheShadow, ShadowConfig, ShadowError, discover_sessions, open_store
    from shadow.cli import check_store_option, default_store_url

    # user errors: one line and exit status 2 (contextkit.cli.commands.run_command)
    if args.turns < 1:
        raise ValueError(f"--turns must be >= 1, got {args.turns}")
    if not args.think_s >= 0:
        raise ValueError(f"--think-s must be >= 0, got {args.think_s}")
    if args.agent_steps and args.agent_steps < 2 * AGENTS:
        raise ValueError(f"--agent-steps must be 0 (skip) or >= {2 * AGENTS} (each of the "
                         f"{AGENTS} agents takes 2 turns), got {args.agent_steps}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store_url = check_store_option(args.store) or default_store_url()

    _say("loading SmolLM2-135M-Instruct (packaged GGUF) and calibrating the TQ4 cache ...")
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(num_device_blocks=768, num_host_blocks=2048,
                                    weight_format=getattr(args, "weights", "int8"))
    _say(f"  ready in {time.perf_counter() - t0:.1f} s; cache identity "
         f"{engine.identity.digest().hex()[:12]}, {engine.cache.bytes_per_block:,} bytes/block")

    _say(f"memory graph: sqlite:///{out / 'memory.db'}")
    graph = MemoryGraph(f"sqlite:///{out / 'memory.db'}",
                        embedder=SentenceTransformerEmbedder())
    added = AgentReplay(args.turns).seed_memory(graph)
    _say(f"  {added} memories seeded" if added else "  memories already seeded")

    store = open_store(store_url)
    shadow = CacheShadow(engine.cache, store, SESSION_ID, config=ShadowConfig(autostart=False))
    recovered: dict[str, Any] = {"blocks": 0}
    if not args.cold and any(s.session_id == SESSION_ID for s in discover_sessions(store)):
        try:
            report = shadow.recover_session()
            recovered = report.to_dict()
            _say(f"restored {recovered['blocks']} blocks of the previous run from {store.url} "
                 f"in {recovered['seconds']:.2f} s (host tier; re-pinned)")
        except (ShadowError, CacheIdentityError) as exc:
            _say(f"previous shadow not restored ({exc}); starting cold")

    _say(f"replaying {args.turns} turns (contextkit vs full prefill per turn) ...")
    header = f"{'turn':>4}  {'prompt':>6}  {'reused':>6}  {'moved':>5}  {'computed':>8}  " \
             f"{'baseline':>9}  {'contextkit':>10}  {'speedup':>7}  {'decode tok/s':>12}  " \
             "broken by"
    _say(header)

    def show(r: dict[str, Any]) -> None:
        tps = r["decode_tps_contextkit"]
        _say(f"{r['turn']:>4}  {r['prompt_tokens']:>6}  {r['reused_tokens']:>6}  "
             f"{r['chunk_reused_tokens']:>5}  {r['computed_tokens']:>8}  "
             f"{r['ttft_ms_baseline'] / 1000:>8.2f}s  "
             f"{r['ttft_ms_contextkit'] / 1000:>9.2f}s  "
             f"{r['ttft_ms_baseline'] / r['ttft_ms_contextkit']:>6.1f}x  "
             f"{'-' if tps is None else f'{tps:.1f}':>12}  "
             f"{r['prefix_broken_by'] or '-'}")

    # The per-turn table is the progress report; a bar would garble it in a log file.
    result = run_replay(turns=args.turns, max_new_tokens=args.max_new_tokens, engine=engine,
                        memory_graph=graph, prefix_cache=False, quality=False, on_turn=show,
                        reserve=not args.no_reserve, think_s=args.think_s, progress=False)
    written = shadow.shadow_now()
    signed = shadow.manifest is not None and shadow.manifest.authenticated
    shadow.close()
    store.close()
    graph.close()
    agents = _agents_run(engine, args.agent_steps, args.max_new_tokens, out) \
        if args.agent_steps else None

    records = result["records"]
    summary = {
        "turns": len(records),
        "speedup_p50": result["speedup_p50"],
        "ttft_ms_baseline_p50": statistics.median(r["ttft_ms_baseline"] for r in records),
        "ttft_ms_contextkit_p50": statistics.median(r["ttft_ms_contextkit"] for r in records),
        "kv_reuse_ratio_p50": statistics.median(r["kv_reuse_ratio"] for r in records),
        "decode_tps_p50": result["decode_tps_p50"],
        "pinned_blocks": result["pinned_blocks"],
        "blocks_per_tier": records[-1]["blocks_per_tier"],
        "recovered_blocks": recovered.get("blocks", 0),
        "reservations": _reservation_summary(result),
        "memory_chunks": result["memory_chunks"],
        "shadow": {"store": store_url, "session": SESSION_ID,
                   "blocks": written.num_blocks, "bytes_written": written.bytes_written,
                   "signed": signed},
    }
    if agents is not None:
        summary["agents"] = agents["summary"]
    (out / "demo.json").write_text(json.dumps({"summary": summary, "records": records,
                                               "volatility": result["volatility"],
                                               "agents": agents["rows"] if agents else [],
                                               "agents_reference":
                                                   agents["reference_rows"] if agents else []},
                                              indent=2, sort_keys=True))
    png = plot_ttft(records, out / "ttft.png",
                    f"contextkit demo: SmolLM2-135M, {records[-1]['prompt_tokens']:,}-token prompt")
    tiers = ", ".join(f"{k} {v}" for k, v in summary["blocks_per_tier"].items())
    sys.stdout.write(
        "\nsummary\n-------\n"
        f"{summary['turns']} turns of a ten-layer agent prompt "
        f"({records[-1]['prompt_tokens']:,} tokens at the last turn).\n"
        f"TTFT median: full prefill {summary['ttft_ms_baseline_p50'] / 1000:.2f} s, contextkit "
        f"{summary['ttft_ms_contextkit_p50'] / 1000:.2f} s; median speedup over turns >= 2 "
        f"{summary['speedup_p50']:.1f}x; median KV reuse {summary['kv_reuse_ratio_p50']:.0%}.\n"
        f"{_first_turn_line(records[0], summary['recovered_blocks'])}\n"
        f"{_decode_line(summary['decode_tps_p50'], args.max_new_tokens)}\n"
        f"Cache: {summary['pinned_blocks']} pinned blocks (the stable prefix); blocks per tier: "
        f"{tiers}. Restored at start: {summary['recovered_blocks']} blocks.\n"
        f"{_reservation_line(summary['reservations'])}\n"
        f"{_memory_chunks_line(summary['memory_chunks'])}\n"
        f"Shadowed {written.num_blocks} blocks to {store_url} (session {SESSION_ID}), "
        f"{_signed_line(signed)}; see `contextkit status`.\n"
        f"Wrote {out / 'demo.json'} and {png}.\n")
    if agents is not None:
        sys.stdout.write(_agents_text(agents["summary"], agents["plot"]))
    return 0


def _memory_chunks_line(ingest: dict[str, Any] | None) -> str:
    """What computing the memories' lines at seeding cost (reused as chunks later)."""
    if not ingest:
        return "Memory lines: computed in the turns that first bring them in."
    return (f"Memory lines: {ingest['lines']} ready when the graph was seeded "
            f"({ingest['computed_tokens']:,} tokens computed, the rest found in the cache; "
            f"{ingest['wall_s']:.1f} s, before turn 1); "
            "turns that bring them in move them in as chunks.")


def _agents_text(a: dict[str, Any], plot: str) -> str:
    """The multi-agent run's summary: against its LRU reference; warms only when any."""
    occupancy = ", ".join(f"{t} {v['used']}/{v['capacity']}" for t, v in a["tiers"].items())
    ref = a["reference"]
    cpu = (" On this CPU-only machine both tiers are host memory: a warm is a copy "
           "between two RAM pools." if a["device"] == "cpu" else "")
    if a["prefetch_warmed_blocks"] or a["host_hit_rate"]:
        moves = (f"prompt tokens served from the device {a['device_hit_rate']:.0%}, brought "
                 f"up from the host {a['host_hit_rate']:.0%}; prefetches warmed "
                 f"{a['prefetch_warmed_blocks']} blocks, spilled "
                 f"{a['prefetch_spilled_blocks']}, archived {a['prefetch_removed_blocks']}")
    else:
        moves = (f"prompt tokens served from the device {a['device_hit_rate']:.0%}; no "
                 "prefetch had to warm a block (each due agent's blocks were already in the "
                 f"device tier), {a['prefetch_spilled_blocks']} spilled, "
                 f"{a['prefetch_removed_blocks']} archived")
    return (
        f"\nMulti-agent: {a['agents']} agents of {a['tenants']} tenants, {a['steps']} steps on "
        f"one cache (device tier {a['device_agents']} agents' prompts, host tier "
        f"{a['host_agents']}).{cpu}\n"
        f"semantic + OODA prefetch: TTFT median {a['ttft_ms_p50'] / 1000:.2f} s, "
        f"{a['computed_tokens']:,} prompt tokens computed; {moves}. {a['prefetches']} "
        f"prefetches (one before each turn, all finished before it began: "
        f"{a['prefetch_before_generate']}); OODA median {a['ooda_ms_p50']:.1f} ms.\n"
        f"LRU reference (recency only, no pins, no prefetch), same steps: TTFT median "
        f"{ref['ttft_ms_p50'] / 1000:.2f} s, {ref['computed_tokens']:,} prompt tokens "
        f"computed, {ref['device_hit_rate']:.0%} from the device.\n"
        f"{_policy_effect_line(a)}\n"
        f"Tier occupancy (blocks used/capacity): {occupancy}; pinned {a['pinned_blocks']}, "
        f"pinned blocks evicted {a['pinned_blocks_evicted']}.\n"
        f"Wrote {plot}.\n")


def _policy_effect_line(a: dict[str, Any]) -> str:
    """What the policy bought against LRU, in tokens (exact) and TTFT (this machine's)."""
    ours, lru, ceiling = (a["computed_tokens"], a["reference"]["computed_tokens"],
                          a["ceiling"]["computed_tokens"])
    gap = lru - ceiling
    closed = f", {(lru - ours) / gap:.0%} of the way from LRU to" if gap > 0 else "; LRU is at"
    if ours == lru:
        return (f"The policy computed the same {ours:,} prompt tokens as LRU: any TTFT "
                f"difference is this machine's noise. A cache holding every agent computes "
                f"{ceiling:,}.")
    verb = "saved" if ours < lru else "cost"
    return (f"The policy {verb} {abs(lru - ours):,} prompt tokens against LRU ({ours:,} vs "
            f"{lru:,}){closed} the ceiling of a cache holding every agent ({ceiling:,}); "
            f"TTFT summed over the steps {a['ttft_ms_sum'] / 1000:.1f} s vs LRU's "
            f"{a['reference']['ttft_ms_sum'] / 1000:.1f} s (ceiling "
            f"{a['ceiling']['ttft_ms_sum'] / 1000:.1f} s).")


def _signed_line(signed: bool) -> str:
    """Whether the shadow is signed; unsigned says what that means and the one step."""
    from shadow.auth import KEY_STEP

    if signed:
        return "signed (manifests and every block carry a MAC)"
    return ("unsigned: fine for this machine's own store, but whoever can write it can "
            f"change what is restored; to sign: {KEY_STEP}")


def _first_turn_line(first: dict[str, Any], recovered_blocks: int) -> str:
    """What turn 1 measured and why: cold, it pays for the cache; restored, it reuses."""
    base, ours = first["ttft_ms_baseline"] / 1000, first["ttft_ms_contextkit"] / 1000
    times = f"TTFT {ours:.2f} s with contextkit vs {base:.2f} s for the full prefill"
    if first["reused_tokens"] == 0:
        return (f"Turn 1 ({times}): nothing is cached yet, so contextkit prefills all "
                f"{first['prompt_tokens']:,} tokens too, and also quantizes every block into "
                "the TQ4 cache and pins the stable prefix; that is the cost it pays once. "
                "Later turns reuse the cached prefix; run the demo again to start from its "
                "shadow.")
    return (f"Turn 1 ({times}): served from the {recovered_blocks} blocks restored from the "
            f"shadow, reusing {first['reused_tokens']:,} of {first['prompt_tokens']:,} prompt "
            f"tokens and computing {first['computed_tokens']:,}. Its reply may differ from a "
            "cold run's: the restored KV is 4-bit TQ4, where a cold prefill attends over the "
            "float KV it just computed.")


def _decode_line(tps: float | None, max_new_tokens: int) -> str:
    if tps is None:
        return "Decode median: contextkit - (every reply was one token)."
    return (f"Decode median: contextkit {tps:.1f} tokens/s (greedy replies of up to "
            f"{max_new_tokens} tokens over the TQ4 cache; `contextkit bench decode` "
            "measures decode alone).")


def _reservation_summary(result: dict[str, Any]) -> dict[str, Any]:
    """Reservations made, hit and expired over the replay, and the hit rate."""
    stats = result.get("reservations") or {}
    return {"enabled": bool(result.get("reserve")), "think_s": result.get("think_s"),
            "made": stats.get("made", 0), "hit": stats.get("hits", 0),
            "expired": stats.get("expired", 0), "missed": stats.get("misses", 0),
            "memory_change_turns": result.get("memory_change_turns", []),
            "hit_rate": result.get("reservation_hit_rate"),
            "background_cpu_s": result.get("background_cpu_s_total", 0.0)}


def _reservation_line(r: dict[str, Any]) -> str:
    if not r["enabled"]:
        return "reservations: off (--no-reserve)"
    changes = len(r["memory_change_turns"])
    return (f"reservations: made {r['made']}, hit {r['hit']}, expired {r['expired']} "
            f"(memories changed on {changes} turn{'s' * (changes != 1)}; background "
            f"prefill {r['background_cpu_s']:.1f} CPU s in the think time of "
            f"{r['think_s']:g} s per turn).")


def _agents_run(engine: Any, steps: int, max_new_tokens: int, out: Path) -> dict[str, Any]:
    """A short multi-agent run with the tier manager's look-ahead prefetch."""
    from contextkit.bench.agents import (
        PolicyRun,
        dry_build,
        plan_sizes,
        policy_figures,
        run_interleaved,
    )
    from contextkit.workloads.agents import MultiAgentWorkload

    workload = MultiAgentWorkload(AGENTS, num_tenants=TENANTS, steps=steps, scale=AGENT_SCALE)
    _, prompt_blocks, stable_blocks = dry_build(engine, workload, steps)
    sizes = plan_sizes(prompt_blocks, stable_blocks, block_size=engine.cache.block_size,
                       device_agents=2, host_agents=1, max_new_tokens=max_new_tokens)
    _say(f"multi-agent run: {AGENTS} agents of {TENANTS} tenants, {steps} steps; device tier "
         f"{sizes.device_blocks} blocks (2 agents' prompts), host tier {sizes.host_blocks} "
         "(1); the tier manager prefetches each agent's blocks before its turn. Each step "
         "also runs, in turn and on the same prompts, on LRU and on a cache that holds "
         "every agent (the ceiling); the rows are the policy's ...")
    _say(f"{'step':>4}  {'agent':<8} {'prompt':>6}  {'reused':>6}  {'prefetch':>15}  "
         f"{'ttft':>7}  {'device':>9}  {'host':>9}")

    def show(r: dict[str, Any]) -> None:
        _say(f"{r['step'] + 1:>4}  {r['agent']:<8} {r['prompt_tokens']:>6}  "
             f"{r['reused_tokens']:>6}  +{r['prefetch_warmed']:>3} -{r['prefetch_spilled']:>3} "
             f"x{r['prefetch_removed']:>3}  {r['ttft_ms'] / 1000:>6.2f}s  "
             f"{r['device_used']:>4}/{sizes.device_blocks:<4}  "
             f"{r['host_used']:>4}/{sizes.host_blocks:<4}")

    everyone = plan_sizes(prompt_blocks, stable_blocks, block_size=engine.cache.block_size,
                          device_agents=AGENTS, host_agents=1, max_new_tokens=max_new_tokens)
    # every step goes to the policy, LRU (the reference: recency only, no pins, no
    # prefetch) and a cache holding every agent (the ceiling) in turn, on the same prompts
    configs = {"semantic+ooda": PolicyRun(engine, workload, "semantic+ooda", sizes,
                                          max_new_tokens=max_new_tokens),
               "lru": PolicyRun(engine, workload, "lru", sizes, max_new_tokens=max_new_tokens),
               "ceiling": PolicyRun(engine, workload, "semantic", everyone,
                                    max_new_tokens=max_new_tokens)}
    done = run_interleaved(configs, workload, steps=steps, progress=False,
                           on_step=lambda label, r: show(r) if label == "semantic+ooda"
                           else None)
    run = done["semantic+ooda"]
    rows = run["rows"]
    figures = policy_figures(rows)
    reference = done["lru"]["rows"]
    ref_figures = policy_figures(reference)
    ceiling = done["ceiling"]["rows"]
    prefetch = figures["prefetch"]
    summary = {
        "agents": AGENTS, "tenants": TENANTS, "steps": steps,
        "device_agents": sizes.device_agents, "host_agents": sizes.host_agents,
        "sizes": sizes.describe(), "tiers": run["tiers"],
        "ttft_ms_p50": statistics.median(r["ttft_ms"] for r in rows),
        "device_hit_rate": figures["device_hit_rate"], "host_hit_rate": figures["host_hit_rate"],
        "prefetches": prefetch["calls"], "prefetch_before_generate": prefetch["before_generate"],
        "prefetch_warmed_blocks": prefetch["warmed_blocks"],
        "prefetch_spilled_blocks": prefetch["spilled_blocks"],
        "prefetch_removed_blocks": prefetch["removed_blocks"],
        "ooda_ms_p50": figures["ooda_cycle_ms_p50"],
        "pinned_blocks": run["pinned_blocks"],
        "pinned_blocks_evicted": figures["pinned_blocks_evicted"],
        "leak_free": run["leak_free"],
        "computed_tokens": sum(r["computed_tokens"] for r in rows),
        # on a CPU-only machine the device tier is host memory too
        "device": engine.cache.device.type,
        "ttft_ms_sum": sum(r["ttft_ms"] for r in rows),
        "reference": {"policy": "lru",
                      "ttft_ms_p50": statistics.median(r["ttft_ms"] for r in reference),
                      "ttft_ms_sum": sum(r["ttft_ms"] for r in reference),
                      "device_hit_rate": ref_figures["device_hit_rate"],
                      "host_hit_rate": ref_figures["host_hit_rate"],
                      "computed_tokens": sum(r["computed_tokens"] for r in reference)},
        "ceiling": {"policy": "semantic, every agent fits",
                    "ttft_ms_sum": sum(r["ttft_ms"] for r in ceiling),
                    "computed_tokens": sum(r["computed_tokens"] for r in ceiling)},
    }
    fig = agents_figure(rows, reference, sizes.device_blocks, sizes.host_blocks,
                        cpu_only=summary["device"] == "cpu")
    plot = out / "agents.png"
    plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(plot, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return {"summary": summary, "rows": rows, "reference_rows": reference, "plot": str(plot)}


def agents_figure(rows: list[dict[str, Any]], reference: list[dict[str, Any]],
                  device_blocks: int, host_blocks: int, *, cpu_only: bool) -> Any:
    """TTFT per step (bars by agent; the LRU reference as markers) over the tiers'
    occupancy, and the blocks prefetched, drawn only when a prefetch warmed any."""
    from contextkit.config import require

    matplotlib = require("matplotlib", "plot")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    steps = [r["step"] + 1 for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    names = sorted({r["agent"] for r in rows})
    colors = {name: f"C{i}" for i, name in enumerate(names)}
    top.bar(steps, [r["ttft_ms"] / 1000 for r in rows],
            color=[colors[r["agent"]] for r in rows])
    handles: list[Any] = [Patch(color=colors[n], label=n) for n in names]
    if reference:
        top.plot([r["step"] + 1 for r in reference], [r["ttft_ms"] / 1000 for r in reference],
                 "k_", markersize=18, markeredgewidth=2)
        handles.append(Line2D([], [], color="k", marker="_", linestyle="none", markersize=12,
                              label="LRU reference"))
    top.set_ylabel("time to first token (s)")
    top.legend(handles=handles, fontsize=8, ncol=len(handles))
    top.set_title("contextkit demo: agents sharing one cache (semantic + OODA prefetch)",
                  fontsize=10)
    top.grid(axis="y", alpha=0.3)
    tier = " (CPU only: both tiers are host memory)" if cpu_only else ""
    bottom.plot(steps, [100 * r["device_used"] / device_blocks for r in rows], "o-",
                label=f"device tier used (%){tier}")
    bottom.plot(steps, [100 * r["host_used"] / host_blocks for r in rows], "s-",
                label="host tier used (%)")
    warmed = [r["prefetch_warmed"] for r in rows]
    if any(warmed):
        bottom.bar(steps, warmed, alpha=0.4, color="C2", label="blocks prefetched (warmed)")
    bottom.set_xlabel("step")
    bottom.set_ylabel("% of the tier / blocks")
    bottom.set_xticks(steps)
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize=8)
    fig.tight_layout()
    return fig
