"""Published figures, generated from the committed bench JSON: never typed by hand.

README.md and docs/benchmarks.md hold their measured numbers only between
``<!-- figures:NAME -->`` and ``<!-- /figures:NAME -->`` markers. Each block is the
rendering of a table of `Row`s: a row names the committed JSON files under
bench/results, the function that reads its figure from one file, and where the same
run measured one, its ceiling. Several files are several runs: the row shows their
median and each run. ``python -m contextkit.bench.figures`` rewrites the blocks;
``--check`` (and tests/contextkit/bench/test_figures.py) fails when a block differs
from what the JSON gives.

Ceilings here are bounds by construction (tokens, or ratios of sums over the same
turns), so a configuration cannot beat its own ceiling. Where two configurations
compute the same tokens, the row says so instead of printing a speedup.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contextkit.bench._agents_report import SAME_TOKENS
from contextkit.bench._ttft_quality import wilson_interval as wilson

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
#: Where each older file was run, recorded by hand from the session notes before the
#: benches wrote it themselves (files written since carry ``provenance``).
MACHINES = RESULTS / "machines.json"
#: The files whose blocks are generated.
TARGETS = ("README.md", "docs/benchmarks.md")

BLOCK = re.compile(r"(<!-- figures:([\w-]+) -->\n)(.*?)(<!-- /figures:\2 -->)", re.S)

Figure = Callable[[dict], float]


@dataclass(frozen=True)
class Goal:
    """A target: ``op`` is ">=" or "<="; ``lower`` says the value compared is the lower
    end of a confidence interval (quality gates)."""

    op: str
    value: float

    def met(self, measured: float) -> bool:
        return measured >= self.value if self.op == ">=" else measured <= self.value

    def __str__(self) -> str:
        return f"{self.op} {_number(self.value)}"


@dataclass(frozen=True)
class Row:
    """One published figure: the files it comes from and how to read it."""

    bench: str
    figure: str
    files: tuple[str, ...]
    value: Figure
    fmt: str = "{:.2f}"
    goal: Goal | None = None
    #: The same run's bound on this figure (tokens or a ratio of sums), if it has one.
    ceiling: Figure | None = None
    #: Shown instead of the value's status, e.g. why a difference is noise.
    remark: Callable[[dict], str] | None = None
    #: Why no configuration can reach the goal when the same run's ceiling misses it
    #: (said after "the goal is above this run's ceiling", which every such row gets).
    beyond_ceiling: str = ""
    #: Interval (low, high) around the value; a goal is then judged on the low end.
    interval: Callable[[dict], tuple[float, float]] | None = None
    tags: tuple[str, ...] = field(default=())


# --------------------------------------------------------------------------- helpers
def load(name: str) -> dict:
    path = RESULTS / name
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"figures: {path} is missing; a row names a file that is not "
                         f"committed under bench/results") from None


def machine(name: str, data: dict) -> str:
    """Where a file was run: its own provenance, else the hand-kept record."""
    prov = data.get("provenance") or {}
    if prov.get("cpu_model"):
        where = prov.get("gpu") or prov["cpu_model"]
        load = [(prov.get(k) or [None])[0] for k in ("load_before", "load_after")]
        loaded = f", load {load[0]:g} to {load[1]:g}" if None not in load else ""
        return f"{where} ({prov.get('cpu_count', '?')} CPUs{loaded})"
    recorded = json.loads(MACHINES.read_text()) if MACHINES.exists() else {}
    if name in recorded:
        return recorded[name]
    gpu = (data.get("machine") or {}).get("device_name")
    if gpu and gpu != "cpu":
        return gpu
    raise SystemExit(f"figures: {name} does not say where it was run: add it to "
                     f"{MACHINES.relative_to(ROOT)}")


def ratio_of_sums(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    return float(sum(numerator)) / float(sum(denominator))


def _number(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() and abs(value) >= 100 else f"{value:g}"


# --------------------------------------------------------------------------- readers
def _forced(d: dict) -> tuple[int, int]:
    """(agreeing, positions) of bench chunks-vllm's teacher-forced agreement."""
    positions = int(d["positions"])
    return round(d["teacher_forced_agreement"] * positions), positions


def _positions(d: dict, key: str = "top1_agreement_chunk_turns") -> tuple[int, int]:
    """(agreeing, positions) of a top-1 agreement share over the chunk turns' positions:
    the file's ``chunk_turn_positions``, or for older files the baseline's generated
    tokens on the turns that reused chunks."""
    positions = d.get("chunk_turn_positions")
    if positions is None:
        turns = [i for i, t in enumerate(d["chunk_reused_tokens"]) if t > 0]
        positions = sum(d["generated_tokens_baseline"][i] for i in turns)
    agreeing = round(d[key] * positions)
    if abs(agreeing / positions - d[key]) > 1e-9:
        raise SystemExit(f"figures: {key} does not match a whole count of {positions} "
                         "positions")
    return agreeing, int(positions)


def _memory_change(d: dict, key: str) -> list[float]:
    return [d[key][turn - 1] for turn in d["memory_change_turns"]]


def _vllm_same_tokens(d: dict) -> str:
    cached = {c: sum(v) for c, v in d["cached_tokens"].items()}
    same = sorted(c for c in ("connector", "connector_lru") if cached[c] == cached["ceiling"])
    if same:
        return (f"{' and '.join(same)} reuse the ceiling's own {cached['ceiling']:,} tokens: "
                "same tokens, timing difference is noise")
    return ""


def _warm_sum(d: dict, config: str) -> float:
    return float(sum(t for t, w in zip(d["ttft_ms"][config], d["warm_steps"], strict=True)
                     if w))


def _cross_sum(d: dict, config: str) -> float:
    return float(sum(d[f"{config}_ttft_ms"][i] for i in d["cross_replica_steps"]))


def _hints_same_tokens(d: dict) -> str:
    resume = d["resume"]
    if resume["connector"]["resume_computed_tokens"] == resume["connector_hints"][
            "resume_computed_tokens"]:
        return ("same tokens with and without hints: the DDR tier kept every paused "
                "agent, so hints had nothing to save")
    return ""


def _hints_bound(d: dict) -> float:
    """What hints could gain at most: the no-hint connector's resume TTFT over the
    ceiling's (a server whose KV holds every agent)."""
    resume = d["resume"]
    return round(resume["connector"]["resume_ttft_p50"] / resume["ceiling"]["resume_ttft_p50"], 3)


def _pause_rows(files: tuple[str, ...], where: str) -> list[Row]:
    """bench tool-pauses' three goals in one regime (``where``: its sizes)."""
    return [
        Row("tool-pauses", f"`resumed_hit_fraction`, connector with agent hints, {where}",
            files, lambda d: d["resumed_hit_fraction"]["connector_hints"], fmt="{:.3f}",
            goal=Goal(">=", 0.95), ceiling=lambda d: d["resumed_hit_fraction"]["ceiling"],
            remark=_hint_pins),
        Row("tool-pauses", f"resume TTFT p50 connector without hints / with hints, {where}",
            files, lambda d: d["speedup_hints_vs_nohints_p50"], goal=Goal(">=", 1.5),
            ceiling=_hints_bound),
        Row("tool-pauses", f"resume TTFT p50 APC / connector with hints, {where}", files,
            lambda d: d["speedup_vs_apc_p50"], goal=Goal(">=", 3.0),
            ceiling=lambda d: d["ceiling_vs_apc_p50"]),
        Row("tool-pauses", "other tenants' pinned blocks unpinned or evicted while a hint or "
            f"a session's keep pinned (counted by the connector), {where}", files,
            lambda d: d["other_tenant_pins_lost_to_hints"], fmt="{:.0f}",
            goal=Goal("<=", 0), remark=_pause_moves),
    ]


def _hint_pins(d: dict) -> str:
    counters = d["counters"]["connector_hints"]
    return (f"hints pinned {counters['hint_pinned_blocks']:.0f} blocks; the tenants' pin "
            f"quotas refused {counters['hint_pins_refused']:.0f}")


def _lmcache_reused(d: dict) -> str:
    return f"LMCache reused {d['resumed_hit_fraction']['lmcache']:.3f}"


def _pause_moves(d: dict) -> str:
    counters = d["counters"]["connector_hints"]
    return (f"paused sessions' blocks moved to the device tier: "
            f"{counters['pause_warmed_blocks']:.0f}")


def _replica_order(d: dict) -> str:
    return ("configurations ran in one fixed order (" + ", ".join(d["order"]) + "): "
            "the first server of a run is slow, so this is not an interleaved bound")


TTFT_SOURCE_NORESERVE = ("ttft-amd-source-noreserve.json", "ttft-amd-source-noreserve-run2.json",
                         "ttft-amd-source-noreserve-run3.json")
