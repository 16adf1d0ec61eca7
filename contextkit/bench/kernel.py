"""``contextkit bench kernel``: TQ4 paged decode attention vs unquantized SDPA.

One layer, batch 1, Llama-3-8B attention shape (32 query heads, 8 KV heads,
head_dim 128), at growing context lengths. The TQ4 side reads the packed cache
through a scattered block table (Triton on CUDA, the torch path on CPU); the
baseline is ``torch.nn.functional.scaled_dot_product_attention`` over contiguous
K/V (float16 on CUDA, float32 on CPU). On CUDA the result also gives the bandwidth
the kernel achieved on the packed bytes and, for scale, that of a plain
device-to-device copy of the same bytes.

CUDA timing: each side runs back to back over enough distinct copies of its cache
that together they are >= 3x the L2 (at most 64 copies), so every call reads HBM as a
decode step inside a model does (other layers' weights and KV evict the L2 between two
calls of one layer); ``triton.testing.do_bench`` times them with CUDA events (median).
``*_ms`` are eager launches, ``*_graph_ms`` the same calls replayed from one CUDA graph,
as vLLM runs decode (no per-kernel launch cost); ``ratio`` and ``ratio_graph`` are
SDPA's time over TQ4's.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from contextkit.bench._common import (
    machine_info,
    median_seconds,
    positive_float,
    positive_int,
    print_table,
)

if TYPE_CHECKING:
    from gpu_cache.kernels import Backend

__all__ = ["HELP", "add_arguments", "run"]

HELP = "decode attention over the packed TQ4 cache vs unquantized SDPA (one layer, batch 1)"

NUM_Q_HEADS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
BLOCK_SIZE = 16
DEFAULT_CONTEXTS = "1K,2K,4K,8K,16K,32K"


def _parse_contexts(text: str) -> list[int]:
    """``"1K,2K,512"`` -> ``[1024, 2048, 512]``."""
    out = []
    for item in text.split(","):
        item = item.strip().upper()
        if not item:
            continue
        mult = 1024 if item.endswith("K") else 1
        try:
            value = int(item.rstrip("K")) * mult
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"bad context {item!r}; use token counts like 512,1K,32K"
            ) from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"context must be >= 1 token, got {item!r}")
        out.append(value)
    if not out:
        raise argparse.ArgumentTypeError("give at least one context length")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--contexts", type=_parse_contexts, default=DEFAULT_CONTEXTS,
                        help=f"comma-separated context lengths (default {DEFAULT_CONTEXTS})")
    parser.add_argument("--backend", choices=["auto", "triton", "torch", "cpu"], default="auto",
                        help="TQ4 kernel backend (auto: Triton on CUDA; on CPU the fused "
                             "compiled kernel when it builds, else torch)")
    parser.add_argument("--device", default=None,
                        help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads for the run (default: leave torch's setting)")
    parser.add_argument("--seconds", type=positive_float, default=None,
                        help="timing budget per measurement (default 1.0 on CPU, 0.5 on CUDA)")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="also draw the result: times by context and, with --sweep, "
                             "each launch setting's speed against SDPA")
    parser.add_argument("--from-json", default=None, metavar="FILE",
                        help="measure nothing: read a result this bench wrote (e.g. on a "
                             "GPU machine) and draw it with --plot")
    parser.add_argument("--sweep", action="store_true",
                        help="CUDA with Triton: also time the decode kernel's alternative "
                             "launch settings (tile size, warps, stages, float16 tiles, "
                             "centroid lookup, splits) at each context, against the exact "
                             "float32 launch")


def _time(fn: Any, device: torch.device, budget_s: float) -> float:
    """Median seconds of ``fn``, with as many repeats as fit in ``budget_s``."""
    first = median_seconds(fn, repeats=1, warmup=1, device=device)
    repeats = int(min(200, max(3, budget_s / max(first, 1e-6))))
    return median_seconds(fn, repeats=repeats, warmup=0, device=device)


def _l2_bytes(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or 64 << 20)


def _num_copies(nbytes: int, device: torch.device) -> int:
    """Distinct copies of an ``nbytes`` working set that together cover >= 3x the L2."""
    return max(1, min(64, math.ceil(3 * _l2_bytes(device) / max(1, nbytes))))


def _cuda_seconds(fns: Sequence[Callable[[], Any]], budget_s: float, graph: bool) -> float:
    """Seconds per call of ``fns`` run back to back (each over its own copy of the data),
    eager or replayed from one CUDA graph; CUDA-event median over ``budget_s``."""

    def body() -> None:
        for fn in fns:
            fn()

    run: Callable[[], Any] = body
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the default stream, as capture wants
            body()
            body()
        torch.cuda.current_stream().wait_stream(stream)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            body()
        run = cuda_graph.replay
    from triton.testing import do_bench

    ms = do_bench(run, warmup=max(1, int(budget_s * 250)), rep=max(1, int(budget_s * 1000)),
                  return_mode="median")
    return float(ms) / 1e3 / len(fns)


def _resolve_backend(backend: str, device: torch.device) -> Backend:
    if backend in ("triton", "torch", "cpu"):
        return cast("Backend", backend)
    from importlib.util import find_spec

    if device.type == "cuda":
        return "triton" if find_spec("triton") else "torch"
    from gpu_cache.kernels import cpu_decode

    return "cpu" if cpu_decode.fused_available() else "torch"


def _compiled_info() -> dict[str, dict[str, Any]] | None:
    """Registers, spills and shared memory of the Triton kernels last launched."""
    from gpu_cache.kernels import triton_ops

    out = {}
    for name, kernel in triton_ops.LAST_COMPILED.items():
        fields = {f: getattr(kernel, f, None) for f in ("n_regs", "n_spills", "shared")}
        if any(v is not None for v in fields.values()):
            out[name] = fields
    return out or None


def _has_triton() -> bool:
    from importlib.util import find_spec

    return find_spec("triton") is not None


def _cuda_row(context: int, layer: list[torch.Tensor], kv: tuple[torch.Tensor, torch.Tensor],
              tq4: Callable[..., Any], sdpa: Callable[..., Any], packed_bytes: int,
              device: torch.device, budget_s: float) -> dict[str, Any]:
    """One context on CUDA: eager and graph timings of both sides over cold-L2 copies."""
    fp16_bytes = sum(t.numel() * t.element_size() for t in kv)
    tq4_copies = [[t.clone() for t in layer] for _ in range(_num_copies(packed_bytes, device))]
    sdpa_copies = [tuple(t.clone() for t in kv) for _ in range(_num_copies(fp16_bytes, device))]
    tq4_fns = [lambda c=c: tq4(layer=c) for c in tq4_copies]
    sdpa_fns = [lambda c=c: sdpa(keys=c[0], values=c[1]) for c in sdpa_copies]
    tq4_s = _cuda_seconds(tq4_fns, budget_s, graph=False)
    sdpa_s = _cuda_seconds(sdpa_fns, budget_s, graph=False)
    row: dict[str, Any] = {
        "context": context, "tq4_ms": tq4_s * 1e3, "sdpa_ms": sdpa_s * 1e3,
        "ratio": sdpa_s / tq4_s, "copies_tq4": len(tq4_copies),
        "copies_sdpa": len(sdpa_copies), "packed_bytes": packed_bytes,
        "fp16_bytes": fp16_bytes,
    }
    try:
        tq4_g = _cuda_seconds(tq4_fns, budget_s, graph=True)
        sdpa_g = _cuda_seconds(sdpa_fns, budget_s, graph=True)
        row.update(tq4_graph_ms=tq4_g * 1e3, sdpa_graph_ms=sdpa_g * 1e3,
                   ratio_graph=sdpa_g / tq4_g,
                   achieved_graph_gbps=packed_bytes / tq4_g / 1e9,
                   sdpa_graph_gbps=fp16_bytes / sdpa_g / 1e9)
    except RuntimeError as exc:  # a capture the runtime refuses: keep the eager figures
        row.update(tq4_graph_ms=None, sdpa_graph_ms=None, ratio_graph=None,
                   graph_error=str(exc).splitlines()[0][:200])
    src = torch.empty(max(packed_bytes, 3 * _l2_bytes(device)), dtype=torch.uint8,
                      device=device)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    copy_s = _cuda_seconds([copy], budget_s, graph=False)
    row["achieved_gbps"] = packed_bytes / tq4_s / 1e9
    row["sdpa_gbps"] = fp16_bytes / sdpa_s / 1e9
    row["copy_gbps"] = 2 * src.numel() / copy_s / 1e9  # read + write traffic
    return row


def _sweep_configs() -> list[Any]:
    """The exact float32 launch first (the others' reference), then the CUDA default,
    then one or two changes from it at a time."""
    from gpu_cache.kernels.decode_config import CUDA_DECODE, EXACT_DECODE, DecodeConfig

    def f16(**changes: Any) -> DecodeConfig:
        return DecodeConfig(**{"fp16": True, "lookup": "table", **changes})

    variants = [
        CUDA_DECODE, DecodeConfig(lookup="table"), DecodeConfig(lookup="table", num_warps=2),
        f16(num_warps=4), f16(num_warps=2, splits_per_sm=4), f16(num_warps=2, num_stages=1),
        f16(num_warps=2, block_n=128), f16(num_warps=2, block_n=32), f16(num_warps=1),
    ]
    out = [EXACT_DECODE]
    for v in variants:
        if v not in out:
            out.append(v)
    return out


def _sweep_rows(context: int, layer: list[torch.Tensor], args: tuple[Any, ...],
                sdpa_graph_ms: float | None, packed_bytes: int, device: torch.device,
                budget_s: float) -> list[dict[str, Any]]:
    """Every :func:`_sweep_configs` launch at one context: eager and graph times over
    cold-L2 copies, compiled registers/spills, and its largest difference from the
    exact launch's output (relative to that output's largest magnitude)."""
    from gpu_cache.kernels import triton_ops

    query, table, seq_lens, codec, scale = args
    copies = [[t.clone() for t in layer] for _ in range(_num_copies(packed_bytes, device))]
    rows: list[dict[str, Any]] = []
    base_out: torch.Tensor | None = None
    for cfg in _sweep_configs():
        row: dict[str, Any] = {"context": context, "config": cfg.label()}

        def call(c: list[torch.Tensor], cfg: Any = cfg) -> torch.Tensor:
            k_packed, k_norms, v_packed, v_norms = c
            out = triton_ops.tq4_decode_attention_triton(
                query, k_packed, k_norms, v_packed, v_norms, table, seq_lens, codec, scale,
                config=cfg)
            return cast("torch.Tensor", out)

        try:
            out = call(layer)
            if base_out is None:
                base_out = out
            row["max_rel_diff"] = float((out - base_out).abs().max()
                                        / base_out.abs().max().clamp_min(1e-12))
            row["compiled"] = _compiled_info()
            fns = [lambda c=c: call(c) for c in copies]
            eager = _cuda_seconds(fns, budget_s, graph=False)
            graph = _cuda_seconds(fns, budget_s, graph=True)
            row.update(tq4_ms=eager * 1e3, tq4_graph_ms=graph * 1e3,
                       achieved_graph_gbps=packed_bytes / graph / 1e9)
            if sdpa_graph_ms is not None:
                row["ratio_graph"] = sdpa_graph_ms / (graph * 1e3)
        except Exception as exc:  # a setting this Triton or device refuses: report it
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        rows.append(row)
    return rows


def plot(path: str, result: dict[str, Any]) -> None:
    """Graph-replay (else eager) ms of both attentions by context; with a sweep, each
    launch setting's SDPA/TQ4 ratio by context."""
    from contextkit.config import require

    matplotlib = require("matplotlib", "plot")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["contexts"]
    key = "graph_ms" if rows and rows[0].get("tq4_graph_ms") is not None else "ms"
    sweep = result.get("sweep") or []
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(13 if sweep else 6.5, 4.5),
                             squeeze=False)
    ax = axes[0][0]
    ctx = [r["context"] for r in rows]
    ax.plot(ctx, [r[f"tq4_{key}"] for r in rows], "o-", label=f"TQ4 ({result['backend']})")
    ax.plot(ctx, [r[f"sdpa_{key}"] for r in rows], "s--",
            label=f"SDPA ({result['shape']['sdpa_dtype']})")
    ax.set(xscale="log", yscale="log", xlabel="context tokens", ylabel=key.replace("_", " "),
           title=f"decode attention, {result['machine'].get('device_name', 'cpu')}")
    ax.legend()
    if sweep:
        ax = axes[0][1]
        for label in dict.fromkeys(r["config"] for r in sweep):
            pts = [r for r in sweep if r["config"] == label and r.get("ratio_graph")]
            if pts:
                ax.plot([r["context"] for r in pts], [r["ratio_graph"] for r in pts], "o-",
                        label=label, linewidth=1)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set(xscale="log", xlabel="context tokens", ylabel="SDPA time / TQ4 time (graph)",
               title="launch settings (higher is faster)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time both attentions at every context; print a table; return the JSON result."""
    if getattr(args, "from_json", None):
        result = _read_result(args.from_json)
        if args.plot:
            plot(args.plot, result)
        return result
    result = _measure(args)
    if getattr(args, "plot", None):
        plot(args.plot, result)
    return result


def _read_result(path: str) -> dict[str, Any]:
    import json

    try:
        with open(path, encoding="utf-8") as fh:
            result = json.load(fh)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--from-json {path}: cannot read it ({exc}); give a file that "
                         "`contextkit bench kernel --json` wrote") from None
    if not isinstance(result, dict) or result.get("bench") != "kernel":
        raise SystemExit(f"--from-json {path}: not a `bench kernel` result")
    return result


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    from gpu_cache.codec import TQ4Codec
    from gpu_cache.kernels import tq4_decode_attention

    if args.threads is not None:
        torch.set_num_threads(max(1, args.threads))
    contexts = args.contexts
    if isinstance(contexts, str):
        contexts = _parse_contexts(contexts)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backend = _resolve_backend(args.backend, device)
    budget_s = args.seconds if args.seconds is not None else (
        0.5 if device.type == "cuda" else 1.0)
    sdpa_dtype = torch.float16 if device.type == "cuda" else torch.float32
    cuda_events = device.type == "cuda" and _has_triton()  # do_bench is Triton's
    codec = TQ4Codec(HEAD_DIM, seed=0, device=device)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    gen = torch.Generator(device="cpu").manual_seed(0)
    query = torch.randn(1, NUM_Q_HEADS, HEAD_DIM, generator=gen).to(device)
    q_sdpa = query.to(sdpa_dtype).view(1, NUM_Q_HEADS, 1, HEAD_DIM)

    sweep = bool(getattr(args, "sweep", False)) and cuda_events and backend == "triton"
    rows: list[dict[str, Any]] = []
    sweep_rows: list[dict[str, Any]] = []
    compiled: dict[str, dict[str, Any]] | None = None
    for context in contexts:
        num_blocks = -(-context // BLOCK_SIZE)
        packed_shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, codec.packed_dim)
        # Random codes and norms time exactly like real ones; the bytes read are the same.
        k_packed = torch.randint(0, 256, packed_shape, generator=gen, dtype=torch.uint8)
        v_packed = torch.randint(0, 256, packed_shape, generator=gen, dtype=torch.uint8)
        k_norms = torch.rand(packed_shape[:3], generator=gen) + 0.5
        v_norms = torch.rand(packed_shape[:3], generator=gen) + 0.5
        layer = [t.to(device) for t in (k_packed, k_norms, v_packed, v_norms)]
        table = torch.randperm(num_blocks, generator=gen).to(torch.int32)[None].to(device)
        seq_lens = torch.tensor([context], dtype=torch.int32, device=device)

        def tq4(layer=layer, table=table, seq_lens=seq_lens):
            k_packed, k_norms, v_packed, v_norms = layer
            return tq4_decode_attention(query, k_packed, k_norms, v_packed, v_norms, table,
                                        seq_lens, codec, scale, backend=backend,
                                        check_bounds=False)

        keys = torch.randn(1, NUM_KV_HEADS, context, HEAD_DIM, generator=gen).to(device,
                                                                                sdpa_dtype)
        values = torch.randn(1, NUM_KV_HEADS, context, HEAD_DIM, generator=gen).to(device,
                                                                                  sdpa_dtype)
        def sdpa(keys=keys, values=values):
            return torch.nn.functional.scaled_dot_product_attention(
                q_sdpa, keys, values, scale=scale, enable_gqa=True)

        packed_bytes = sum(t.numel() * t.element_size() for t in layer)
        if cuda_events:
            row = _cuda_row(context, layer, (keys, values), tq4, sdpa, packed_bytes, device,
                            budget_s)
        else:
            tq4_s = _time(tq4, device, budget_s)
            sdpa_s = _time(sdpa, device, budget_s)
            row = {"context": context, "tq4_ms": tq4_s * 1e3, "sdpa_ms": sdpa_s * 1e3,
                   "ratio": sdpa_s / tq4_s}
            if device.type == "cuda":
                src = torch.empty(packed_bytes, dtype=torch.uint8, device=device)
                dst = torch.empty_like(src)
                copy_s = _time(lambda dst=dst, src=src: dst.copy_(src), device, budget_s)
                row["achieved_gbps"] = packed_bytes / tq4_s / 1e9
                row["copy_gbps"] = 2 * packed_bytes / copy_s / 1e9  # read + write traffic
        rows.append(row)
        compiled = _compiled_info() if backend == "triton" else None
        if sweep:
            sweep_rows += _sweep_rows(context, layer, (query, table, seq_lens, codec, scale),
                                      row.get("sdpa_graph_ms"), packed_bytes, device,
                                      budget_s)
        del keys, values, layer

    table_rows = []
    for row in rows:
        text = (f"tq4 {row['tq4_ms']:9.3f} ms   sdpa {row['sdpa_ms']:9.3f} ms   "
                f"sdpa/tq4 {row['ratio']:5.2f}")
        if row.get("ratio_graph") is not None:
            text += (f"   graph: tq4 {row['tq4_graph_ms']:7.3f} sdpa {row['sdpa_graph_ms']:7.3f}"
                     f" ms, sdpa/tq4 {row['ratio_graph']:5.2f}")
        if "achieved_gbps" in row:
            text += f"   {row['achieved_gbps']:7.1f} GB/s (copy {row['copy_gbps']:7.1f})"
        table_rows.append((f"{row['context']:>6} tokens", text))
    print_table(
        f"decode attention, {backend} TQ4 vs {str(sdpa_dtype).removeprefix('torch.')} SDPA "
        f"on {device.type} (Hq {NUM_Q_HEADS}, Hkv {NUM_KV_HEADS}, D {HEAD_DIM}, batch 1)",
        table_rows,
    )
    if sweep_rows:
        print_table("decode kernel launch settings (graph ms, sdpa/tq4, max diff vs exact)", [
            (f"{r['context']:>6} {r['config']}",
             r.get("error") or f"{r['tq4_graph_ms']:7.3f} ms  {r.get('ratio_graph', 0):5.2f}  "
                               f"{r['achieved_graph_gbps']:7.1f} GB/s  "
                               f"diff {r['max_rel_diff']:.1e}  {r['compiled']}")
            for r in sweep_rows])
    return {
        "bench": "kernel",
        "backend": backend,
        "compiled": compiled,
        "timing": ("CUDA events (triton.testing.do_bench median), each call over a distinct "
                   "copy of its cache, copies >= 3x L2; eager and CUDA graph"
                   if cuda_events else
                   "wall clock per call after a device sync, median"),
        "machine": machine_info(),
        "shape": {
            "batch": 1,
            "num_q_heads": NUM_Q_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "sdpa_dtype": str(sdpa_dtype).removeprefix("torch."),
        },
        "contexts": rows,
        "sweep": sweep_rows or None,
    }
