"""``contextkit bench ttft``: TTFT over the agent replay, with and without contextkit.

Every turn of the replay (:class:`contextkit.workloads.replay.AgentReplay`) is served four
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

``flop_ratio_prefix_reuse_p50`` is the median FLOP count of a full prefill over that
of one reusing the turn's cached prefix
(:meth:`~contextkit.engine.engine.Engine.prefill_flops`). It counts prefix reuse only,
not the chunks moved in past the prefix, so the measured speedups may exceed it: it
is what prefix reuse alone can buy, not a ceiling of contextkit.

Decode: beside each TTFT, per turn, ``decode_tps_contextkit`` and ``decode_tps_baseline``
(tokens 2..N of the greedy reply over the time after the first token, with the
``total_ms_*`` and ``generated_tokens_*`` they come from; ``None`` for a one-token
reply, as the baseline's is with ``--no-quality``), and their medians over all turns,
``decode_tps_p50`` (contextkit) and ``decode_tps_baseline_p50``; the native cached run
adds ``decode_tps_native_cached``. ``contextkit bench decode`` measures decode alone.

Reuse beyond the prefix (:mod:`contextkit.engine.chunks`, on unless
``--no-chunk-reuse``): per turn ``chunk_reused_tokens`` (moved in from layers, lines and
turns cached at other positions, not recomputed), ``repaired_tokens`` and
``reused_chunks`` (per label), and ``edited_chunks`` / ``edited_tokens``: lines whose
text changed, aligned against their cached version (the runs they share moved in, the
changed tokens computed; ``--no-chunk-edits`` is the ablation); with the quality runs,
a TQ4 sibling that moves every cached chunk (and shared run) in and repairs nothing
follows the same prompts: ``ttft_ms_chunk_ceiling``, and on the memory-change turns
``speedup_memory_change_ceiling_p50`` / ``_total`` and ``ceiling_fraction_memory_change``
(ratios over the same turns, the ceiling's TTFT capped at contextkit's, so no measured
figure exceeds them: :func:`~contextkit.bench._ttft_report.memory_change_ceiling`).
``top1_agreement_chunk_turns`` and ``ppl_ratio_chunk_turns`` (held-out perplexity after
the prompt, the turn's path over a full float prefill, geometric mean) are measured on
exactly the turns that reused chunks; ``top1_agreement_chunk_turns_tq4_prefill_only``
and ``ppl_ratio_chunk_turns_tq4_prefill_only`` teacher-force the same replies through a
separate TQ4 cache that only prefills wrote (no chunk path): the quality ceiling of
chunk reuse, independent of it (:mod:`contextkit.bench._ttft_quality`);
``top1_agreement_chunk_turns_prefix_only_same_cache`` uses the prefix alone on the chunk
path's own cache, whose blocks earlier chunk turns may have written.

Quality: ``top1_agreement_tq4`` teacher-forces the baseline's replies through the
TQ4 path the turn took (the same reused prefix, the same chunks moved in and repaired,
the same computed tail, the engine's float sink and residual window);
``top1_agreement_tq4_packed_only`` does the same with every token read back from TQ4
(no sink, no window), to show what the overlay buys; ``top1_agreement_tq4_prefill_only``
on the fresh prefill-only TQ4 cache. Every agreement has a Wilson 95% interval over its
forced positions (``*_ci95``); ``gates`` says for each gated one whether the interval's
lower end passes the gate (only then is it met). ``ppl_ratio_tq4`` compares
perplexity of a held-out continuation of the last prompt with the TQ4 cache against a
native full prefill.

Think time and reservations: the memories layer comes from a seeded
:class:`memory_graph.MemoryGraph` (SQLite in a temporary directory, the packaged
embedder). Between two turns the user reads the reply and types (``--think-s``,
default 30 s: reading a 32-token reply and typing the next 20-40-word message).
During that window, and only then, the pipeline's
:class:`~contextkit.loop.reservations.MemoryReservations` work in the background: the next
prompt with unchanged memories (the conversation extended by the exchange just
finished) into the device tier, and for the ``--reserve-candidates`` memory
neighborhoods :meth:`~contextkit.workloads.replay.AgentReplay.memory_candidates` predicts from
the conversation so far, the prompt with those memories, TQ4 into the host (DDR) tier
under a reservation. The bench waits until that work is done or the think time is
up, with nothing else running; every measured request runs with background work held
(no overlap). ``--no-reserve`` turns all of it off (today's behaviour) for the
comparison. Figures: ``reservation_hit_rate`` (memory-change turns whose new memories
were reserved and hit), ``speedup_memory_change_p50`` and ``speedup_steady_p50``,
``speedup_total`` (sum of baseline TTFT over sum of contextkit TTFT, every turn) and
``speedup_total_excl_turn1`` (turns >= 2: turn 1 has nothing cached), and
per turn ``background_cpu_s`` (CPU of the think window before the turn),
``reservation_hit``, ``extension_tokens``, ``foreground_wait_ms`` and ``stall_ms`` (how
long the arriving message waited for background work to yield; it is part of
contextkit's TTFT).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from contextkit.bench._common import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    unit_float,
)
from contextkit.bench._ttft_quality import ReplyQuality, perplexity
from contextkit.bench._ttft_report import memory_change_ceiling, report, speedup_totals
from contextkit.config import require

__all__ = ["DEFAULT_THINK_S", "HELD_OUT", "HELP", "add_arguments", "run", "run_replay"]

#: Seconds between a reply and the next message: a person reading a 32-token reply
#: and typing a 20-40-word message; background work may run only then.
DEFAULT_THINK_S = 30.0

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
    parser.add_argument("--think-s", type=non_negative_float, default=DEFAULT_THINK_S,
                        help="think time per turn in seconds: a person reading the reply and "
                             "typing the next message; background prefill may run only then "
                             f"(default {DEFAULT_THINK_S:g})")
    parser.add_argument("--no-reserve", action="store_true",
                        help="no background work between turns (no history extension, no "
                             "memory reservations): the comparison run")
    parser.add_argument("--no-chunk-reuse", action="store_true",
                        help="prefix reuse only: a changed layer recomputes everything after "
                             "it (the ablation of reuse beyond the prefix)")
    parser.add_argument("--no-chunk-edits", action="store_true",
                        help="a line whose text changed is computed whole, not aligned "
                             "against its cached version (the ablation of edited chunks)")
    parser.add_argument("--repair-ratio", type=unit_float, default=None,
                        help="share of reused chunk tokens recomputed (default: the engine's, "
                             "0.15)")
    parser.add_argument("--select-layer", type=non_negative_int, default=None,
                        help="model layers 0..N run over every token after the prefix and "
                             "pick the repaired ones at N (default: the engine's, 1)")
    parser.add_argument("--deviation-at", choices=("source", "moved"), default=None,
                        help="measure a reused token's fresh K/V against its K/V where "
                             "they are cached (source) or after the move (moved: tq4 keys "
                             "then carry a second quantization); default: the engine's, "
                             "source")
    parser.add_argument("--max-hops", type=non_negative_int, default=None,
                        help="K/V moved this many times since a full computation are "
                             "computed whole instead (default: the engine's, 4)")
    parser.add_argument("--no-memory-chunks", action="store_true",
                        help="do not compute the memories' lines when they enter the graph "
                             "(a memory's first appearance is computed in the turn)")
    parser.add_argument("--reserve-candidates", type=non_negative_int, default=2,
                        help="predicted memory neighborhoods reserved and prefilled after "
                             "each reply (default 2)")


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
    reserve: bool = True,
    reserve_candidates: int = 2,
    think_s: float = DEFAULT_THINK_S,
    chunk_reuse: bool = True,
    memory_chunks: bool = True,
    chunk_settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the agent replay; per-turn TTFTs and reuse, plus quality figures.

    Args:
        turns: replay turns.
        prefix_cache: also time the exact-prefix baseline in the user's order.
        quality: also run the native cached path, teacher-forced agreement and the
            perplexity ratio.
        memory_graph: a :class:`memory_graph.MemoryGraph` for the memories layer
            (seeded here with the replay's memories; the replay's scripted memories
            and no prediction without one).
        engine: a TQ4 :class:`~contextkit.engine.engine.Engine` to use (loaded otherwise).
        on_turn: called with each turn's record as it completes.
        reserve: background work between turns (history extension and memory
            reservations); off: every turn computes what its cache lacks, as before.
        reserve_candidates: memory neighborhoods reserved after each reply.
        think_s: the think window before each turn (>= 2): the longest the bench
            waits for the background work, with nothing else running.
        chunk_reuse: reuse layers, lines and turns past the cached prefix
            (:mod:`contextkit.engine.chunks`); off: prefix reuse only (the ablation).
        memory_chunks: with chunk reuse and a graph, compute each memory's line once
            when the graph is seeded, before the first turn
            (:class:`~contextkit.pipeline.memory_chunks.MemoryChunks`), for this engine
            and the chunk ceiling's.
        chunk_settings: :class:`~contextkit.engine.chunks.ChunkReuse` fields other than
            the defaults (e.g. ``repair_ratio``), with chunk reuse on.
    """
    from contextkit.engine.chunks import ChunkReuse
    from contextkit.engine.engine import Engine
    from contextkit.pipeline.pipeline import CacheAwareContextPipeline
    from contextkit.workloads.replay import AgentReplay

    if turns < 1:
        raise ValueError(f"turns must be >= 1, got {turns}")
    reuse: ChunkReuse | bool = (ChunkReuse(**chunk_settings) if chunk_reuse and chunk_settings
                                else chunk_reuse)
    if engine is None:
        engine = Engine.from_pretrained(num_device_blocks=device_blocks,
                                        num_host_blocks=host_blocks, chunk_reuse=reuse)
    elif engine.chunk_reuse.enabled != chunk_reuse or chunk_settings:
        engine = engine.sibling(chunk_reuse=reuse, num_device_blocks=device_blocks,
                                num_host_blocks=host_blocks)
    replay = AgentReplay(turns, scale=scale, memory_graph=memory_graph)
    if memory_graph is not None:
        replay.seed_memory(memory_graph)  # idempotent: nothing added when seeded already
    reservations = _reservations(engine, replay, reserve_candidates) if reserve else None
    pipeline = CacheAwareContextPipeline(engine, reservations=reservations)
    memory_chunks = memory_chunks and memory_graph is not None and engine.chunk_reuse.enabled
    ingest = _memory_chunks(engine, pipeline, replay) if memory_chunks else None
    build = pipeline.wrap(replay.build_system_message)

    # Native-format siblings share the weights; their blocks are ~20x larger, so they
    # get just enough device blocks for a few turns' prompts.
    pc_engine = native = ceiling = None
    records: list[dict[str, Any]] = []
    history: list[tuple[str, str]] = []
    agree_native: list[bool] = []
    held = engine.encode(HELD_OUT)
    tqdm = require("tqdm", "bench").tqdm
    # the independent TQ4 ceiling: the same format, a cache only prefills write
    fresh = (engine.sibling(chunk_reuse=False, num_device_blocks=device_blocks,
                            num_host_blocks=host_blocks) if quality else None)
    scores = ReplyQuality(engine, held, prefill_only=fresh)
    bar = tqdm(total=turns, desc="replay", unit="turn", file=sys.stderr, disable=not progress)
    for t in range(turns):
        think = _think_window(reservations, think_s if t else 0.0)
        # The message arrives now: background work still running must yield first, and
        # the user waits for that too (counted in contextkit's TTFT as stall_ms).
        arrived = time.perf_counter()
        with _held(reservations):
            stall_ms = (time.perf_counter() - arrived) * 1000
            turn = replay.turn(t)
            build(t)
            ids, spans, _ = pipeline.assemble(turn.user_message, history)
            if t == 0:
                room = 3 * _blocks_for(len(ids) + 64 * turns + max_new_tokens,
                                       engine.cache.block_size)
                if prefix_cache:
                    pc_engine = engine.sibling("native", num_device_blocks=room,
                                               num_host_blocks=16, eviction_policy="lru")
                if quality:
                    native = engine.sibling("native", num_device_blocks=room,
                                            num_host_blocks=16, chunk_reuse=False)
                    if engine.chunk_reuse.enabled:
                        # reuse's ceiling: every cached chunk (and every run an edited
                        # line shares with its version) moved in, nothing repaired
                        ceiling = engine.sibling(
                            num_device_blocks=device_blocks, num_host_blocks=host_blocks,
                            chunk_reuse=ChunkReuse(repair_ratio=0.0, repair_first=0,
                                                   select_layer=0, max_hops=1 << 30,
                                                   edits=engine.chunk_reuse.edits))
                        if memory_chunks:
                            _memory_chunks(ceiling, pipeline, replay)

            ck = pipeline.generate(turn.user_message, history=history,
                                   max_new_tokens=max_new_tokens)
            foreground_wait_ms = engine.last_foreground_wait_ms
            done = reservations.stats() if reservations is not None else None
            base = engine.generate(ids, max_new_tokens=max_new_tokens if quality else 1,
                                   use_cache=False)
            record: dict[str, Any] = {
                "turn": t + 1,
                "prompt_tokens": ck.generation.prompt_tokens,
                "ttft_ms_contextkit": ck.generation.ttft_ms + stall_ms,
                "stall_ms": stall_ms,
                "ttft_ms_baseline": base.ttft_ms,
                **_decode_figures(ck.generation, "contextkit", stall_ms),
                **_decode_figures(base, "baseline"),
                "reused_tokens": ck.generation.reused_tokens,
                "computed_tokens": ck.generation.computed_tokens,
                "chunk_reused_tokens": ck.generation.chunk_reused_tokens,
                "repaired_tokens": ck.generation.repaired_tokens,
                "edited_chunks": len(ck.generation.reused_chunk_edits),
                "edited_tokens": ck.generation.edited_tokens,
                "reused_chunks": dict(ck.report.reused_chunks),
                "flop_ratio_prefix_reuse": (
                    engine.prefill_flops(len(ids))
                    / engine.prefill_flops(len(ids), ck.generation.reused_tokens)),
                "kv_reuse_ratio": ck.generation.kv_reuse_ratio,
                "prefix_broken_by": ck.report.prefix_broken_by,
                "changed_layers": ck.report.changed_layers,
                "pinned_blocks": ck.report.pinned_blocks,
                "blocks_per_tier": ck.report.blocks_per_tier,
                "reply": ck.text,
                "memory_change": t > 0 and "memories" in turn.changed_layers,
                "reservation_hit": ck.report.reservation_hit,
                "foreground_wait_ms": foreground_wait_ms,
                **_window_figures(think, done),
            }
            if pc_engine is not None:
                ids_user, spans_user, _ = pipeline.assemble(turn.user_message, history,
                                                            user_order=True)
                pc = pc_engine.generate(ids_user, max_new_tokens=1, spans=spans_user)
                record["ttft_ms_prefix_cache"] = pc.ttft_ms
                record["reused_tokens_prefix_cache"] = pc.reused_tokens
            if ceiling is not None:
                top = ceiling.generate(ids, max_new_tokens=1, spans=spans)
                record["ttft_ms_chunk_ceiling"] = top.ttft_ms
                record["computed_tokens_chunk_ceiling"] = top.computed_tokens
            if quality and native is not None:
                nat = native.generate(ids, max_new_tokens=max_new_tokens, spans=spans)
                same = nat.token_ids == base.token_ids
                agree_native.append(same)
                record["ttft_ms_native_cached"] = nat.ttft_ms
                record["decode_tps_native_cached"] = nat.decode_tps
                record["reused_tokens_native_cached"] = nat.reused_tokens
                record["native_reply_identical"] = same
                record["top1_agreement_tq4"] = scores.turn(ids, spans, ck.generation,
                                                           base.token_ids)
        records.append(record)
        if on_turn is not None:
            on_turn(record)
        history += [("user", turn.user_message), ("assistant", ck.text)]
        bar.set_postfix(ck=f"{ck.generation.ttft_ms / 1000:.1f}s",
                        base=f"{base.ttft_ms / 1000:.1f}s")
        bar.update(1)
    bar.close()
    stats = None
    if reservations is not None:
        reservations.close()  # nothing runs beside the figures below; live ones expire
        reservations.reserver.close()
        stats = reservations.stats().as_dict()

    out: dict[str, Any] = {"turns": turns, "records": records,
                           "chunk_reuse": engine.chunk_reuse.enabled,
                           "chunk_settings": {
                               k: getattr(engine.chunk_reuse, k)
                               for k in ("repair_ratio", "repair_first", "repair_rule",
                                         "select_layer", "deviation_at", "min_share",
                                         "max_hops", "edits")},
                           "memory_chunks": None if ingest is None else {
                               "lines": ingest.lines, "computed_tokens": ingest.computed_tokens,
                               "wall_s": round(ingest.wall_s, 3)}}
    out.update(_reservation_figures(records, stats, reserve=reserve, think_s=think_s,
                                    candidates=reserve_candidates))
    later = records[1:] if len(records) > 1 else records
    out["speedup_p50"] = statistics.median(
        r["ttft_ms_baseline"] / r["ttft_ms_contextkit"] for r in later)
    out["flatness"] = (records[-1]["ttft_ms_contextkit"] / records[1]["ttft_ms_contextkit"]
                       if len(records) > 1 else 1.0)
    # What prefix reuse alone allows: the FLOP ratio of full to prefix-reusing prefill
    # (chunk reuse not counted); the lossless sibling's speedup comes below.
    out["flop_ratio_prefix_reuse_p50"] = statistics.median(
        r["flop_ratio_prefix_reuse"] for r in later)
    # Decode does not depend on what the prefill reused: medians over every turn.
    out["decode_tps_p50"] = _median_of(records, "decode_tps_contextkit")
    out["decode_tps_baseline_p50"] = _median_of(records, "decode_tps_baseline")
    if prefix_cache:
        out["speedup_vs_prefix_cache_p50"] = statistics.median(
            r["ttft_ms_prefix_cache"] / r["ttft_ms_contextkit"] for r in later)
    if quality:
        out["agreement_native"] = sum(agree_native) / len(agree_native)
        out["speedup_native_cached_p50"] = statistics.median(
            r["ttft_ms_baseline"] / r["ttft_ms_native_cached"] for r in later)
        out["decode_tps_native_cached_p50"] = _median_of(records, "decode_tps_native_cached")
        out.update(scores.figures())
        out["residual_tokens"] = engine.residual_tokens
        out["sink_tokens"] = engine.sink_tokens
        ids, _, _ = pipeline.assemble(replay.turn(turns - 1).user_message, history)
        out["ppl_tq4"] = perplexity(engine.score(ids, held), held)
        out["ppl_native"] = perplexity(engine.score(ids, held, use_cache=False), held)
        out["ppl_ratio_tq4"] = out["ppl_tq4"] / out["ppl_native"]
        out["held_out_tokens"] = len(held)
    out["cache"] = engine.cache.summary()
    out["pinned_blocks"] = len(pipeline.pinned_blocks())
    out["volatility"] = pipeline.volatility()
    return out