TTFT_SOURCE_RESERVE = ("ttft-amd-source-reserve.json",)
#: bench ttft with the independent references: a fresh TQ4 cache that no chunk path
#: wrote, beside the full float prefill every agreement is measured against
TTFT_GATE = ("ttft-amd-gate-noreserve.json",)
#: bench agents, interleaved on one transcript (the ceiling bounds it in tokens)
AGENTS = ("agents-amd-interleaved.json",)
AGENTS_VLLM = ("agents-vllm-cpu-k.json", "agents-vllm-cpu-l.json")
#: bench agents-vllm with every server up and the steps interleaved, one transcript
AGENTS_VLLM_INTERLEAVED = ("agents-vllm-amd-interleaved.json",)
#: bench ttft wrote turns 2-20 as ``speedup_total`` until it reported turn 1 too
EXCL_TURN1 = ("the same, turns 2-20 (these files' `speedup_total`; "
              "`speedup_total_excl_turn1` from now on)")
REPLICAS = tuple(f"replicas-cpu-r{i}.json" for i in range(1, 5))
#: bench tool-pauses, each resume a tool round: the default sizes (a DDR budget of 3
#: agents' prompts in fp16 bytes). The earlier files (tool-pauses-amd.json and
#: -small-ddr.json) sent each resume as a new user turn (docs/measurement-history.md).
TOOL_PAUSES = ("tool-pauses-amd-rounds.json",)
#: the same with a DDR budget of 0.8 agent prompts in fp16 bytes (~2.5 stored agents),
#: with paused sessions on the device tier first (before: -rounds-small-ddr.json)
TOOL_PAUSES_SMALL_DDR = ("tool-pauses-amd-lookahead-small-ddr.json",)
#: the small DDR tier with device_blocks 512: room for the hints' pins; hints take free
#: pin room only, paused sessions go to the device tier first, and the run counts other
#: tenants' pins lost (the first such run, before those changes:
#: tool-pauses-amd-rounds-small-ddr-dev512.json, docs/measurement-history.md)
TOOL_PAUSES_PIN_ROOM = ("tool-pauses-amd-lookahead-small-ddr-dev512-lmcache.json",
                        "tool-pauses-amd-lookahead-small-ddr-dev512.json")
#: bench replicas with every configuration's servers up and the steps interleaved
REPLICAS_INTERLEAVED = ("replicas-amd-interleaved.json",)
#: bench replicas with chunk reuse: local DDR tiers against the shared tier serving
#: prefix chunks and span objects, and its ceiling (one replica with chunk reuse)
REPLICAS_CHUNKS = ("replicas-amd-chunks.json",)
#: the same configurations since the connector attends through vLLM's kernels and counts
#: hops as the embedded engine does (session 34)
REPLICAS_CHUNKS_KERNELS = ("replicas-amd-chunks-kernels.json",)
#: session 35's connector (runs of chunks repaired once, placement by layer), AMD EPYC
REPLICAS_CHUNKS_LAYERS = ("replicas-amd-chunks-layers.json",)
#: the connector now (session 36's seams, hops and placement kernel), Intel Xeon
#: (session 37; the run's oracle did not fit in memory beside five servers)
REPLICAS_CHUNKS_NOW = ("replicas-intel-chunks.json",)
#: the same code with the oracle (chunk reuse's bound) beside local tiers and the shared
#: tier with chunk reuse (five servers: one replica with chunk reuse left out)
REPLICAS_CHUNKS_ORACLE_F32 = ("replicas-intel-chunks-oracle.json",)
#: the same configurations with the connector's projections in bfloat16 (session 38)
REPLICAS_CHUNKS_ORACLE_BF16 = ("replicas-intel-chunks-bf16.json",)
#: session 39's connector (a prompt's last message stored as a chunk)
REPLICAS_CHUNKS_ORACLE_TURNS = ("replicas-intel-chunks-turns.json",)
#: session 40's connector (its projections through vLLM's prepacked GEMM), three runs
REPLICAS_CHUNKS_ORACLE_ONEDNN = ("replicas-intel-chunks-onednn.json",
                                 "replicas-intel-chunks-onednn-2.json",
                                 "replicas-intel-chunks-onednn-3.json")
#: session 41's connector (passes of 64 tokens or more attend in bfloat16 on AMX; the
#: shared tier HEADs every chunk past the DDR hit, then looks spans up); the third run at
#: 357ae48, whose change leaves an AMX CPU's path as it was
REPLICAS_CHUNKS_ORACLE_BF16ATTN = ("replicas-intel-chunks-bf16attn.json",
                                   "replicas-intel-chunks-bf16attn-2.json",
                                   "replicas-intel-chunks-bf16attn-3.json")
#: the connector now (session 43): the shared tier's probe in doubling batches, the span
#: lookup beside it
REPLICAS_CHUNKS_ORACLE = ("replicas-intel-chunks-probe.json",
                          "replicas-intel-chunks-probe-2.json",
                          "replicas-intel-chunks-probe-3.json")
#: why chunk reuse across replicas stops at its ceiling
CHUNK_TURNS_COST = ("one replica that saw every turn still pays the connector's placement "
                    "and seams on every chunk turn (docs/chunks.md)")
#: the same schedule against one replica with prefix reuse only (prefix reuse's bound)
REPLICAS_CHUNKS_PREFIX = ("replicas-amd-chunks-prefix-ceiling.json",)
#: bench agents-vllm with chunk reuse beside prefix reuse, interleaved
AGENTS_VLLM_CHUNKS = ("agents-vllm-amd-chunks.json",)
#: the same since the connector attends through vLLM's kernels and counts hops as the
#: embedded engine does (session 34), two runs
AGENTS_VLLM_CHUNKS_KERNELS = ("agents-vllm-amd-chunks-kernels.json",
                              "agents-vllm-amd-chunks-kernels-2.json")
#: session 35's connector (runs of chunks repaired once, placement by layer), AMD EPYC
AGENTS_VLLM_CHUNKS_LAYERS = ("agents-vllm-amd-chunks-layers.json",)
#: session 37's connector (seams by what precedes them, hops by token, one kernel to
#: place; float32 projections), with the oracle (chunk reuse's bound) in the run, Intel Xeon
AGENTS_VLLM_CHUNKS_F32 = ("agents-vllm-intel-oracle.json", "agents-vllm-intel-oracle-2.json",
                          "agents-vllm-intel-oracle-3.json")
#: session 38's connector: its forward's projections in bfloat16 on AMX, the same machine
#: and configurations
AGENTS_VLLM_CHUNKS_BF16 = ("agents-vllm-intel-bf16.json", "agents-vllm-intel-bf16-2.json")
#: session 39's first step alone: the prompt's last, partial block saved (2be8207)
AGENTS_VLLM_CHUNKS_TAIL = ("agents-vllm-intel-tail.json",)
#: session 39's connector: the user's last message stored and registered as a chunk
#: (its partial block saved, its blocks no longer the volatile tail)
AGENTS_VLLM_CHUNKS_TURNS = ("agents-vllm-intel-turns.json", "agents-vllm-intel-turns-2.json")
#: session 40's connector: its bfloat16 projections through vLLM's prepacked oneDNN GEMM,
#: three runs
AGENTS_VLLM_CHUNKS_ONEDNN = ("agents-vllm-intel-onednn.json",
                             "agents-vllm-intel-onednn-2.json",
                             "agents-vllm-intel-onednn-3.json")
#: the connector now (session 41): passes of 64 tokens or more attend in bfloat16 on AMX
#: (the third run at 357ae48, whose change leaves an AMX CPU's path as it was)
AGENTS_VLLM_CHUNKS_NOW = ("agents-vllm-intel-bf16attn.json",
                          "agents-vllm-intel-bf16attn-2.json",
                          "agents-vllm-intel-bf16attn-3.json")
