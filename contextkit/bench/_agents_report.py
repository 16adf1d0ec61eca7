"""Figures and the plot of ``contextkit bench agents`` (:mod:`contextkit.bench.agents`).

What one policy's rows add up to (TTFT percentiles, tokens computed and reused, blocks
warmed from the host), the speedups between policies, and the TTFT plot with the
device-size sweep.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["POLICIES", "SAME_TOKENS", "bounds", "percentile", "plot", "policy_figures",
           "speedups"]

#: The eviction policies compared, in the order they run and are plotted.
POLICIES = ("lru", "semantic", "semantic+ooda")


# ---------------------------------------------------------------------- figures
def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (linear interpolation between closest ranks)."""
    if not values:
        raise ValueError("no values")
    return float(np.percentile(np.asarray(values, dtype=float), q))


def _warm(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Rows of an agent's second turn on (first turns are cold under every policy)."""
    return [r for r in rows if r["agent_turn"] >= 1]


def policy_figures(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One policy's figures from its per-step rows (see the module docstring).

    Raises:
        ValueError: no rows, or no warm step (every agent's first turn only).
    """
    if not rows:
        raise ValueError("no steps to summarise")
    warm = _warm(rows)
    if not warm:
        raise ValueError("no step of an agent's second turn; run at least 2 x agents steps")
    ttft = [r["ttft_ms"] for r in warm]
    prompt = sum(r["prompt_tokens"] for r in rows)
    warmed = sum(r["warmed_tokens"] for r in rows)
    reused = sum(r["reused_tokens"] for r in rows)
    out: dict[str, Any] = {
        "ttft_ms": [round(r["ttft_ms"], 1) for r in rows],
        "ttft_p50": round(statistics.median(ttft), 1),
        "ttft_p95": round(percentile(ttft, 95), 1),
        "device_hit_rate": round((reused - warmed) / prompt, 4) if prompt else 0.0,
        "host_hit_rate": round(warmed / prompt, 4) if prompt else 0.0,
        "reused_tokens": reused,
        "computed_tokens": sum(r["computed_tokens"] for r in rows),
        "chunk_reused_tokens": sum(r.get("chunk_reused_tokens", 0) for r in rows),
        "repaired_tokens": sum(r.get("repaired_tokens", 0) for r in rows),
        "blocks_moved": sum(r["blocks_moved"] for r in rows),
        "bytes_moved": sum(r["bytes_moved"] for r in rows),
        "pinned_blocks_evicted": sum(r["pinned_blocks_evicted"] for r in rows),
        "ooda_cycle_ms_p50": None,
    }
    ooda = [r["ooda_ms"] for r in rows if "ooda_ms" in r]
    if ooda:
        out["ooda_cycle_ms_p50"] = round(statistics.median(ooda), 2)
        out["ooda_cycle_ms_p95"] = round(percentile(ooda, 95), 2)
        out["prefetch"] = {
            "calls": len(ooda),
            "warmed_blocks": sum(r["prefetch_warmed"] for r in rows),
            "spilled_blocks": sum(r["prefetch_spilled"] for r in rows),
            "removed_blocks": sum(r["prefetch_removed"] for r in rows),
            "bytes": sum(r["prefetch_bytes"] for r in rows),
            "before_generate": all(r["prefetch_finished_at"] <= r["generate_started_at"]
                                   for r in rows),
        }
    return out


def speedups(ttft: Mapping[str, Sequence[float]], rows: Sequence[Mapping[str, Any]]
             ) -> dict[str, dict[str, float]]:
    """For every configuration but lru, over the warm steps: ``speedup_vs_lru_total``
    (sum of lru's TTFTs over the configuration's: a ratio of sums of the same steps),
    ``speedup_vs_lru_p50`` (median of the per-step ratios ``lru / policy``; it describes
    the typical step but bounds nothing) and ``speedup_vs_lru_of_medians``.

    ``rows`` are any policy's rows (the schedule is the same): they say which steps
    are warm.

    Raises:
        ValueError: policies with different step counts, or no warm step.
    """
    lengths = {len(v) for v in ttft.values()}
    if len(lengths) != 1 or len(rows) not in lengths:
        raise ValueError(f"every policy needs the same steps, got {sorted(lengths)} and "
                         f"{len(rows)} rows")
    warm = [i for i, r in enumerate(rows) if r["agent_turn"] >= 1]
    if not warm:
        raise ValueError("no warm step (an agent's second turn); run more steps")
    lru = [ttft["lru"][i] for i in warm]
    total: dict[str, float] = {}
    p50: dict[str, float] = {}
    of_medians: dict[str, float] = {}
    for name, values in ttft.items():
        if name == "lru":
            continue
        mine = [values[i] for i in warm]
        total[name] = round(sum(lru) / sum(mine), 3)
        p50[name] = round(statistics.median(a / b for a, b in zip(lru, mine, strict=True)), 3)
        of_medians[name] = round(statistics.median(lru) / statistics.median(mine), 3)
    return {"speedup_vs_lru_total": total, "speedup_vs_lru_p50": p50,
            "speedup_vs_lru_of_medians": of_medians}


#: What a report says instead of a speedup when two configurations compute the same.
SAME_TOKENS = "same tokens: timing difference is noise"


def bounds(computed: Mapping[str, int], ttft_total: Mapping[str, float], *,
           ceiling: str, baseline: str = "lru") -> dict[str, dict[str, Any]]:
    """Each configuration against the ceiling, in tokens computed (what no
    configuration can beat: the ceiling's cache holds every block, and every
    configuration is fed the same prompts).

    ``ceiling_fraction``: the share of the tokens ``baseline`` computes beyond the
    ceiling that the configuration avoided (1.0: all of them; None when the baseline
    already computes no more than the ceiling). ``ttft_vs_ceiling``: the ratio of
    TTFT sums, ceiling over configuration, or :data:`SAME_TOKENS` where both compute
    the same tokens.

    ``beats_ceiling`` is true where a configuration computed fewer tokens than the
    ceiling: the bound failed (a bench bug), reported rather than raised so the run's
    figures are kept.

    Raises:
        ValueError: the ceiling or the baseline is missing.
    """
    if ceiling not in computed or baseline not in computed:
        raise ValueError(f"bounds need {ceiling!r} and {baseline!r}, got {sorted(computed)}")
    floor = computed[ceiling]
    avoidable = computed[baseline] - floor
    out: dict[str, dict[str, Any]] = {}
    for name, tokens in computed.items():
        if name == ceiling:
            continue
        out[name] = {
            "computed_tokens": tokens, "ceiling_computed_tokens": floor,
            "beats_ceiling": tokens < floor,
            "ceiling_fraction": (round((computed[baseline] - tokens) / avoidable, 4)
                                 if avoidable > 0 else None),
            "ttft_vs_ceiling": (SAME_TOKENS if tokens == floor else
                                round(ttft_total[ceiling] / ttft_total[name], 3)),
        }
    return out


# ---------------------------------------------------------------------- plot
def plot(path: Path, ttft: Mapping[str, Sequence[float]], sweep: Sequence[Mapping[str, Any]],
          title: str) -> None:
    from contextkit.config import require

    matplotlib = require("matplotlib", "plot")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if sweep else 1
    fig, axes = plt.subplots(1, panels, figsize=(12 if sweep else 8, 4.5), squeeze=False,
                             gridspec_kw={"width_ratios": [2, 1] if sweep else [1]})
    ax = axes[0][0]
    for name, marker in zip(POLICIES, ("s", "o", "^"), strict=True):
        values = [v / 1000 for v in ttft[name]]
        ax.plot(range(1, len(values) + 1), values, marker=marker, markersize=4, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("time to first token (s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    if sweep:
        ax2 = axes[0][1]
        x = [s["device_agents"] for s in sweep]
        for name, marker in (("semantic", "o"), ("semantic+ooda", "^")):
            ax2.plot(x, [s["speedup_vs_lru_total"][name] for s in sweep], marker=marker,
                     label=name)
        ax2.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax2.set_xticks(x)
        ax2.set_xlabel("device tier (agents' prompts)")
        ax2.set_ylabel("speedup vs lru (TTFT sums, warm steps)")
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=8)
        ax2.set_title("device-size sweep", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
