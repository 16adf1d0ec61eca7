"""``contextkit bench ttft``: TTFT over the agent replay, with and without contextkit.

Every turn of the replay (:class:`contextkit.replay.AgentReplay`) is served four
ways by the same model in one process:

- **contextkit**: the cache-aware pipeline on the TQ4 cache (stable prefix pinned,
  volatile layers after the conversation, blocks reused by key);
- **baseline**: a full prefill of the same prompt, no cache (also the reference
  for the agreement figures);
- **prefix cache**: an exact-prefix KV cache (native K/V, LRU) over the layers in
  the user's order, as vLLM's automatic prefix caching would see them;
- **native cached**: the pipeline's prompt on a native-format block cache, to show
  reuse itself changes nothing (``agreement_native``) and how fast a lossless reuse
  of the very same tokens is (``speedup_native_cached_p50``).

``flop_ratio_p50`` is the median FLOP count of a full prefill over that of the
reused one (:meth:`~contextkit.engine.Engine.prefill_flops`): what the reuse can buy
when both runs reach the same share of the machine's peak, the ceiling that the
measured ``speedup_p50`` is read against.

Quality: ``top1_agreement_tq4`` teacher-forces the baseline's replies through the
TQ4 path the turn took (the same reused prefix, the same computed tail, the engine's
float sink and residual window); ``top1_agreement_tq4_packed_only`` does the same
with every token read back from TQ4 (no sink, no window), to show what the overlay
buys. ``ppl_ratio_tq4`` compares perplexity of a held-out continuation of the last
prompt with the TQ4 cache against a native full prefill.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from contextkit.bench._common import machine_info, positive_float, positive_int, print_table

__all__ = ["HELD_OUT", "HELP", "add_arguments", "run", "run_replay"]

HELP = ("TTFT per replay turn: contextkit (TQ4, semantic reuse) vs full prefill vs an "
        "exact-prefix cache; reply agreement and perplexity of the TQ4 path")

#: Held-out continuation of the agent's prompt for the perplexity ratio.
HELD_OUT = (
    "Incident summary for the on-call handoff. At 16:41 the checkout-api p95 latency rose "
    "from 180 ms to 620 ms in eu-west-1 after the v2.31 rollout reached the second region. "
    "The error rate stayed under 0.4 percent, so no page fired, but the latency alert "
    "opened a ticket. The new pricing client shipped with a connection pool of 8 instead "
    "of 32; pool wait time explains most of the added latency. We paused the rollout at "
    "two of five regions, raised the pool size through the config service, and watched "
    "p95 return to 190 ms within six minutes. No customer data was affected and no "
    "payments failed. Follow-ups: add pool wait time to the deploy health check, make the "
    "pricing client read its pool size from the shared defaults, and resume the rollout "
    "tomorrow morning after the load test passes. Owner for the follow-ups is the "
    "payments platform team; the ticket stays open until the health check change ships."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--turns", type=positive_int, default=20, help="replay turns (default 20)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32,
                        help="reply length limit per turn (default 32, greedy)")
    parser.add_argument("--scale", type=positive_float, default=1.0,
                        help="replay content scale (1.0: ~6K-token system prompt at default "
                             "budgets; 5.0: ~30K tokens of content, trimmed to the expanded "
                             "budgets: a ~20K-token prompt)")
    parser.add_argument("--device-blocks", type=positive_int, default=768,
                        help="device-tier blocks of the TQ4 cache (default 768)")
    parser.add_argument("--host-blocks", type=positive_int, default=2048,
                        help="host-tier blocks of the TQ4 cache (default 2048)")
    parser.add_argument("--out", default="runs/bench-ttft",
                        help="directory for the TTFT-per-turn plot (default runs/bench-ttft)")
    parser.add_argument("--no-quality", action="store_true",
                        help="skip the native-cached run and the agreement/perplexity figures")


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def run_replay(
    *,
    turns: int,
    max_new_tokens: int = 32,
    scale: float = 1.0,
    device_blocks: int = 768,
    host_blocks: int = 2048,
    prefix_cache: bool = True,
    quality: bool = True,
    memory_graph: Any = None,
    engine: Any = None,
    progress: bool = True,
    on_turn: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run the agent replay; per-turn TTFTs and reuse, plus quality figures.

    Args:
        turns: replay turns.
        prefix_cache: also time the exact-prefix baseline in the user's order.
        quality: also run the native cached path, teacher-forced agreement and the
            perplexity ratio.
        memory_graph: a seeded :class:`memory_graph.MemoryGraph` for the memories
            layer (the replay's scripted memories otherwise).
        engine: a TQ4 :class:`~contextkit.engine.Engine` to use (loaded otherwise).
        on_turn: called with each turn's record as it completes.
    """
    from contextkit.engine import Engine
    from contextkit.pipeline import CacheAwareContextPipeline
    from contextkit.replay import AgentReplay

    if turns < 1:
        raise ValueError(f"turns must be >= 1, got {turns}")
    if engine is None:
        engine = Engine.from_pretrained(num_device_blocks=device_blocks,
                                        num_host_blocks=host_blocks)
    replay = AgentReplay(turns, scale=scale, memory_graph=memory_graph)
    pipeline = CacheAwareContextPipeline(engine)
    build = pipeline.wrap(replay.build_system_message)

    # Native-format siblings share the weights; their blocks are ~20x larger, so they
    # get just enough device blocks for a few turns' prompts.
    pc_engine = native = None
    records: list[dict[str, Any]] = []
    history: list[tuple[str, str]] = []
    agree_native: list[bool] = []
    top1_hits = top1_total = top1_packed_hits = 0
    bar = tqdm(total=turns, desc="replay", unit="turn", file=sys.stderr, disable=not progress)
    for t in range(turns):
        turn = replay.turn(t)
        build(t)
        ids, spans, _ = pipeline.assemble(turn.user_message, history)
        if t == 0:
            room = 3 * _blocks_for(len(ids) + 64 * turns + max_new_tokens, engine.cache.block_size)
            if prefix_cache:
                pc_engine = engine.sibling("native", num_device_blocks=room, num_host_blocks=16,
                                           eviction_policy="lru")
            if quality:
                native = engine.sibling("native", num_device_blocks=room, num_host_blocks=16)

        ck = pipeline.generate(turn.user_message, history=history, max_new_tokens=max_new_tokens)
        base = engine.generate(ids, max_new_tokens=max_new_tokens if quality else 1,
                               use_cache=False)
        record: dict[str, Any] = {
            "turn": t + 1,
            "prompt_tokens": ck.generation.prompt_tokens,
            "ttft_ms_contextkit": ck.generation.ttft_ms,
            "ttft_ms_baseline": base.ttft_ms,
            "reused_tokens": ck.generation.reused_tokens,
            "computed_tokens": ck.generation.computed_tokens,
            "flop_ratio": (engine.prefill_flops(len(ids))
                           / engine.prefill_flops(len(ids), ck.generation.reused_tokens)),
            "kv_reuse_ratio": ck.generation.kv_reuse_ratio,
            "prefix_broken_by": ck.report.prefix_broken_by,
            "changed_layers": ck.report.changed_layers,
            "pinned_blocks": ck.report.pinned_blocks,
            "blocks_per_tier": ck.report.blocks_per_tier,
            "reply": ck.text,
        }
        if pc_engine is not None:
            ids_user, spans_user, _ = pipeline.assemble(turn.user_message, history,
                                                        user_order=True)
            pc = pc_engine.generate(ids_user, max_new_tokens=1, spans=spans_user)
            record["ttft_ms_prefix_cache"] = pc.ttft_ms
            record["reused_tokens_prefix_cache"] = pc.reused_tokens
        if quality and native is not None:
            nat = native.generate(ids, max_new_tokens=max_new_tokens, spans=spans)
            same = nat.token_ids == base.token_ids
            agree_native.append(same)
            record["ttft_ms_native_cached"] = nat.ttft_ms
            record["reused_tokens_native_cached"] = nat.reused_tokens
            record["native_reply_identical"] = same
            target = torch.tensor(base.token_ids)
            reused = ck.generation.reused_tokens
            logits = engine.score(ids, base.token_ids, max_reuse_tokens=reused)
            hits = int((logits.argmax(dim=-1) == target).sum())
            packed = engine.score(ids, base.token_ids, max_reuse_tokens=reused,
                                  residual_tokens=0, sink_tokens=0)
            top1_packed_hits += int((packed.argmax(dim=-1) == target).sum())
            top1_hits += hits
            top1_total += len(base.token_ids)
            record["top1_agreement_tq4"] = hits / len(base.token_ids)
        records.append(record)
        if on_turn is not None:
            on_turn(record)
        history += [("user", turn.user_message), ("assistant", ck.text)]
        bar.set_postfix(ck=f"{ck.generation.ttft_ms / 1000:.1f}s",
                        base=f"{base.ttft_ms / 1000:.1f}s")
        bar.update(1)
    bar.close()

    out: dict[str, Any] = {"turns": turns, "records": records}
    later = records[1:] if len(records) > 1 else records
    out["speedup_p50"] = statistics.median(
        r["ttft_ms_baseline"] / r["ttft_ms_contextkit"] for r in later)
    out["flatness"] = (records[-1]["ttft_ms_contextkit"] / records[1]["ttft_ms_contextkit"]
                       if len(records) > 1 else 1.0)
    # What the reuse allows at all: the FLOP ratio of full to reused prefill, and the
    # speedup of a lossless (native-format) cache reusing the very same tokens.
    out["flop_ratio_p50"] = statistics.median(r["flop_ratio"] for r in later)
    if prefix_cache:
        out["speedup_vs_prefix_cache_p50"] = statistics.median(
            r["ttft_ms_prefix_cache"] / r["ttft_ms_contextkit"] for r in later)
    if quality:
        out["agreement_native"] = sum(agree_native) / len(agree_native)
        out["speedup_native_cached_p50"] = statistics.median(
            r["ttft_ms_baseline"] / r["ttft_ms_native_cached"] for r in later)
        out["top1_agreement_tq4"] = top1_hits / max(1, top1_total)
        out["top1_agreement_tq4_packed_only"] = top1_packed_hits / max(1, top1_total)
        out["residual_tokens"] = engine.residual_tokens
        out["sink_tokens"] = engine.sink_tokens
        held = engine.encode(HELD_OUT)
        ids, _, _ = pipeline.assemble(replay.turn(turns - 1).user_message, history)
        out["ppl_tq4"] = _perplexity(engine.score(ids, held), held)
        out["ppl_native"] = _perplexity(engine.score(ids, held, use_cache=False), held)
        out["ppl_ratio_tq4"] = out["ppl_tq4"] / out["ppl_native"]
        out["held_out_tokens"] = len(held)
    out["cache"] = engine.cache.summary()
    out["pinned_blocks"] = len(pipeline.pinned_blocks())
    out["volatility"] = pipeline.volatility()
    return out