def _decode_figures(result: Any, who: str, stall_ms: float = 0.0) -> dict[str, Any]:
    """A reply's decode tokens/s beside its TTFT: tokens 2..N over the time after the
    first (``None`` for a one-token reply), with the total time and token count it
    comes from (``stall_ms`` is in both of contextkit's times, as in its TTFT)."""
    return {f"decode_tps_{who}": result.decode_tps,
            f"total_ms_{who}": result.total_ms + stall_ms,
            f"generated_tokens_{who}": len(result.token_ids)}


def _median_of(records: list[dict[str, Any]], key: str) -> float | None:
    """Median of a per-turn figure over the turns that have it (``None`` if none)."""
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def _memory_chunks(engine: Any, pipeline: Any, replay: Any) -> Any:
    """Compute the seeded memories' lines on ``engine``, as an application does when it
    writes them to the graph (before the first turn: no turn waits for it)."""
    from contextkit.pipeline.memory_chunks import MemoryChunks

    return MemoryChunks(engine, config=pipeline.config).sync(
        replay.memory_graph, graph_tenant=replay.tenant, tenant=pipeline.tenant)


def _reservations(engine: Any, replay: Any, candidates: int) -> Any:
    """The pipeline's background work between turns: history extension, and memory
    reservations predicted by ``replay.memory_candidates`` (none without a graph)."""
    from contextkit.loop.reservations import MemoryReservations
    from memory_graph import GraphBlockReserver

    reserver = GraphBlockReserver(engine.cache, engine.count_tokens, graph=replay.memory_graph)
    return MemoryReservations(engine, reserver, replay.memory_candidates,
                              max_candidates=candidates)


