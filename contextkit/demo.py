"""``contextkit demo``: the main job on embedded defaults.

An SRE agent (the deterministic replay of :mod:`contextkit.replay`) talks to the
packaged SmolLM2 for several turns. Its ~6K-token, ten-layer system prompt goes
through :class:`~contextkit.pipeline.CacheAwareContextPipeline` onto the TQ4 cache;
its memories layer comes from a :class:`memory_graph.MemoryGraph` in SQLite; the
cache is shadowed to a local directory, so a second run starts warm. Every turn is
also served by a full prefill without any cache, and the demo prints and plots both
TTFTs.

Outputs under ``--out``: ``demo.json`` (per-turn records and summary), ``ttft.png``
(TTFT per turn) and ``memory.db`` (the graph). The shadow goes to ``--store``
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

from tqdm import tqdm

__all__ = ["SESSION_ID", "add_demo_arguments", "run_demo"]

SESSION_ID = "contextkit-demo"


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--turns", type=int, default=6,
                        help="replay turns (default 6, about 5 minutes on 2 CPU cores; the "
                             "benchmark runs 20)")
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


def _say(message: str) -> None:
    tqdm.write(message, file=sys.stderr)


def run_demo(args: argparse.Namespace) -> int:
    from contextkit.bench.ttft import plot_ttft, run_replay
    from contextkit.engine import Engine
    from contextkit.replay import AgentReplay
    from gpu_cache import CacheIdentityError
    from memory_graph import MemoryGraph, SentenceTransformerEmbedder
    from shadow import CacheShadow, ShadowConfig, ShadowError, discover_sessions, open_store
    from shadow.cli import default_store_url

    if args.turns < 1:
        raise SystemExit("contextkit demo: --turns must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store_url = args.store or default_store_url()

    _say("loading SmolLM2-135M-Instruct (packaged GGUF) and calibrating the TQ4 cache ...")
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(num_device_blocks=768, num_host_blocks=2048)
    _say(f"  ready in {time.perf_counter() - t0:.1f} s; cache identity "
         f"{engine.identity.digest().hex()[:12]}, {engine.cache.bytes_per_block:,} bytes/block")

    _say(f"memory graph: sqlite:///{out / 'memory.db'}")
    graph = MemoryGraph(f"sqlite:///{out / 'memory.db'}",
                        embedder=SentenceTransformerEmbedder(trace_queries=False))
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
    header = f"{'turn':>4}  {'prompt':>6}  {'reused':>6}  {'computed':>8}  " \
             f"{'baseline':>9}  {'contextkit':>10}  {'speedup':>7}  broken by"
    _say(header)

    def show(r: dict[str, Any]) -> None:
        _say(f"{r['turn']:>4}  {r['prompt_tokens']:>6}  {r['reused_tokens']:>6}  "
             f"{r['computed_tokens']:>8}  {r['ttft_ms_baseline'] / 1000:>8.2f}s  "
             f"{r['ttft_ms_contextkit'] / 1000:>9.2f}s  "
             f"{r['ttft_ms_baseline'] / r['ttft_ms_contextkit']:>6.1f}x  "
             f"{r['prefix_broken_by'] or '-'}")

    result = run_replay(turns=args.turns, max_new_tokens=args.max_new_tokens, engine=engine,
                        memory_graph=graph, prefix_cache=False, quality=False, on_turn=show)
    written = shadow.shadow_now()
    shadow.close()
    store.close()
    graph.close()

    records = result["records"]
    summary = {
        "turns": len(records),
        "speedup_p50": result["speedup_p50"],
        "ttft_ms_baseline_p50": statistics.median(r["ttft_ms_baseline"] for r in records),
        "ttft_ms_contextkit_p50": statistics.median(r["ttft_ms_contextkit"] for r in records),
        "kv_reuse_ratio_p50": statistics.median(r["kv_reuse_ratio"] for r in records),
        "pinned_blocks": result["pinned_blocks"],
        "blocks_per_tier": records[-1]["blocks_per_tier"],
        "recovered_blocks": recovered.get("blocks", 0),
        "shadow": {"store": store_url, "session": SESSION_ID,
                   "blocks": written.num_blocks, "bytes_written": written.bytes_written},
    }
    (out / "demo.json").write_text(json.dumps({"summary": summary, "records": records,
                                               "volatility": result["volatility"]},
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
        f"Cache: {summary['pinned_blocks']} pinned blocks (the stable prefix); blocks per tier: "
        f"{tiers}. Restored at start: {summary['recovered_blocks']} blocks.\n"
        f"Shadowed {written.num_blocks} blocks to {store_url} (session {SESSION_ID}); "
        "see `contextkit status`.\n"
        f"Wrote {out / 'demo.json'} and {png}.\n")
    return 0