def _perplexity(logits: torch.Tensor, target: list[int]) -> float:
    loss = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(target))
    return math.exp(float(loss))


def plot_ttft(records: list[dict[str, Any]], path: Path, title: str) -> Path:
    """TTFT per turn: baseline, prefix cache (if measured) and contextkit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [r["turn"] for r in records]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.plot(turns, [r["ttft_ms_baseline"] / 1000 for r in records], "o-", color="C7",
            label="full prefill (no cache)")
    if "ttft_ms_prefix_cache" in records[0]:
        ax.plot(turns, [r["ttft_ms_prefix_cache"] / 1000 for r in records], "s-", color="C1",
                label="exact-prefix cache, user's layer order")
    ax.plot(turns, [r["ttft_ms_contextkit"] / 1000 for r in records], "^-", color="C0",
            label="contextkit (TQ4, semantic reuse)")
    if "ttft_ms_native_cached" in records[0]:
        ax.plot(turns, [r["ttft_ms_native_cached"] / 1000 for r in records], ".:", color="C2",
                label="same reuse, lossless native K/V")
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (s)")
    top = max(r[k] for r in records for k in r if k.startswith("ttft_ms_")) / 1000
    ax.set_ylim(0, top * 1.3)  # room above the curves for the legend
    ax.set_xticks(turns)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", ncol=2, fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args: argparse.Namespace) -> dict[str, Any]:
    result = run_replay(turns=args.turns, max_new_tokens=args.max_new_tokens, scale=args.scale,
                        device_blocks=args.device_blocks, host_blocks=args.host_blocks,
                        quality=not args.no_quality)
    records = result.pop("records")
    machine = machine_info()
    out: dict[str, Any] = {
        "bench": "ttft",
        "machine": machine,
        "turns": result["turns"],
        "prompt_tokens": [r["prompt_tokens"] for r in records],
        "ttft_ms_baseline": [round(r["ttft_ms_baseline"], 1) for r in records],
        "ttft_ms_contextkit": [round(r["ttft_ms_contextkit"], 1) for r in records],
        "ttft_ms_prefix_cache": [round(r["ttft_ms_prefix_cache"], 1) for r in records],
        "reused_tokens": [r["reused_tokens"] for r in records],
        "computed_tokens": [r["computed_tokens"] for r in records],
        "prefix_broken_by": [r["prefix_broken_by"] for r in records],
        "flop_ratio": [round(r["flop_ratio"], 3) for r in records],
        **({"ttft_ms_native_cached": [round(r["ttft_ms_native_cached"], 1) for r in records],
            "reused_tokens_native_cached": [r["reused_tokens_native_cached"] for r in records]}
           if "ttft_ms_native_cached" in records[0] else {}),
        **{k: v for k, v in result.items() if k not in ("cache",)},
        "blocks_per_tier": records[-1]["blocks_per_tier"],
    }
    png = plot_ttft(records, Path(args.out) / "ttft.png",
                    f"agent replay, {records[-1]['prompt_tokens']:,}-token prompt "
                    f"({machine['device_name']})")
    out["plot"] = str(png)
    rows: list[tuple[str, Any]] = [
        ("turns | prompt tokens (last)", f"{out['turns']} | {records[-1]['prompt_tokens']:,}"),
        ("TTFT p50 baseline | contextkit (ms)",
         f"{statistics.median(out['ttft_ms_baseline'][1:] or out['ttft_ms_baseline']):,.0f} | "
         f"{statistics.median(out['ttft_ms_contextkit'][1:] or out['ttft_ms_contextkit']):,.0f}"),
        ("speedup_p50 (turns >= 2)", out["speedup_p50"]),
        ("  FLOP ratio full / reused prefill, p50", out["flop_ratio_p50"]),
        ("speedup_vs_prefix_cache_p50", out["speedup_vs_prefix_cache_p50"]),
        ("flatness (last / turn 2)", out["flatness"]),
    ]
    if "agreement_native" in out:
        rows += [("  lossless reuse of the same tokens: speedup p50",
                  out["speedup_native_cached_p50"]),
                 ("agreement_native", out["agreement_native"]),
                 ("top1_agreement_tq4", out["top1_agreement_tq4"]),
                 ("  packed only (no float sink/window)", out["top1_agreement_tq4_packed_only"]),
                 ("ppl_ratio_tq4", out["ppl_ratio_tq4"])]
    rows.append(("plot", png))
    print_table("bench ttft", rows)
    return out