#: bench chunks-vllm: the RAG agent, documents reordered and changed every turn
CHUNKS_VLLM = ("chunks-vllm-amd.json",)
#: the same since the connector attends through vLLM's CPU kernels, with the oracle
#: (chunk reuse's bound) in the run and without APC (seven servers do not fit), session 34
CHUNKS_VLLM_KERNELS = ("chunks-vllm-amd-oracle.json", "chunks-vllm-amd-oracle-2.json")
#: the same code with hops counted as the embedded engine does: two runs with LMCache,
#: one without it and with 20 quality turns of 32 positions
CHUNKS_VLLM_HOPS = ("chunks-vllm-amd-hops.json", "chunks-vllm-amd-hops-2.json")
CHUNKS_VLLM_HOPS_QUALITY = ("chunks-vllm-amd-hops-quality640.json",)
#: session 35's connector (on the AMD EPYC VM): runs of chunks that sat together
#: repaired once, the rules' rest continuing the prefix hit, the range to the block
#: boundary after the last chunk, and moved chunks placed layer by layer
CHUNKS_VLLM_LAYERS = ("chunks-vllm-amd-layers.json", "chunks-vllm-amd-layers-2.json")
CHUNKS_VLLM_LAYERS_QUALITY = ("chunks-vllm-amd-layers-quality640.json",)
#: session 35's code (53c933a) on the Intel Xeon VM, the quality run's configuration:
#: the same-machine baseline of the runs below
CHUNKS_VLLM_LAYERS_INTEL = ("chunks-vllm-intel-session35-quality640.json",)
#: session 36's connector (on an Intel Xeon VM): seams only where the 16 tokens before a
#: chunk changed, hops by token, one fused kernel placing each layer; float32 projections
CHUNKS_VLLM_FUSED = ("chunks-vllm-intel-fused.json", "chunks-vllm-intel-fused-2.json")
CHUNKS_VLLM_FUSED_QUALITY = ("chunks-vllm-intel-fused-quality640.json",)
#: session 38's connector: its forward's projections in bfloat16 on AMX, the quality run's
#: configuration (20 turns of 32 forced positions)
CHUNKS_VLLM_BF16 = ("chunks-vllm-intel-bf16-quality640.json",)
#: session 39's connector (a prompt's last message stored as a chunk), the same
#: configuration
CHUNKS_VLLM_TURNS = ("chunks-vllm-intel-turns-quality640.json",)
#: the connector now (session 41: passes of 64 tokens or more attend in bfloat16 on AMX),
#: the same configuration
CHUNKS_VLLM_NOW = ("chunks-vllm-intel-bf16attn-quality640.json",)
#: the same workload without APC and LMCache, 20 quality turns of 32 forced positions
#: (480 positions judged: the turns after the first chunk turns), session 32
CHUNKS_VLLM_QUALITY = ("chunks-vllm-amd-quality640.json",)
#: the same with every document prefilled once before the schedule (--ingest), each
#: chunk's first 4 tokens repaired, then 16 (--repair-first 16)
CHUNKS_VLLM_INGEST = ("chunks-vllm-amd-ingest.json",)
CHUNKS_VLLM_INGEST_16 = ("chunks-vllm-amd-ingest-repair16.json",)
#: the same with CacheBlend's selection: 15% of the moved tokens (--repair-ratio 0.15)
CHUNKS_VLLM_INGEST_RATIO = ("chunks-vllm-amd-ingest-ratio15.json",)


def _apc_over_chunks(label: str, files: tuple[str, ...], **kwargs: Any) -> Row:
    """An agents-vllm row: warm-step TTFT p50 APC / chunk reuse, the oracle's bound as
    ceiling."""
    return Row("agents-vllm", label, files, lambda d: d["chunks"]["warm_speedup_vs_apc_p50"],
               ceiling=lambda d: d["chunks"]["warm_bound_vs_apc_p50"], **kwargs)


def _local_over_shared_chunks(label: str, files: tuple[str, ...], **kwargs: Any) -> Row:
    """A replicas row: TTFT p50 local tiers / the shared tier with chunk reuse, the
    oracle's bound as ceiling."""
    return Row("replicas", label, files, lambda d: d["speedup_shared_chunks_vs_local_p50"],
               ceiling=lambda d: d["chunk_bound_vs_local_p50"], **kwargs)

