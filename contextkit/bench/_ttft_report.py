"""The JSON and the table of ``contextkit bench ttft`` (:mod:`contextkit.bench.ttft`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from contextkit.bench._common import machine_info, print_table

__all__ = ["memory_change_ceiling", "report", "speedup_totals"]

Record = Mapping[str, Any]


def speedup_totals(records: Sequence[Record]) -> dict[str, float | None]:
    """Sum of baseline TTFT over sum of contextkit TTFT: ``speedup_total`` over every
    turn (turn 1 included: nothing is cached yet and contextkit is slower there) and
    ``speedup_total_excl_turn1`` over turns >= 2."""
    def total(rows: Sequence[Record]) -> float | None:
        return (sum(r["ttft_ms_baseline"] for r in rows)
                / sum(r["ttft_ms_contextkit"] for r in rows)) if rows else None

    return {"speedup_total": total(records),
            "speedup_total_excl_turn1": total(records[1:])}


def memory_change_ceiling(change: Sequence[Record]) -> dict[str, Any]:
    """The chunk ceiling (every cached chunk moved in, none repaired) on the
    memory-change turns that ran it, as a bound contextkit cannot beat by construction.

    The ceiling computes a subset of contextkit's tokens on the same turn, so its TTFT
    is taken as ``min(ceiling, contextkit)``: a ceiling measured slower is timing noise
    (counted in ``ceiling_slower_turns``). Figures: the median and the ratio of sums of
    baseline over that TTFT, contextkit's own ratio of sums over the same turns, and
    ``ceiling_fraction_memory_change`` = sum of ceiling TTFT / sum of contextkit TTFT
    (<= 1).
    """
    rows = [r for r in change if "ttft_ms_chunk_ceiling" in r]
    if not rows:
        return {"speedup_memory_change_ceiling_p50": None,
                "speedup_memory_change_ceiling_total": None,
                "speedup_memory_change_total": None,
                "ceiling_fraction_memory_change": None, "ceiling_slower_turns": 0}
    top = [min(r["ttft_ms_chunk_ceiling"], r["ttft_ms_contextkit"]) for r in rows]
    base = [r["ttft_ms_baseline"] for r in rows]
    own = [r["ttft_ms_contextkit"] for r in rows]
    return {
        "speedup_memory_change_ceiling_p50": statistics.median(
            b / t for b, t in zip(base, top, strict=True)),
        "speedup_memory_change_ceiling_total": sum(base) / sum(top),
        "speedup_memory_change_total": sum(base) / sum(own),
        "ceiling_fraction_memory_change": sum(top) / sum(own),
        "ceiling_slower_turns": sum(r["ttft_ms_chunk_ceiling"] > r["ttft_ms_contextkit"]
                                    for r in rows),
    }


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ci(interval: Sequence[float] | None) -> str:
    return "" if interval is None else f"[{interval[0]:.3f}, {interval[1]:.3f}]"


def _gate(out: Mapping[str, Any], name: str) -> str:
    """A gated agreement as its gate note (value, 95% interval, met or not)."""
    gate = out.get("gates", {}).get(name)
    return _fmt(out.get(name), 4) if gate is None else str(gate["note"])


def _rounded(value: float | None, rate: bool) -> float | None:
    """A time in ms to 0.1 ms, a rate to 4 significant digits; ``None`` as it is."""
    if value is None:
        return None
    return float(f"{value:.4g}") if rate else round(value, 1)


def report(result: dict[str, Any], out_dir: Path,
           plot: Callable[[list[dict[str, Any]], Path, str], Path]) -> dict[str, Any]:
    """The bench's JSON from :func:`~contextkit.bench.ttft.run_replay`'s result (its
    per-turn records become lists), the plot under ``out_dir``; prints the table."""
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
        "chunk_reused_tokens": [r["chunk_reused_tokens"] for r in records],
        "repaired_tokens": [r["repaired_tokens"] for r in records],
        "edited_chunks": [r.get("edited_chunks", 0) for r in records],
        "edited_tokens": [r.get("edited_tokens", 0) for r in records],
        **({"ttft_ms_chunk_ceiling": [round(r["ttft_ms_chunk_ceiling"], 1) for r in records],
            "computed_tokens_chunk_ceiling": [r["computed_tokens_chunk_ceiling"]
                                              for r in records]}
           if "ttft_ms_chunk_ceiling" in records[0] else {}),
        "reused_chunks": [r["reused_chunks"] for r in records],
        "reused_tokens_prefix_cache": [r["reused_tokens_prefix_cache"] for r in records],
        "prefix_broken_by": [r["prefix_broken_by"] for r in records],
        "flop_ratio_prefix_reuse": [round(r["flop_ratio_prefix_reuse"], 3) for r in records],
        "background_cpu_s": [round(r["background_cpu_s"], 3) for r in records],
        "background_done": [r["background_done"] for r in records],
        "reservation_hit": [r["reservation_hit"] for r in records],
        "extension_tokens": [r["extension_tokens"] for r in records],
        "foreground_wait_ms": [round(r["foreground_wait_ms"], 2) for r in records],
        "stall_ms": [round(r["stall_ms"], 2) for r in records],
        **{f"{k}_{who}": [r[f"{k}_{who}"] if k == "generated_tokens" else
                          _rounded(r[f"{k}_{who}"], k == "decode_tps")
                          for r in records]
           for who in ("contextkit", "baseline")
           for k in ("total_ms", "generated_tokens", "decode_tps")},
        **({"ttft_ms_native_cached": [round(r["ttft_ms_native_cached"], 1) for r in records],
            "reused_tokens_native_cached": [r["reused_tokens_native_cached"] for r in records],
            "decode_tps_native_cached": [_rounded(r["decode_tps_native_cached"], True)
                                         for r in records]}
           if "ttft_ms_native_cached" in records[0] else {}),
        **{k: v for k, v in result.items() if k not in ("cache",)},
        "blocks_per_tier": records[-1]["blocks_per_tier"],
    }
    png = plot(records, out_dir / "ttft.png",
                    f"agent replay, {records[-1]['prompt_tokens']:,}-token prompt "
                    f"({machine['device_name']})")
    out["plot"] = str(png)
    rows: list[tuple[str, Any]] = [
        ("turns | prompt tokens (last)", f"{out['turns']} | {records[-1]['prompt_tokens']:,}"),
        ("TTFT p50 baseline | contextkit (ms)",
         f"{statistics.median(out['ttft_ms_baseline'][1:] or out['ttft_ms_baseline']):,.0f} | "
         f"{statistics.median(out['ttft_ms_contextkit'][1:] or out['ttft_ms_contextkit']):,.0f}"),
        ("speedup_p50 (turns >= 2)", out["speedup_p50"]),
        ("decode tokens/s p50 baseline | contextkit",
         f"{_fmt(out['decode_tps_baseline_p50'])} | {_fmt(out['decode_tps_p50'])}"),
        ("  FLOP ratio full / prefix-reusing prefill (chunk reuse not counted), p50",
         out["flop_ratio_prefix_reuse_p50"]),
        ("speedup_vs_prefix_cache_p50", out["speedup_vs_prefix_cache_p50"]),
        ("flatness (last / turn 2)", out["flatness"]),
        ("speedup_total (sum baseline / sum contextkit): all turns | turns >= 2",
         f"{_fmt(out['speedup_total'])} | {_fmt(out['speedup_total_excl_turn1'])}"),
        ("think time per turn (s) | reservations",
         f"{out['think_s']:g} | " + (f"on, {out['reserve_candidates']} candidates"
                                     if out["reserve"] else "off (--no-reserve)")),
        ("memory-change turns", ", ".join(map(str, out["memory_change_turns"])) or "none"),
        ("reservation_hit_rate", "- (no memory-change turn)"
         if out["reservation_hit_rate"] is None else out["reservation_hit_rate"]),
        ("speedup p50 memory-change | steady turns",
         f"{_fmt(out['speedup_memory_change_p50'])} | {_fmt(out['speedup_steady_p50'])}"),
        ("background CPU (s, all think windows)", out["background_cpu_s_total"]),
        ("  ceiling (every chunk moved in, none repaired): p50 | sum/sum | fraction",
         f"{_fmt(out['speedup_memory_change_ceiling_p50'])} | "
         f"{_fmt(out['speedup_memory_change_ceiling_total'])} | "
         f"{_fmt(out['ceiling_fraction_memory_change'])} (ceiling measured slower on "
         f"{out['ceiling_slower_turns']} turns: timing noise, bounded by contextkit's)"),
        ("chunk reuse | tokens reused | repaired (all turns)",
         f"{'on' if out['chunk_reuse'] else 'off (--no-chunk-reuse)'} | "
         f"{sum(out['chunk_reused_tokens']):,} | {sum(out['repaired_tokens']):,}"),
        ("edited lines | their changed tokens computed (all turns)",
         f"{sum(out['edited_chunks']):,} | {sum(out['edited_tokens']):,}"),
        ("memory lines ready at seeding | tokens computed | s",
         "off" if not out.get("memory_chunks") else
         f"{out['memory_chunks']['lines']} | {out['memory_chunks']['computed_tokens']:,} | "
         f"{out['memory_chunks']['wall_s']}"),
    ]
    if "agreement_native" in out:
        rows += [("  lossless reuse of the same tokens: speedup p50",
                  out["speedup_native_cached_p50"]),
                 ("agreement_native", out["agreement_native"]),
                 ("top1_agreement_tq4", _gate(out, "top1_agreement_tq4")),
                 ("  packed only (no float sink/window)", out["top1_agreement_tq4_packed_only"]),
                 ("ppl_ratio_tq4", out["ppl_ratio_tq4"]),
                 ("  a fresh TQ4 cache filled by prefill only (no chunk path)",
                  _fmt(out["top1_agreement_tq4_prefill_only"], 4)),
                 ("chunk turns: top1_agreement", _gate(out, "top1_agreement_chunk_turns")),
                 ("  ppl_ratio (turns)",
                  f"{_fmt(out['ppl_ratio_chunk_turns'])} ({out['chunk_turns']} turns)"),
                 ("  ceiling: the same turns on a fresh TQ4 cache, prefill only | ppl_ratio",
                  f"{_fmt(out['top1_agreement_chunk_turns_tq4_prefill_only'], 4)} "
                  f"{_ci(out['top1_agreement_chunk_turns_tq4_prefill_only_ci95'])} | "
                  f"{_fmt(out['ppl_ratio_chunk_turns_tq4_prefill_only'])}"),
                 ("  the same turns' prefix on the chunk path's own cache",
                  _fmt(out["top1_agreement_chunk_turns_prefix_only_same_cache"], 4))]
    rows.append(("plot", png))
    print_table("bench ttft", rows)
    return out