@contextlib.contextmanager
def _held(reservations: Any) -> Iterator[None]:
    """No background job starts (a running one stops) while the turn is measured."""
    if reservations is None:
        yield
        return
    with reservations.held():
        yield


def _think_window(reservations: Any, think_s: float) -> dict[str, Any]:
    """Let the background work run for at most ``think_s`` with nothing else running."""
    if reservations is None:
        return {"stats": None, "think_used_s": 0.0, "background_done": True}
    before = reservations.stats()
    t0 = time.perf_counter()
    done = reservations.wait_idle(think_s)
    return {"stats": before, "think_used_s": time.perf_counter() - t0,
            "background_done": done}


def _window_figures(think: dict[str, Any], after: Any) -> dict[str, Any]:
    """Background figures of the think window before a turn (the turn's own
    ``before_turn`` has stopped and accounted whatever was still running)."""
    before = think["stats"]
    if before is None or after is None:
        return {"background_cpu_s": 0.0, "extension_tokens": 0, "think_used_s": 0.0,
                "background_done": True}
    return {"background_cpu_s": after.background_cpu_s - before.background_cpu_s,
            "extension_tokens": after.extension_tokens - before.extension_tokens,
            "think_used_s": think["think_used_s"], "background_done": think["background_done"]}


def _reservation_figures(records: list[dict[str, Any]], stats: dict[str, Any] | None, *,
                         reserve: bool, think_s: float, candidates: int) -> dict[str, Any]:
    """Hit rate, speedups of memory-change and steady turns, and the total speedup."""
    later = records[1:]
    change = [r for r in later if r["memory_change"]]
    steady = [r for r in later if not r["memory_change"]]

    def p50(rows: list[dict[str, Any]]) -> float | None:
        return statistics.median(r["ttft_ms_baseline"] / r["ttft_ms_contextkit"]
                                 for r in rows) if rows else None

    return {
        "think_s": think_s,
        "reserve": reserve,
        "reserve_candidates": candidates if reserve else 0,
        "memory_change_turns": [r["turn"] for r in change],
        "reservation_hit_rate": (sum(r["reservation_hit"] is not None for r in change)
                                 / len(change)) if change else None,
        "speedup_memory_change_p50": p50(change),
        "speedup_steady_p50": p50(steady),
        # the same turns with every cached chunk moved in and nothing repaired (no
        # reservations): what reuse by content can reach on them
        **memory_change_ceiling(change),
        **speedup_totals(records),
        "ttft_ms_memory_change": [round(r["ttft_ms_contextkit"], 1) for r in change],
        "background_cpu_s_total": sum(r["background_cpu_s"] for r in records),
        "reservations": stats,
    }