ROWS: tuple[Row, ...] = (
    # ttft: the 20-turn agent replay (docs/chunks.md, docs/reservations.md)
    Row("ttft", "memory-change turns: tokens computed (sum of the 5 turns); ceiling: "
        "every cached chunk moved in, none repaired (run 1)", TTFT_SOURCE_NORESERVE[:1],
        lambda d: sum(_memory_change(d, "computed_tokens")), fmt="{:,.0f}",
        ceiling=lambda d: sum(_memory_change(d, "computed_tokens_chunk_ceiling")),
        tags=("readme",)),
    Row("ttft", "`speedup_memory_change_p50`, `--no-reserve`", TTFT_SOURCE_NORESERVE,
        lambda d: d["speedup_memory_change_p50"], goal=Goal(">=", 3.5), tags=("readme",)),
    Row("ttft", "TTFT sum full prefill / contextkit, all 20 turns (turn 1 included), "
        "`--no-reserve`", TTFT_SOURCE_NORESERVE,
        lambda d: ratio_of_sums(d["ttft_ms_baseline"], d["ttft_ms_contextkit"])),
    Row("ttft", EXCL_TURN1 + ", `--no-reserve`", TTFT_SOURCE_NORESERVE,
        lambda d: ratio_of_sums(d["ttft_ms_baseline"][1:], d["ttft_ms_contextkit"][1:])),
    Row("ttft", "TTFT sum full prefill / contextkit, all 20 turns (turn 1 included), "
        "reservations on", TTFT_SOURCE_RESERVE,
        lambda d: ratio_of_sums(d["ttft_ms_baseline"], d["ttft_ms_contextkit"]),
        tags=("readme",)),
    Row("ttft", EXCL_TURN1 + ", reservations on", TTFT_SOURCE_RESERVE,
        lambda d: ratio_of_sums(d["ttft_ms_baseline"][1:], d["ttft_ms_contextkit"][1:]),
        goal=Goal(">=", 4.5), tags=("readme",)),
    Row("ttft", "chunk turns: teacher-forced top-1 agreement with a full float prefill, "
        "95% Wilson interval over positions (run 1)", TTFT_SOURCE_NORESERVE[:1],
        lambda d: d["top1_agreement_chunk_turns"], fmt="{:.4f}", goal=Goal(">=", 0.97),
        interval=lambda d: wilson(*_positions(d))),
    Row("ttft", "chunk turns, re-measured: teacher-forced top-1 agreement with a full "
        "float prefill, 95% Wilson interval over positions", TTFT_GATE,
        lambda d: d["top1_agreement_chunk_turns"], fmt="{:.4f}", goal=Goal(">=", 0.97),
        interval=lambda d: wilson(*_positions(d, "top1_agreement_chunk_turns")),
        tags=("readme",)),
    Row("ttft", "the same positions on a fresh TQ4 cache that prefill alone filled (the "
        "quality ceiling: no chunk path wrote it)", TTFT_GATE,
        lambda d: d["top1_agreement_chunk_turns_tq4_prefill_only"], fmt="{:.4f}",
        interval=lambda d: wilson(*_positions(d, "top1_agreement_chunk_turns_tq4_prefill_only"))),
    Row("ttft", "chunk turns, re-measured: perplexity ratio to a full float prefill; the "
        "fresh TQ4 cache's beside it", TTFT_GATE, lambda d: d["ppl_ratio_chunk_turns"],
        fmt="{:.3f}", goal=Goal("<=", 1.03),
        remark=lambda d: ("fresh TQ4 cache: "
                          f"{d['ppl_ratio_chunk_turns_tq4_prefill_only']:.3f}")),
    Row("ttft", "chunk turns: perplexity ratio to a full float prefill (run 1)",
        TTFT_SOURCE_NORESERVE[:1], lambda d: d["ppl_ratio_chunk_turns"], fmt="{:.3f}",
        goal=Goal("<=", 1.03)),
    # agents: 6 agents sharing a cache too small for all of them (docs/agents.md)
    Row("agents", "tokens computed, lru; ceiling: the same steps on a cache that holds "
        "every agent", AGENTS, lambda d: d["policies"]["lru"]["computed_tokens"],
        fmt="{:,.0f}", ceiling=lambda d: d["ceiling"]["computed_tokens"]),
    Row("agents", "tokens computed, semantic", AGENTS,
        lambda d: d["policies"]["semantic"]["computed_tokens"], fmt="{:,.0f}",
        ceiling=lambda d: d["ceiling"]["computed_tokens"]),
    Row("agents", "tokens computed, semantic+ooda (goal: under the prefix-only floor "
        "of the same run)", AGENTS,
        lambda d: d["policies"]["semantic+ooda"]["computed_tokens"], fmt="{:,.0f}",
        ceiling=lambda d: d["ceiling"]["computed_tokens"], tags=("readme",),
        remark=lambda d: ("under the prefix-only floor of "
                          f"{d['ceiling']['computed_tokens_prefix_only']:,} tokens"
                          if d["policies"]["semantic+ooda"]["computed_tokens"]
                          < d["ceiling"]["computed_tokens_prefix_only"]
                          else "not under the prefix-only floor")),
    Row("agents", "share of lru's avoidable tokens (lru's over the ceiling's) that "
        "semantic+ooda avoided", AGENTS,
        lambda d: d["bounds"]["semantic+ooda"]["ceiling_fraction"], fmt="{:.2f}"),
    Row("agents", "TTFT sum lru / semantic+ooda, warm steps (a ratio of sums of the same "
        "steps); ceiling: lru / the cache that holds every agent", AGENTS,
        lambda d: d["speedup_vs_lru_total"]["semantic+ooda"],
        ceiling=lambda d: d["ceiling"]["speedup_vs_lru_total"],
        remark=lambda d: ("same tokens as the ceiling: timing difference is noise"
                          if d["bounds"]["semantic+ooda"]["ttft_vs_ceiling"] == SAME_TOKENS
                          else "")),
    Row("agents", "pinned blocks evicted, semantic+ooda", AGENTS,
        lambda d: d["policies"]["semantic+ooda"]["pinned_blocks_evicted"], fmt="{:.0f}",
        goal=Goal("<=", 0)),
    # agents-vllm: six agents on one vLLM CPU server with KV for about two
    Row("agents-vllm", "prompt tokens served from cache, connector; ceiling: a server "
        "whose KV holds every agent", AGENTS_VLLM,
        lambda d: sum(d["cached_tokens"]["connector"]), fmt="{:,.0f}",
        ceiling=lambda d: sum(d["cached_tokens"]["ceiling"]), remark=_vllm_same_tokens,
        tags=("readme",)),
    Row("agents-vllm", "prompt tokens computed, connector (servers side by side, steps "
        "interleaved, one transcript); ceiling: a server whose KV holds every agent",
        AGENTS_VLLM_INTERLEAVED, lambda d: d["hit_tokens"]["connector"]["computed"],
        fmt="{:,.0f}", ceiling=lambda d: d["hit_tokens"]["ceiling"]["computed"],
        remark=lambda d: ("same tokens as the ceiling: timing difference is noise"
                          if d["bounds"]["connector"]["ttft_vs_ceiling"] == SAME_TOKENS
                          else "")),
    Row("agents-vllm", "prompt tokens computed, vLLM's prefix caching (APC), the same run",
        AGENTS_VLLM_INTERLEAVED, lambda d: d["hit_tokens"]["apc"]["computed"],
        fmt="{:,.0f}", ceiling=lambda d: d["hit_tokens"]["ceiling"]["computed"]),
    Row("agents-vllm", "warm-step TTFT sum APC / connector (a ratio of sums of the same "
        "steps); ceiling: APC / the server that holds every agent", AGENTS_VLLM_INTERLEAVED,
        lambda d: _warm_sum(d, "apc") / _warm_sum(d, "connector"), goal=Goal(">=", 3.0),
        ceiling=lambda d: _warm_sum(d, "apc") / _warm_sum(d, "ceiling"),
        beyond_ceiling="a server that holds every agent reuses every prefix, so prefix "
        "reuse alone cannot reach it"),
    Row("agents-vllm", "prompt tokens served from cache, vLLM's prefix caching (APC)",
        AGENTS_VLLM, lambda d: sum(d["cached_tokens"]["apc"]), fmt="{:,.0f}",
        ceiling=lambda d: sum(d["cached_tokens"]["ceiling"])),
    Row("agents-vllm", "prompt tokens served from cache, LMCache", AGENTS_VLLM,
        lambda d: sum(d["cached_tokens"]["lmcache"]), fmt="{:,.0f}",
        ceiling=lambda d: sum(d["cached_tokens"]["ceiling"])),
    # replicas: six agents alternating between two vLLM CPU replicas
    Row("replicas", "`cross_replica_hit_rate` (shared S3 tier)", REPLICAS,
        lambda d: d["cross_replica_hit_rate"], fmt="{:.3f}", goal=Goal(">=", 0.9),
        tags=("readme",)),
    Row("replicas", "TTFT sum local DDR / shared tier over the cross-replica turns "
        "(servers side by side, steps interleaved); ceiling: local / one replica that saw "
        "every turn", REPLICAS_INTERLEAVED,
        lambda d: _cross_sum(d, "local") / _cross_sum(d, "shared"), goal=Goal(">=", 2.0),
        ceiling=lambda d: _cross_sum(d, "local") / _cross_sum(d, "single"),
        beyond_ceiling="one replica that saw every turn reuses every prefix, so prefix "
        "reuse alone cannot reach it"),
    Row("replicas", "`cross_replica_hit_rate` (shared S3 tier), the interleaved run",
        REPLICAS_INTERLEAVED, lambda d: d["cross_replica_hit_rate"], fmt="{:.3f}",
        goal=Goal(">=", 0.9)),
    Row("replicas", "TTFT sum local DDR / shared tier (same 24 turns)", REPLICAS,
        lambda d: ratio_of_sums(d["local_ttft_ms"], d["shared_ttft_ms"]),
        goal=Goal(">=", 2.0), remark=_replica_order),
    Row("chunks-vllm", "chunk turns: TTFT p50 prefix-only connector / chunk reuse; ceiling: "
        "the oracle (vLLM computing only the tokens no earlier prompt of the tenant held)",
        CHUNKS_VLLM_NOW, lambda d: d["speedup_chunks_vs_prefix_p50"],
        ceiling=lambda d: d["bound_chunks_vs_prefix_p50"], goal=Goal(">=", 2.5),
        tags=("readme",)),
    Row("chunks-vllm", "chunk turns: share of the oracle's TTFT p50 reached (oracle / chunk "
        "reuse)", CHUNKS_VLLM_NOW, lambda d: d["ceiling_fraction"],
        fmt="{:.3f}"),
    Row("chunks-vllm", "chunk turns: tokens computed, chunk reuse (the oracle's: ceiling)",
        CHUNKS_VLLM_NOW,
        lambda d: d["computed_tokens"]["connector_chunks"], fmt="{:,.0f}",
        ceiling=lambda d: d["computed_tokens"]["oracle"]),
    Row("chunks-vllm", "chunk turns: TTFT p50 of prefix reuse's bound (a server whose KV "
        "holds every agent) / chunk reuse", CHUNKS_VLLM_NOW,
        lambda d: d["speedup_vs_prefix_ceiling_p50"]),
    Row("chunks-vllm", "chunk turns: tokens computed, chunk reuse / prefix-only connector",
        CHUNKS_VLLM_NOW, lambda d: d["tokens_computed_vs_prefix"],
        fmt="{:.3f}", goal=Goal("<=", 0.4)),
    Row("chunks-vllm", "session 39's connector (float32 attention): chunk turns, TTFT p50 "
        "prefix-only connector / chunk reuse (the oracle's: ceiling)", CHUNKS_VLLM_TURNS,
        lambda d: d["speedup_chunks_vs_prefix_p50"],
        ceiling=lambda d: d["bound_chunks_vs_prefix_p50"], goal=Goal(">=", 2.5)),
    Row("chunks-vllm", "session 39's connector (float32 attention): chunk turns, 480 "
        "positions: teacher-forced top-1 agreement / perplexity ratio / mean KL to a full "
        "prefill", CHUNKS_VLLM_TURNS, lambda d: d["teacher_forced_agreement"],
        fmt="{:.4f}", remark=lambda d: f"ppl ratio {d['ppl_ratio']:.4f}, mean KL "
        f"{d['mean_kl']:.4f}"),
    Row("chunks-vllm", "session 38's connector (before a prompt's last message was a "
        "chunk): chunk turns, TTFT p50 prefix-only connector / chunk reuse (the oracle's: "
        "ceiling)", CHUNKS_VLLM_BF16, lambda d: d["speedup_chunks_vs_prefix_p50"],
        ceiling=lambda d: d["bound_chunks_vs_prefix_p50"], goal=Goal(">=", 2.5)),
    Row("chunks-vllm", "session 38's connector: chunk turns, tokens computed, chunk reuse "
        "(the oracle's: ceiling)", CHUNKS_VLLM_BF16,
        lambda d: d["computed_tokens"]["connector_chunks"], fmt="{:,.0f}",
        ceiling=lambda d: d["computed_tokens"]["oracle"]),
    Row("chunks-vllm", "session 36's connector (float32 projections): chunk turns, TTFT p50 "
        "prefix-only connector / chunk reuse (the oracle's: ceiling)",
        CHUNKS_VLLM_FUSED + CHUNKS_VLLM_FUSED_QUALITY,
        lambda d: d["speedup_chunks_vs_prefix_p50"],
        ceiling=lambda d: d["bound_chunks_vs_prefix_p50"], goal=Goal(">=", 2.5)),
    Row("chunks-vllm", "session 36's connector: chunk turns, TTFT p50 LMCache / chunk reuse; "
        "ceiling: LMCache / the oracle", CHUNKS_VLLM_FUSED, lambda d: d["speedup_vs_lmcache_p50"],
        ceiling=lambda d: d["bound_vs_lmcache_p50"], goal=Goal(">=", 2.0)),
    Row("chunks-vllm", "session 36's connector: chunk turns, teacher-forced top-1 agreement "
        "with a full prefill, 95% Wilson interval over positions", CHUNKS_VLLM_FUSED,
        lambda d: d["teacher_forced_agreement"], fmt="{:.4f}", goal=Goal(">=", 0.97),
        interval=lambda d: wilson(*_forced(d))),
    Row("chunks-vllm", "the same positions through the prefix-only connector (its TQ4 "
        "cache's own agreement)", CHUNKS_VLLM_FUSED,
        lambda d: d["quality_prefix_only"]["teacher_forced_agreement"], fmt="{:.4f}"),
    Row("chunks-vllm", "session 36's connector: chunk turns, perplexity ratio to a full "
        "prefill", CHUNKS_VLLM_FUSED,
        lambda d: d["ppl_ratio"], fmt="{:.4f}", goal=Goal("<=", 1.03)),
    Row("chunks-vllm", "session 36's connector: chunk turns, mean KL to a full prefill (its "
        "top 20)", CHUNKS_VLLM_FUSED,
        lambda d: d["mean_kl"], fmt="{:.4f}", goal=Goal("<=", 0.02)),
    Row("chunks-vllm", "chunk turns, 480 positions over 15 turns: teacher-forced top-1 "
        "agreement with a full prefill, 95% Wilson interval", CHUNKS_VLLM_NOW,
        lambda d: d["teacher_forced_agreement"], fmt="{:.4f}", goal=Goal(">=", 0.97),
        interval=lambda d: wilson(*_forced(d))),
    Row("chunks-vllm", "chunk turns, 480 positions: perplexity ratio to a full prefill",
        CHUNKS_VLLM_NOW, lambda d: d["ppl_ratio"], fmt="{:.4f}",
        goal=Goal("<=", 1.03)),
    Row("chunks-vllm", "chunk turns, 480 positions: mean KL to a full prefill (its top 20)",
        CHUNKS_VLLM_NOW, lambda d: d["mean_kl"], fmt="{:.4f}", goal=Goal("<=", 0.02)),
    Row("chunks-vllm", "the same 480 positions through the prefix-only connector: agreement",
        CHUNKS_VLLM_NOW,
        lambda d: d["quality_prefix_only"]["teacher_forced_agreement"], fmt="{:.4f}"),
    Row("chunks-vllm", "session 35's connector, on the AMD EPYC VM (a seam per moved chunk "
        "unless it continues the one before it in the same stored run, hops by block, "
        "placement in torch passes): TTFT p50 prefix-only connector / chunk reuse (the "
        "oracle's: ceiling)", CHUNKS_VLLM_LAYERS + CHUNKS_VLLM_LAYERS_QUALITY,
        lambda d: d["speedup_chunks_vs_prefix_p50"],
        ceiling=lambda d: d["bound_chunks_vs_prefix_p50"], goal=Goal(">=", 2.5)),
    Row("chunks-vllm", "session 35's connector on the Intel Xeon VM (the quality run's "
        "configuration, 53c933a): TTFT p50 prefix-only connector / chunk reuse (the oracle's: "
        "ceiling)", CHUNKS_VLLM_LAYERS_INTEL, lambda d: d["speedup_chunks_vs_prefix_p50"],
        ceiling=lambda d: d["bound_chunks_vs_prefix_p50"], goal=Goal(">=", 2.5)),
    Row("chunks-vllm", "session 35's connector on the Intel Xeon VM: tokens computed, chunk "
        "reuse (the oracle's: ceiling)", CHUNKS_VLLM_LAYERS_INTEL,
        lambda d: d["computed_tokens"]["connector_chunks"], fmt="{:,.0f}",
        ceiling=lambda d: d["computed_tokens"]["oracle"]),
    Row("chunks-vllm", "session 35's connector: share of the oracle's TTFT p50 reached",
        CHUNKS_VLLM_LAYERS + CHUNKS_VLLM_LAYERS_QUALITY, lambda d: d["ceiling_fraction"],
        fmt="{:.3f}"),
    Row("chunks-vllm", "session 35's connector: tokens computed, chunk reuse (the oracle's: "
        "ceiling)", CHUNKS_VLLM_LAYERS + CHUNKS_VLLM_LAYERS_QUALITY,
        lambda d: d["computed_tokens"]["connector_chunks"], fmt="{:,.0f}",
        ceiling=lambda d: d["computed_tokens"]["oracle"]),
    Row("chunks-vllm", "session 35's connector: TTFT p50 LMCache / chunk reuse",
        CHUNKS_VLLM_LAYERS, lambda d: d["speedup_vs_lmcache_p50"], goal=Goal(">=", 2.0)),
    Row("chunks-vllm", "session 34's connector (a seam per moved chunk, the range to the "
        "last chunk's block-aligned end, every layer placed at once): TTFT p50 prefix-only "
        "connector / chunk reuse (the oracle's: ceiling)",
        CHUNKS_VLLM_HOPS + CHUNKS_VLLM_HOPS_QUALITY,
        lambda d: d["speedup_chunks_vs_prefix_p50"],
        ceiling=lambda d: d["bound_chunks_vs_prefix_p50"], goal=Goal(">=", 2.5)),
    Row("chunks-vllm", "session 34's connector: tokens computed, chunk reuse (the oracle's: "
        "ceiling)", CHUNKS_VLLM_HOPS + CHUNKS_VLLM_HOPS_QUALITY,
        lambda d: d["computed_tokens"]["connector_chunks"], fmt="{:,.0f}",
        ceiling=lambda d: d["computed_tokens"]["oracle"]),
    Row("chunks-vllm", "session 34's connector: TTFT p50 LMCache / chunk reuse",
        CHUNKS_VLLM_HOPS, lambda d: d["speedup_vs_lmcache_p50"], goal=Goal(">=", 2.0)),
    Row("chunks-vllm", "before the hop rule (every block after a moved chunk counted a hop "
        "further), vLLM's kernels: TTFT p50 prefix-only connector / chunk reuse (the oracle's: "
        "ceiling)", CHUNKS_VLLM_KERNELS, lambda d: d["speedup_chunks_vs_prefix_p50"],
        ceiling=lambda d: d["bound_chunks_vs_prefix_p50"], goal=Goal(">=", 2.5)),
    Row("chunks-vllm", "before the hop rule, vLLM's kernels: tokens computed, chunk reuse "
        "(the oracle's: ceiling)", CHUNKS_VLLM_KERNELS,
        lambda d: d["computed_tokens"]["connector_chunks"], fmt="{:,.0f}",
        ceiling=lambda d: d["computed_tokens"]["oracle"]),
    Row("chunks-vllm", "session 32's connector (torch SDPA over a copy of the context, the "
        "old hop rule): TTFT p50 prefix-only connector / chunk reuse",
        CHUNKS_VLLM + CHUNKS_VLLM_QUALITY, lambda d: d["speedup_chunks_vs_prefix_p50"]),
    Row("chunks-vllm", "session 32's connector: TTFT p50 APC / chunk reuse", CHUNKS_VLLM,
        lambda d: d["speedup_vs_apc_p50"]),
    Row("chunks-vllm", "session 32's connector, 480 positions: teacher-forced top-1 "
        "agreement with a full prefill, 95% Wilson interval", CHUNKS_VLLM_QUALITY,
        lambda d: d["teacher_forced_agreement"], fmt="{:.4f}", goal=Goal(">=", 0.97),
        interval=lambda d: wilson(*_forced(d))),
    Row("chunks-vllm", "`--ingest` (documents prefilled when they enter the store): TTFT "
        "p50 prefix-only connector / chunk reuse", CHUNKS_VLLM_INGEST,
        lambda d: d["speedup_chunks_vs_prefix_p50"], goal=Goal(">=", 2.5)),
    Row("chunks-vllm", "`--ingest`: tokens computed, chunk reuse / prefix-only connector",
        CHUNKS_VLLM_INGEST, lambda d: d["tokens_computed_vs_prefix"], fmt="{:.3f}",
        goal=Goal("<=", 0.4)),
    Row("chunks-vllm", "`--ingest`: teacher-forced top-1 agreement with a full prefill",
        CHUNKS_VLLM_INGEST, lambda d: d["teacher_forced_agreement"], fmt="{:.4f}",
        goal=Goal(">=", 0.97), interval=lambda d: wilson(*_forced(d))),
    Row("chunks-vllm", "`--ingest`: mean KL to a full prefill", CHUNKS_VLLM_INGEST,
        lambda d: d["mean_kl"], fmt="{:.4f}", goal=Goal("<=", 0.02)),
    Row("chunks-vllm", "`--ingest --repair-first 16`: teacher-forced top-1 agreement",
        CHUNKS_VLLM_INGEST_16, lambda d: d["teacher_forced_agreement"], fmt="{:.4f}",
        goal=Goal(">=", 0.97), interval=lambda d: wilson(*_forced(d))),
    Row("chunks-vllm", "`--ingest --repair-first 16`: TTFT p50 prefix-only connector / "
        "chunk reuse", CHUNKS_VLLM_INGEST_16, lambda d: d["speedup_chunks_vs_prefix_p50"],
        goal=Goal(">=", 2.5)),
    Row("chunks-vllm", "`--ingest --repair-ratio 0.15` (CacheBlend's selection at layer 1): "
        "teacher-forced top-1 agreement", CHUNKS_VLLM_INGEST_RATIO,
        lambda d: d["teacher_forced_agreement"], fmt="{:.4f}", goal=Goal(">=", 0.97),
        interval=lambda d: wilson(*_forced(d))),
    Row("chunks-vllm", "`--ingest --repair-ratio 0.15`: mean KL to a full prefill",
        CHUNKS_VLLM_INGEST_RATIO, lambda d: d["mean_kl"], fmt="{:.4f}",
        goal=Goal("<=", 0.02)),
    Row("chunks-vllm", "`--ingest --repair-ratio 0.15`: TTFT p50 prefix-only connector / "
        "chunk reuse", CHUNKS_VLLM_INGEST_RATIO, lambda d: d["speedup_chunks_vs_prefix_p50"],
        goal=Goal(">=", 2.5)),
    Row("agents-vllm", "tokens computed with chunk reuse (`connector_chunks`); ceiling: the "
        "oracle (vLLM computing only what the tenant never sent, past its longest known "
        "prefix)", AGENTS_VLLM_CHUNKS_NOW,
        lambda d: d["chunks"]["computed_tokens"]["connector_chunks"], fmt="{:,.0f}",
        ceiling=lambda d: d["chunks"]["computed_tokens"]["oracle"],
        remark=lambda d: (f"prefix reuse's bound (a server whose KV holds every agent) "
                          f"computed {d['chunks']['computed_tokens']['ceiling']:,}; the "
                          "prefix-only connector "
                          f"{d['chunks']['computed_tokens']['connector']:,}")),
    _apc_over_chunks("warm-step TTFT p50 APC / chunk reuse; ceiling: APC / the oracle",
                     AGENTS_VLLM_CHUNKS_NOW, goal=Goal(">=", 3.0), tags=("readme",)),
    Row("agents-vllm", "warm-step TTFT p50: share of the oracle's reached (oracle / chunk "
        "reuse)", AGENTS_VLLM_CHUNKS_NOW,
        lambda d: d["chunks"]["warm_speedup_vs_oracle_p50"], fmt="{:.3f}"),
    Row("agents-vllm", "warm-step TTFT p50 of prefix reuse's bound (a server whose KV holds "
        "every agent) / chunk reuse", AGENTS_VLLM_CHUNKS_NOW,
        lambda d: d["chunks"]["warm_speedup_vs_ceiling_p50"]),
    Row("agents-vllm", "warm-step TTFT p50 prefix-only connector / chunk reuse; ceiling: "
        "the prefix-only connector / the oracle", AGENTS_VLLM_CHUNKS_NOW,
        lambda d: d["chunks"]["warm_speedup_vs_connector_p50"],
        ceiling=lambda d: d["chunks"]["warm_bound_vs_connector_p50"]),
    _apc_over_chunks("session 40's connector (float32 attention): warm-step TTFT p50 APC / "
                     "chunk reuse; ceiling: APC / the oracle", AGENTS_VLLM_CHUNKS_ONEDNN),
    Row("agents-vllm", "session 40's connector (float32 attention): warm-step TTFT p50: "
        "share of the oracle's reached", AGENTS_VLLM_CHUNKS_ONEDNN,
        lambda d: d["chunks"]["warm_speedup_vs_oracle_p50"], fmt="{:.3f}"),
    _apc_over_chunks("session 39's connector (projections through torch's linear): "
                     "warm-step TTFT p50 APC / chunk reuse; ceiling: APC / the oracle",
                     AGENTS_VLLM_CHUNKS_TURNS),
    Row("agents-vllm", "session 39's connector (projections through torch's linear): "
        "warm-step TTFT p50: share of the oracle's reached", AGENTS_VLLM_CHUNKS_TURNS,
        lambda d: d["chunks"]["warm_speedup_vs_oracle_p50"], fmt="{:.3f}"),
    Row("agents-vllm", "session 38's connector (before the last message was a chunk): "
        "tokens computed with chunk reuse", AGENTS_VLLM_CHUNKS_BF16,
        lambda d: d["chunks"]["computed_tokens"]["connector_chunks"], fmt="{:,.0f}"),
    _apc_over_chunks("session 38's connector (before the last message was a chunk): "
                     "warm-step TTFT p50 APC / chunk reuse; ceiling: APC / the oracle",
                     AGENTS_VLLM_CHUNKS_BF16),
    Row("agents-vllm", "the prompt's partial block saved, the message's other blocks still "
        "volatile (2be8207): tokens computed with chunk reuse", AGENTS_VLLM_CHUNKS_TAIL,
        lambda d: d["chunks"]["computed_tokens"]["connector_chunks"], fmt="{:,.0f}"),
    _apc_over_chunks("the prompt's partial block saved, the message's other blocks still "
                     "volatile (2be8207): warm-step TTFT p50 APC / chunk reuse; ceiling: "
                     "APC / the oracle", AGENTS_VLLM_CHUNKS_TAIL),
    _apc_over_chunks("session 37's connector (float32 projections): warm-step TTFT p50 "
                     "APC / chunk reuse; ceiling: APC / the oracle", AGENTS_VLLM_CHUNKS_F32),
    Row("agents-vllm", "session 37's connector (float32 projections): share of the oracle's "
        "warm-step TTFT p50 reached", AGENTS_VLLM_CHUNKS_F32,
        lambda d: d["chunks"]["warm_speedup_vs_oracle_p50"], fmt="{:.3f}"),
    Row("agents-vllm", "session 35's connector (AMD EPYC): tokens computed with chunk reuse",
        AGENTS_VLLM_CHUNKS_LAYERS,
        lambda d: d["chunks"]["computed_tokens"]["connector_chunks"], fmt="{:,.0f}"),
    Row("agents-vllm", "session 35's connector (AMD EPYC): warm-step TTFT p50 APC / chunk "
        "reuse", AGENTS_VLLM_CHUNKS_LAYERS, lambda d: d["chunks"]["warm_speedup_vs_apc_p50"]),
    Row("agents-vllm", "session 34's connector (a seam per moved chunk, every layer placed "
        "at once): tokens computed with chunk reuse", AGENTS_VLLM_CHUNKS_KERNELS,
        lambda d: d["chunks"]["computed_tokens"]["connector_chunks"], fmt="{:,.0f}"),
    Row("agents-vllm", "session 34's connector: warm-step TTFT p50 APC / chunk reuse",
        AGENTS_VLLM_CHUNKS_KERNELS, lambda d: d["chunks"]["warm_speedup_vs_apc_p50"]),
    Row("agents-vllm", "session 32's connector (torch SDPA, the old hop rule): tokens "
        "computed with chunk reuse", AGENTS_VLLM_CHUNKS,
        lambda d: d["chunks"]["computed_tokens"]["connector_chunks"], fmt="{:,.0f}"),
    Row("agents-vllm", "session 32's connector: warm-step TTFT p50 APC / chunk reuse",
        AGENTS_VLLM_CHUNKS, lambda d: d["chunks"]["warm_speedup_vs_apc_p50"]),
    Row("replicas", "chunk reuse across replicas: TTFT sum local DDR / shared tier with "
        "chunk reuse over the cross-replica turns (steps interleaved); ceiling: local / one "
        "replica with chunk reuse that saw every turn", REPLICAS_CHUNKS_NOW,
        lambda d: _cross_sum(d, "local") / _cross_sum(d, "shared_chunks"),
        goal=Goal(">=", 2.0),
        ceiling=lambda d: _cross_sum(d, "local") / _cross_sum(d, "single_chunks"),
        beyond_ceiling=CHUNK_TURNS_COST),
    Row("replicas", "chunk reuse across replicas: TTFT p50 local / shared tier with chunk "
        "reuse, cross-replica turns; ceiling: local / one replica with chunk reuse",
        REPLICAS_CHUNKS_NOW, lambda d: d["speedup_shared_chunks_vs_local_p50"],
        goal=Goal(">=", 2.0), ceiling=lambda d: d["bound_shared_chunks_vs_local_p50"],
        beyond_ceiling=CHUNK_TURNS_COST),
    _local_over_shared_chunks(
        "chunk reuse across replicas: TTFT p50 local / shared tier with chunk reuse, "
        "cross-replica turns; ceiling: local / the oracle (one replica computing only what "
        "the tenant never sent, past its longest known prefix)", REPLICAS_CHUNKS_ORACLE,
        goal=Goal(">=", 2.0)),
    Row("replicas", "chunk reuse across replicas: TTFT p50 share of the oracle's reached "
        "(oracle / shared tier with chunk reuse), cross-replica turns", REPLICAS_CHUNKS_ORACLE,
        lambda d: d["oracle_fraction_chunks"], fmt="{:.3f}"),
    Row("replicas", "chunk reuse across replicas: shared-tier HEADs per step",
        REPLICAS_CHUNKS_ORACLE, lambda d: d["shared_tier"]["shared_chunks"]["heads_per_step"],
        fmt="{:.1f}", remark=lambda d: (
            f"GETs {d['shared_tier']['shared_chunks']['gets_per_step']:.1f}, PUTs "
            f"{d['shared_tier']['shared_chunks']['puts_per_step']:.1f} per step")),
    _local_over_shared_chunks(
        "session 41's connector (a HEAD for every chunk past the DDR hit): TTFT p50 local / "
        "shared tier with chunk reuse, cross-replica turns; ceiling: local / the oracle",
        REPLICAS_CHUNKS_ORACLE_BF16ATTN),
    Row("replicas", "session 41's connector: TTFT p50 share of the oracle's reached, "
        "cross-replica turns", REPLICAS_CHUNKS_ORACLE_BF16ATTN,
        lambda d: d["oracle_fraction_chunks"], fmt="{:.3f}"),
    Row("replicas", "session 41's connector: shared-tier HEADs per step",
        REPLICAS_CHUNKS_ORACLE_BF16ATTN,
        lambda d: d["shared_tier"]["shared_chunks"]["heads_per_step"], fmt="{:.1f}"),
    _local_over_shared_chunks(
        "session 40's connector (float32 attention): TTFT p50 local / shared tier with "
        "chunk reuse, cross-replica turns; ceiling: local / the oracle",
        REPLICAS_CHUNKS_ORACLE_ONEDNN),
    _local_over_shared_chunks(
        "session 39's connector (projections through torch's linear): TTFT p50 local / "
        "shared tier with chunk reuse, cross-replica turns; ceiling: local / the oracle",
        REPLICAS_CHUNKS_ORACLE_TURNS),
    _local_over_shared_chunks(
        "session 38's connector (before a prompt's last message was a chunk): TTFT p50 "
        "local / shared tier with chunk reuse, cross-replica turns; ceiling: local / the "
        "oracle", REPLICAS_CHUNKS_ORACLE_BF16),
    Row("replicas", "session 38's connector: prompt tokens computed by the shared tier with "
        "chunk reuse (the oracle's: ceiling)", REPLICAS_CHUNKS_ORACLE_BF16,
        lambda d: d["computed_tokens"]["shared_chunks"], fmt="{:,.0f}",
        ceiling=lambda d: d["computed_tokens"]["oracle"]),
    _local_over_shared_chunks(
        "session 37's connector (float32 projections): TTFT p50 local / shared tier with "
        "chunk reuse, cross-replica turns; ceiling: local / the oracle",
        REPLICAS_CHUNKS_ORACLE_F32),
    Row("replicas", "chunk reuse across replicas: prompt tokens computed by the shared tier "
        "with chunk reuse (the oracle's: ceiling)", REPLICAS_CHUNKS_ORACLE,
        lambda d: d["computed_tokens"]["shared_chunks"], fmt="{:,.0f}",
        ceiling=lambda d: d["computed_tokens"]["oracle"],
        remark=lambda d: f"local DDR tiers computed {d['computed_tokens']['local']:,}"),
    Row("replicas", "session 35's connector (AMD EPYC): TTFT p50 local / shared tier with "
        "chunk reuse; ceiling: local / one replica with chunk reuse", REPLICAS_CHUNKS_LAYERS,
        lambda d: d["speedup_shared_chunks_vs_local_p50"],
        ceiling=lambda d: d["bound_shared_chunks_vs_local_p50"]),
    Row("replicas", "session 34's connector (a seam per moved chunk, every layer placed at "
        "once): TTFT p50 local / shared tier with chunk reuse; ceiling: local / one replica "
        "with chunk reuse", REPLICAS_CHUNKS_KERNELS,
        lambda d: d["speedup_shared_chunks_vs_local_p50"],
        ceiling=lambda d: d["bound_shared_chunks_vs_local_p50"]),
    Row("replicas", "session 33's connector (torch SDPA, the old hop rule): TTFT p50 local / "
        "shared tier with chunk reuse; ceiling: local / one replica with chunk reuse",
        REPLICAS_CHUNKS, lambda d: d["speedup_shared_chunks_vs_local_p50"],
        ceiling=lambda d: d["bound_shared_chunks_vs_local_p50"]),
    Row("replicas", "chunk reuse across replicas: prompt tokens computed over the schedule "
        "by the shared tier with chunk reuse", REPLICAS_CHUNKS_NOW,
        lambda d: d["computed_tokens"]["shared_chunks"], fmt="{:,.0f}",
        remark=lambda d: (f"one replica with chunk reuse computed "
                          f"{d['computed_tokens']['single_chunks']:,}; local DDR tiers "
                          f"{d['computed_tokens']['local']:,}")),
    Row("replicas", "chunk reuse across replicas: prompt tokens computed by the shared tier "
        "with chunk reuse, against prefix reuse's bound (one replica that saw every turn, "
        "prefix reuse only; session 33's connector)", REPLICAS_CHUNKS_PREFIX,
        lambda d: d["computed_tokens"]["shared_chunks"], fmt="{:,.0f}",
        remark=lambda d: (f"the bound computed {d['computed_tokens']['single']:,}; one "
                          f"replica with chunk reuse "
                          f"{d['computed_tokens']['single_chunks']:,}")),
    Row("replicas", "chunk reuse across replicas: chunks reused from span objects the other "
        "replica published", REPLICAS_CHUNKS_NOW,
        lambda d: d["shared_span_hits"]["shared_chunks"], fmt="{:.0f}"),
    Row("replicas", "chunk reuse across replicas: TTFT p50 one replica with chunk reuse / "
        "the shared tier with chunk reuse, cross-replica turns (the share of the ceiling "
        "reached)", REPLICAS_CHUNKS_NOW,
        lambda d: d["ceiling_fraction_chunks"]),
    Row("replicas", "turns lost at failover", REPLICAS,
        lambda d: d["failover_lost_turns"], fmt="{:.0f}", goal=Goal("<=", 0)),
    Row("replicas", "another tenant's tokens found in the shared tier", REPLICAS,
        lambda d: d["tenant_probe"]["probe-b_on_1_shared_tokens"], fmt="{:.0f}",
        goal=Goal("<=", 0), tags=("readme",)),
    # tool-pauses: 8 agents whose user turns end in a tool call, one vLLM CPU server
    Row("tool-pauses", "`resumed_hit_fraction` (the paused agent's previous prompt reused "
        "by its tool round), connector with agent hints; ceiling: a server whose KV holds "
        "every agent", TOOL_PAUSES, lambda d: d["resumed_hit_fraction"]["connector_hints"],
        fmt="{:.3f}", goal=Goal(">=", 0.95),
        ceiling=lambda d: d["resumed_hit_fraction"]["ceiling"]),
    Row("tool-pauses", "`resumed_hit_fraction`, the connector without hints", TOOL_PAUSES,
        lambda d: d["resumed_hit_fraction"]["connector"], fmt="{:.3f}",
        ceiling=lambda d: d["resumed_hit_fraction"]["ceiling"], remark=_hints_same_tokens),
    Row("tool-pauses", "resume TTFT p50 APC / connector with hints; ceiling: APC / the "
        "server that holds every agent", TOOL_PAUSES, lambda d: d["speedup_vs_apc_p50"],
        goal=Goal(">=", 3.0), ceiling=lambda d: d["ceiling_vs_apc_p50"]),
    Row("tool-pauses", "resume TTFT p50 LMCache / connector with hints (`resumed_hit_fraction` "
        "of LMCache in the remark)", TOOL_PAUSES, lambda d: d["speedup_vs_lmcache_p50"],
        remark=_lmcache_reused),
    Row("tool-pauses", "resume TTFT p50 connector without hints / with hints; ceiling: "
        "without hints / the server that holds every agent", TOOL_PAUSES,
        lambda d: d["speedup_hints_vs_nohints_p50"], goal=Goal(">=", 1.5),
        ceiling=_hints_bound,
        remark=_hints_same_tokens),
    Row("tool-pauses", "blocks agent hints asked to pin that the tenants' pin quotas "
        "refused (of those asked)", TOOL_PAUSES,
        lambda d: d["counters"]["connector_hints"]["hint_pins_refused"], fmt="{:.0f}",
        remark=lambda d: (f"{d['counters']['connector_hints']['hint_pinned_blocks']:.0f} "
                          "pinned")),
    *_pause_rows(TOOL_PAUSES_SMALL_DDR, "DDR for ~2.5 agents"),
    *_pause_rows(TOOL_PAUSES_PIN_ROOM, "DDR for ~2.5 agents and `device_blocks` 512 (the "
                 "pins' room)"),
    Row("tool-pauses", "resume TTFT p50 LMCache / connector with hints, DDR for ~2.5 agents "
        "and `device_blocks` 512 (LMCache's CPU cache the same bytes)",
        TOOL_PAUSES_PIN_ROOM[:1], lambda d: d["speedup_vs_lmcache_p50"],
        remark=_lmcache_reused),
    Row("tool-pauses", "prompt tokens computed on the resumes, DDR for ~2.5 agents: "
        "the connector with agent hints; ceiling: a server whose KV holds every agent",
        TOOL_PAUSES_SMALL_DDR,
        lambda d: d["resume"]["connector_hints"]["resume_computed_tokens"], fmt="{:,.0f}",
        ceiling=lambda d: d["resume"]["ceiling"]["resume_computed_tokens"]),
    Row("tool-pauses", "prompt tokens computed on the resumes, the same without hints",
        TOOL_PAUSES_SMALL_DDR,
        lambda d: d["resume"]["connector"]["resume_computed_tokens"], fmt="{:,.0f}",
        ceiling=lambda d: d["resume"]["ceiling"]["resume_computed_tokens"],
        remark=_hint_pins),
    # vllm: restart and recovery on vLLM's CPU build, default precision policy
    Row("vllm", "teacher-forced agreement after recovery (default policy)",
        ("vllm-cpu-rows.json",), lambda d: d["teacher_forced_agreement"], fmt="{:.3f}",
        goal=Goal(">=", 0.98)),
    Row("vllm", "stored bytes / fp16", ("vllm-cpu-rows.json",), lambda d: d["vs_fp16"],
        fmt="{:.3f}", goal=Goal("<=", 0.35)),
    Row("vllm", "TTFT cold / recovered process", ("vllm-cpu-rows.json",),
        lambda d: d["speedup"], fmt="{:.1f}", goal=Goal(">=", 10), tags=("readme",)),
    Row("vllm", "identical 32-token greedy replies (share of 8 prompts)",
        ("vllm-cpu-rows.json",), lambda d: d["greedy_match"], fmt="{:.3f}",
        goal=Goal(">=", 0.9)),
    # decode and kernels
    Row("decode", "decode tokens/s at 6K context, TQ4 (embedded engine, int8 weights)",
        ("decode-cpu.json",), lambda d: d["decode_tps_tq4_6k"], fmt="{:.1f}"),
    Row("decode", "decode tokens/s at 6K context, llama.cpp on the same GGUF",
        ("decode-cpu.json",), lambda d: d["decode_tps_llamacpp_6k"], fmt="{:.1f}"),
    Row("decode", "decode tokens/s at 6K context, TQ4, on CUDA", ("decode-h200.json",),
        lambda d: d["decode_tps_tq4_6k"], fmt="{:.1f}", goal=Goal(">=", 300)),
    Row("kernel", "fp16 SDPA ms / TQ4 decode ms at 32K (CUDA graphs)", ("kernel-h100.json",),
        lambda d: _kernel_ratio(d, 32768), goal=Goal(">=", 2.0)),
    Row("kernel", "fp16 SDPA ms / TQ4 decode ms at 128K (CUDA graphs)", ("kernel-h100.json",),
        lambda d: _kernel_ratio(d, 131072), goal=Goal(">=", 2.5)),
    # the quick CPU benches
    Row("tiers", "host-to-device warm rate / plain copy rate", ("tiers-cpu.json",),
        lambda d: d["warm_ratio"], fmt="{:.3f}", goal=Goal(">=", 0.8)),
    Row("tiers", "host-to-device warm rate / plain copy rate, over PCIe", ("tiers-h200.json",),
        lambda d: d["warm_ratio"], fmt="{:.3f}", goal=Goal(">=", 0.8)),
    Row("quant", "bytes per token, TQ4 / fp16", ("quant-cpu.json",),
        lambda d: d["bytes_per_token_tq4"] / d["bytes_per_token_fp16"], fmt="{:.3f}"),
    Row("quant", "attention output cosine over TQ4 keys and values (real K/V)",
        ("quant-cpu.json",), lambda d: d["attn_cosine_real"], fmt="{:.4f}"),
    # The file's *_runs lists were added by hand: only the fields the bench wrote count.
    Row("shadow", "shadow write rate / raw write rate (one run)", ("shadow-cpu.json",),
        lambda d: d["write_ratio"], fmt="{:.2f}", goal=Goal(">=", 0.8)),
    Row("shadow", "recovery read rate / raw read rate (one run)", ("shadow-cpu.json",),
        lambda d: d["read_ratio"], fmt="{:.2f}", goal=Goal(">=", 0.8)),
    Row("ooda", "OODA cycle ms p50, 100K items", ("ooda-cpu.json",),
        lambda d: d["cycle_ms_p50"], fmt="{:.2f}"),
    Row("ooda", "share of the 60 s interval spent in the cycle", ("ooda-cpu.json",),
        lambda d: d["overhead_fraction"], fmt="{:.5f}", goal=Goal("<=", 0.01)),
    Row("graph", "hybrid query ms p50, 100K nodes (library `encode`, no trace)",
        ("graph-cpu-st-encode.json",),
        lambda d: d["query_p50_ms"], fmt="{:.1f}", goal=Goal("<=", 20)),
    Row("graph", "ingest nodes/s", ("graph-cpu-st-encode.json",), lambda d: d["ingest_nodes_per_s"],
        fmt="{:.1f}"),
)


