"""The JSON and the table of ``contextkit bench ttft`` (:mod:`contextkit.bench.ttft`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from contextkit.bench._common import machine_info, print_table

__all__ = ["report"]


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


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
        "flop_ratio": [round(r["flop_ratio"], 3) for r in records],
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
        ("  FLOP ratio full / reused prefill, p50", out["flop_ratio_p50"]),
        ("speedup_vs_prefix_cache_p50", out["speedup_vs_prefix_cache_p50"]),
        ("flatness (last / turn 2)", out["flatness"]),
        ("speedup_total (sum baseline / sum contextkit)", out["speedup_total"]),
        ("think time per turn (s) | reservations",
         f"{out['think_s']:g} | " + (f"on, {out['reserve_candidates']} candidates"
                                     if out["reserve"] else "off (--no-reserve)")),
        ("memory-change turns", ", ".join(map(str, out["memory_change_turns"])) or "none"),
        ("reservation_hit_rate", "- (no memory-change turn)"
         if out["reservation_hit_rate"] is None else out["reservation_hit_rate"]),
        ("speedup p50 memory-change | steady turns",
         f"{_fmt(out['speedup_memory_change_p50'])} | {_fmt(out['speedup_steady_p50'])}"),
        ("background CPU (s, all think windows)", out["background_cpu_s_total"]),
        ("  ceiling (every chunk moved in, none repaired) | fraction reached",
         f"{_fmt(out['speedup_memory_change_ceiling_p50'])} | "
         f"{_fmt(out['ceiling_fraction_memory_change'])}"),
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
                 ("top1_agreement_tq4", out["top1_agreement_tq4"]),
                 ("  packed only (no float sink/window)", out["top1_agreement_tq4_packed_only"]),
                 ("ppl_ratio_tq4", out["ppl_ratio_tq4"]),
                 ("chunk turns: top1_agreement | ppl_ratio",
                  f"{_fmt(out['top1_agreement_chunk_turns'], 4)} | "
                  f"{_fmt(out['ppl_ratio_chunk_turns'])} ({out['chunk_turns']} turns)"),
                 ("  the same turns, prefix reuse only (every chunk token computed)",
                  _fmt(out["top1_agreement_chunk_turns_prefix_only"], 4))]
    rows.append(("plot", png))
    print_table("bench ttft", rows)
    return out
