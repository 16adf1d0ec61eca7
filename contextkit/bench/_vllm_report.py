"""The policies ``contextkit bench vllm`` compares, and its per-policy figures.

Pure functions over the harness's and the recovery job's JSON (no vLLM): the
connector configuration of each policy, the answer metrics (teacher-forced
agreement, greedy replies), the stored bytes per token from the recovery summary's
``formats``, the acceptance booleans of the default policy, and the plot.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ACCEPTANCE", "DEFAULT_POLICY", "POLICIES", "acceptance", "greedy", "parse_policies",
           "plot", "policy_config", "policy_dirname", "policy_metrics", "stored_bytes",
           "table_rows"]

# Every policy here is a store under pressure: room_format off (with room the default
# policy would keep its tq4 blocks int8; bench agents-vllm measures that).
_ALL_TQ4: dict[str, Any] = {"default": "tq4", "sink_blocks": 0, "key_offsets": False,
                            "layers": {}, "pinned": None, "importance": [],
                            "room_format": None}

#: policy name -> the connector configuration keys it sets (``codec``, ``precision``)
POLICIES: dict[str, dict[str, Any]] = {
    # what the connector stored before issue 17: every block TQ4, no sink, no offsets
    "tq4": {"codec": "tq4", "precision": dict(_ALL_TQ4)},
    # the embedded engine's two mechanisms: the first block kept, per-head key offsets
    "sink+offsets": {"codec": "tq4", "precision": {**_ALL_TQ4, "sink_blocks": 1,
                                                   "key_offsets": True}},
    # the intuition the issue started from: the stable (pinnable) front layers int8
    "stable-int8": {"codec": "tq4", "precision": {
        **_ALL_TQ4, "sink_blocks": 1, "key_offsets": True,
        "layers": dict.fromkeys(("axioms", "identity", "rules", "capabilities", "soul"),
                                "int8")}},
    # the server's default policy: precision by the blocks' labels, within its budget
    # (as a full store keeps it: its room_format off): k5v4, the latest blocks int8
    "importance": {"codec": "tq4", "precision": {"room_format": None}},
    # the default policy before k5v4: the same rules over tq4, within 0.33 of fp16
    "importance-tq4": {"codec": "tq4", "precision": {"default": "tq4", "max_vs_fp16": 0.33,
                                                     "room_format": None}},
    # its control: the same rules over tq4 at the default's budget (0.35), so the bytes
    # k5v4 spends on keys go to more int8 blocks instead
    "tq4-0.35": {"codec": "tq4", "precision": {"default": "tq4", "max_vs_fp16": 0.35,
                                               "room_format": None}},
    # the default policy's rules without its byte budget: every late layer int8
    "late-int8": {"codec": "tq4", "precision": {"max_vs_fp16": None, "room_format": None}},
    # every block k5v4 (5-bit keys, tq4 values; fp16 sink, key offsets)
    "k5v4": {"codec": "tq4", "precision": {**_ALL_TQ4, "default": "k5v4", "sink_blocks": 1,
                                           "key_offsets": True}},
    # every block int8 (fp16 sink, key offsets): the ceiling of 8-bit storage
    "int8": {"codec": "tq4", "precision": {**_ALL_TQ4, "default": "int8", "sink_blocks": 1,
                                           "key_offsets": True}},
    # float32 blocks: the reference for lossless answers
    "native": {"codec": "native"},
}
#: the policy whose figures are the bench's top-level keys and the acceptance's subject
DEFAULT_POLICY = "importance"
#: issue 17's targets for the default policy: key -> (comparison, bound)
ACCEPTANCE: dict[str, tuple[str, float]] = {
    "teacher_forced_agreement": (">=", 0.98),
    "greedy_match": (">=", 0.9),
    "vs_fp16": ("<=", 0.35),
    "speedup": (">=", 10.0),
}


def parse_policies(text: str) -> list[str]:
    """``--policies``: comma-separated names of :data:`POLICIES`, each once (an
    argparse ``type``: a bad list is one usage line)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown polic{'y' if len(unknown) == 1 else 'ies'} "
            f"{', '.join(map(repr, unknown)) or repr(text)}; choose from "
            f"{','.join(POLICIES)}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a policy is named twice in {text!r}")
    return names


def policy_dirname(name: str) -> str:
    """A policy's work folder name (``sink+offsets`` -> ``sink_offsets``)."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def policy_config(name: str, base: Mapping[str, Any]) -> dict[str, Any]:
    """The connector configuration of policy ``name``: ``base`` (block size, stores,
    stats path) with the policy's ``codec`` and ``precision``."""
    out = {k: v for k, v in base.items() if k not in ("codec", "precision")}
    out.update({k: (dict(v) if isinstance(v, dict) else v) for k, v in POLICIES[name].items()})
    return out


def greedy(a: Sequence[int], b: Sequence[int]) -> tuple[float, int, bool]:
    """Two greedy replies compared: the fraction of positions that agree (over ``a``),
    the length of their identical prefix, and whether they are identical."""
    same = sum(x == y for x, y in zip(a, b, strict=False))
    prefix = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                  min(len(a), len(b)))
    return same / max(1, len(a)), prefix, list(a) == list(b)