def _kernel_ratio(d: dict, context: int) -> float:
    row = next(c for c in d["contexts"] if c["context"] == context)
    return row["sdpa_graph_ms"] / row["tq4_graph_ms"]


# --------------------------------------------------------------------------- rendering
def row_cells(row: Row, data: list[dict]) -> tuple[str, str, str]:
    """(value, ceiling, status) cells of one row."""
    values = [row.value(d) for d in data]
    value = statistics.median(values)
    shown = row.fmt.format(value)
    if len(values) > 1:
        shown = (f"median {shown} ({len(values)} runs: "
                 + ", ".join(row.fmt.format(v) for v in values) + ")")
    judged = value
    if row.interval is not None:
        lo, hi = row.interval(data[0])
        shown += f" [95%: {lo:.4f}, {hi:.4f}]"
        judged = lo
    ceiling = ""
    if row.ceiling is not None:
        bounds = [row.ceiling(d) for d in data]
        bound = statistics.median(bounds)
        ceiling = row.fmt.format(bound)
        if len(bounds) > 1:
            ceiling = "median " + ceiling
        if bound and value:
            # Tokens computed: smaller is better, so the fraction is bound / value;
            # tokens served from cache: value / bound.
            fraction = bound / value if "computed" in row.figure else value / bound
            ceiling += f" ({fraction:.2f} of it)"
    status = ""
    if row.goal is not None:
        verdict = "met" if row.goal.met(judged) else "not met"
        if row.interval is not None:
            verdict += " (judged on the interval's lower end)"
        if len(values) > 1 and row.goal is not None:
            met = sum(row.goal.met(v) for v in values)
            verdict += f"; {met} of {len(values)} runs met it"
        status = f"{row.goal}: {verdict}"
        if row.ceiling is not None and not row.goal.met(bound):
            status += f"; the goal is above this run's ceiling ({bound:.2f})"
            status += f": {row.beyond_ceiling}" if row.beyond_ceiling else ""
    if row.remark is not None:
        remark = "; ".join(dict.fromkeys(r for r in (row.remark(d) for d in data) if r))
        status = f"{status}; {remark}" if status and remark else status or remark
    return shown, ceiling, status