def plot_ttft(records: list[dict[str, Any]], path: Path, title: str) -> Path:
    """TTFT per turn: baseline, prefix cache (if measured) and contextkit."""
    from contextkit.config import require

    matplotlib = require("matplotlib", "plot")

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
    changed = [r["turn"] for r in records if r.get("memory_change")]
    for i, turn in enumerate(changed):
        ax.axvspan(turn - 0.4, turn + 0.4, color="C3", alpha=0.12, lw=0,
                   label="memories changed" if i == 0 else None)
    hit = [r for r in records if r.get("reservation_hit")]
    if hit:
        ax.plot([r["turn"] for r in hit], [r["ttft_ms_contextkit"] / 1000 for r in hit], "*",
                color="C3", markersize=12, label="memories reserved ahead (hit)")
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
    from memory_graph import MemoryGraph, SentenceTransformerEmbedder

    with tempfile.TemporaryDirectory(prefix="contextkit-bench-ttft-") as tmp:
        graph = MemoryGraph(f"sqlite:///{tmp}/memory.db",
                            embedder=SentenceTransformerEmbedder())
        try:
            result = run_replay(turns=args.turns, max_new_tokens=args.max_new_tokens,
                                scale=args.scale, device_blocks=args.device_blocks,
                                host_blocks=args.host_blocks, quality=not args.no_quality,
                                memory_graph=graph, reserve=not args.no_reserve,
                                reserve_candidates=args.reserve_candidates,
                                think_s=args.think_s, chunk_reuse=not args.no_chunk_reuse,
                                memory_chunks=not args.no_memory_chunks,
                                chunk_settings={k: v for k, v in (
                                    ("repair_ratio", args.repair_ratio),
                                    ("select_layer", args.select_layer),
                                    ("deviation_at", args.deviation_at),
                                    ("max_hops", args.max_hops),
                                    ("edits", False if args.no_chunk_edits else None))
                                    if v is not None})
        finally:
            graph.close()
    return report(result, Path(args.out), plot_ttft)