def stored_bytes(formats: Mapping[str, Mapping[str, Any]] | None) -> dict[str, Any]:
    """Bytes per stored token from the recovery summary's ``formats`` (``{fmt:
    {"blocks", "bytes", "bytes_per_token", "vs_fp16"}}``): the total (weighted by
    blocks, all of one size) and per format. Empty without formats."""
    if not formats:
        return {"bytes_per_token": None, "vs_fp16": None, "formats": {}}
    blocks = sum(int(f["blocks"]) for f in formats.values())
    per = {fmt: {"blocks": int(f["blocks"]), "bytes": int(f["bytes"]),
                 "bytes_per_token": round(float(f["bytes_per_token"]), 2),
                 "vs_fp16": round(float(f["vs_fp16"]), 4)} for fmt, f in sorted(formats.items())}
    if not blocks:
        return {"bytes_per_token": None, "vs_fp16": None, "formats": per}
    bpt = sum(float(f["bytes_per_token"]) * int(f["blocks"]) for f in formats.values()) / blocks
    vs = sum(float(f["vs_fp16"]) * int(f["blocks"]) for f in formats.values()) / blocks
    return {"bytes_per_token": round(bpt, 2), "vs_fp16": round(vs, 4), "formats": per}


def policy_metrics(cold: Sequence[Mapping[str, Any]], recovered: Mapping[str, Any],
                   recovery: Mapping[str, Any]) -> dict[str, Any]:
    """One policy's figures from its cold run's results, its recovered run's output
    (results and ``teacher_forced_agreement``) and the recovery summary."""
    warm = recovered["results"]
    if len(warm) != len(cold) or not cold:
        raise ValueError(f"the recovered run served {len(warm)} prompts, the cold run "
                         f"{len(cold)}")
    ttft_cold = statistics.median(float(r["ttft_ms"]) for r in cold)
    ttft_warm = statistics.median(float(r["ttft_ms"]) for r in warm)
    matches = [greedy(a["token_ids"], b["token_ids"]) for a, b in zip(cold, warm, strict=True)]
    hits = [int((r.get("connector") or {}).get("external_hit_tokens", 0)) for r in warm]
    agreement = recovered.get("teacher_forced_agreement") or []
    return {
        "teacher_forced_agreement": round(statistics.mean(agreement), 4) if agreement else None,
        "greedy_match": round(sum(m[2] for m in matches) / len(matches), 4),
        "greedy_prefix_match": round(statistics.mean(m[1] for m in matches), 2),
        "greedy_token_match": round(statistics.mean(m[0] for m in matches), 4),
        "first_token_match": round(sum(a["token_ids"][:1] == b["token_ids"][:1]
                                       for a, b in zip(cold, warm, strict=True)) / len(cold), 4),
        **stored_bytes(recovery.get("formats")),
        "ttft_cold_ms": round(ttft_cold, 1),
        "ttft_recovered_ms": round(ttft_warm, 1),
        "speedup": round(ttft_cold / ttft_warm, 2) if ttft_warm else None,
        "external_hit_tokens": int(statistics.median(hits)),
        "teacher_forced_agreement_each": [round(a, 4) for a in agreement],
        "greedy_prefix_each": [m[1] for m in matches],
        "ttft_cold_ms_each": [round(float(r["ttft_ms"]), 1) for r in cold],
        "ttft_recovered_ms_each": [round(float(r["ttft_ms"]), 1) for r in warm],
        "recovered_blocks": recovery.get("snapshot_blocks"),
        "recover_seconds": recovery.get("seconds"),
        "recover_errors": recovery.get("errors") or {},
    }


def acceptance(metrics: Mapping[str, Any]) -> dict[str, bool]:
    """Issue 17's targets met by one policy's figures (a missing figure fails), and
    ``all``."""
    out: dict[str, bool] = {}
    for key, (op, bound) in ACCEPTANCE.items():
        value = metrics.get(key)
        out[key] = value is not None and (value >= bound if op == ">=" else value <= bound)
    out["all"] = all(out.values())
    return out


def table_rows(policies: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, Any]]:
    """The printed table: one row per policy and figure."""
    rows: list[tuple[str, Any]] = []
    for name, m in policies.items():
        for key in ("teacher_forced_agreement", "greedy_match", "greedy_prefix_match",
                    "vs_fp16", "bytes_per_token", "ttft_cold_ms", "ttft_recovered_ms",
                    "speedup", "external_hit_tokens"):
            rows.append((f"{name}: {key}", m.get(key)))
    return rows


def plot(path: str | Path, policies: Mapping[str, Mapping[str, Any]], title: str) -> None:
    """Per policy: bars of teacher-forced agreement and greedy match (left), stored
    bytes per token relative to fp16 (right), the targets as dashed lines."""
    from contextkit.config import require

    matplotlib = require("matplotlib", "plot")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(policies)
    x = range(len(names))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.38
    for offset, key, label in ((-width / 2, "teacher_forced_agreement", "teacher-forced top-1"),
                               (width / 2, "greedy_match", "32-token reply identical")):
        ax.bar([i + offset for i in x], [policies[n].get(key) or 0.0 for n in names], width,
               label=label)
    ax.axhline(ACCEPTANCE["teacher_forced_agreement"][1], color="grey", linestyle="--",
               linewidth=1)
    ax.axhline(ACCEPTANCE["greedy_match"][1], color="grey", linestyle=":", linewidth=1)
    ax.set_xticks(list(x), names, rotation=25, ha="right")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("agreement with the cold server")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=2)
    ax.set_title(title, fontsize=10)
    ax2.bar(list(x), [policies[n].get("vs_fp16") or 0.0 for n in names], 0.5, color="tab:green")
    ax2.axhline(ACCEPTANCE["vs_fp16"][1], color="grey", linestyle="--", linewidth=1)
    ax2.set_xticks(list(x), names, rotation=25, ha="right")
    ax2.set_ylabel("stored bytes per token / fp16")
    ax2.set_title("stored size", fontsize=10)
    for axis in (ax, ax2):
        axis.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