def render(rows: Sequence[Row]) -> str:
    lines = ["| bench | figure | value | same-run ceiling | goal | machine | JSON |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        data = [load(name) for name in row.files]
        value, ceiling, status = row_cells(row, data)
        machines = sorted({machine(name, d) for name, d in zip(row.files, data, strict=True)})
        files = ", ".join(f"`{name}`" for name in row.files)
        lines.append(f"| {row.bench} | {row.figure} | {value} | {ceiling} | {status} | "
                     f"{'; '.join(machines)} | {files} |")
    return "\n".join(lines) + "\n"


def blocks() -> dict[str, str]:
    """Block name -> its generated Markdown."""
    out = {"headline": render([r for r in ROWS if "readme" in r.tags])}
    for bench in dict.fromkeys(r.bench for r in ROWS):
        out[bench] = render([r for r in ROWS if r.bench == bench])
    return out


def rewrite(text: str, generated: dict[str, str]) -> str:
    def fill(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in generated:
            raise SystemExit(f"figures: no table is named {name!r} (known: "
                             f"{', '.join(generated)})")
        return match.group(1) + generated[name] + match.group(4)

    return BLOCK.sub(fill, text)


def stale(text: str, generated: dict[str, str]) -> list[str]:
    """Names of the blocks in ``text`` that differ from what the JSON gives."""
    return [m.group(2) for m in BLOCK.finditer(text)
            if generated.get(m.group(2)) != m.group(3)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m contextkit.bench.figures",
        description="Rewrite the figure tables of README.md and docs/benchmarks.md "
                    "from bench/results/*.json.")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a table differs from the JSON")
    args = parser.parse_args(argv)
    generated = blocks()
    bad = []
    for target in TARGETS:
        path = ROOT / target
        text = path.read_text()
        if args.check:
            bad += [f"{target}: {name}" for name in stale(text, generated)]
        else:
            path.write_text(rewrite(text, generated))
    if bad:
        print("figures differ from bench/results (run `python -m contextkit.bench.figures`): "
              + ", ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
