"""vLLM bench: TTFT of a ~2K-token prompt cold vs after a vLLM restart with recovery.

Runs inside the vLLM virtualenv (``make test-vllm`` creates ``.venv-vllm``):

1. a vLLM process with ``ContextKitConnector`` serves ``--prompts`` distinct ~2K-token
   prompts once each (cold: nothing stored; the connector stores their blocks TQ4 in
   its DDR tier and shadows them), then stops;
2. ``contextkit recover --for-vllm`` restores the shadow into the connector's store;
3. a new vLLM process serves the same prompts; the connector loads their prefixes.

TTFT is vLLM's own ``first_token_latency`` per request (arrival to first token),
median over the prompts. ``external_hit_tokens`` is what the connector reported as
matched *and* its worker loaded (median over prompts). ``greedy_match`` is the
fraction of positions where the free-running greedy tokens of the two runs agree
(``--max-tokens`` each; TQ4 is lossy, and once a token differs the rest usually
differs too; ``greedy_prefix_match`` is the mean length of the identical prefix).
``teacher_forced_agreement`` scores every position: fed the cold run's tokens, does
the recovered server pick the same next token?

The vLLM processes are started by module name (``integrations.vllm.harness``), so
contextkit imports nothing from integrations.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from contextkit.bench._common import machine_info, positive_int, print_table, write_result

__all__ = ["HELP", "add_arguments", "run"]

HELP = "TTFT of a ~2K-token prompt on vLLM (CPU): cold vs after a restart with recovery"

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-tokens", type=positive_int, default=2048,
                        help="tokens per prompt (default 2048)")
    parser.add_argument("--prompts", type=positive_int, default=3,
                        help="distinct prompts, each measured once per run (default 3)")
    parser.add_argument("--max-tokens", type=positive_int, default=32,
                        help="greedy tokens generated per prompt (default 32)")
    parser.add_argument("--block-size", type=positive_int, default=32)
    parser.add_argument("--codec", default="tq4", choices=("tq4",))
    parser.add_argument("--model", default=None,
                        help="model directory (default: the packaged SmolLM2, converted)")
    parser.add_argument("--dir", default=None,
                        help="work directory for the shadow and local store (default: temp)")
    parser.add_argument("--out", default=None, help="also write the JSON result here")


def _prompts(tokenizer_dir: str, num: int, length: int) -> list[list[int]]:
    """``num`` distinct prompts of ``length`` tokens, cut from the standard library's
    argparse source (stable for a Python version, unlike the repository's files)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok.encode(Path(argparse.__file__ or "").read_text())
    while len(ids) < length + num * 97:
        ids = ids + ids
    # distinct from the first token on: no prompt shares a block with another
    return [ids[i * 97: i * 97 + length] for i in range(num)]


def _run(cmd: list[str], log: Path) -> None:
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False)
    if proc.returncode:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}); "
                           f"log {log}:\n{tail}")


def _greedy(a: list[int], b: list[int]) -> tuple[float, int]:
    same = sum(x == y for x, y in zip(a, b, strict=False))
    prefix = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                  min(len(a), len(b)))
    return same / max(1, len(a)), prefix


def run(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise SystemExit("contextkit bench vllm runs inside the vLLM virtualenv: "
                         "`make test-vllm` creates .venv-vllm, then "
                         "`.venv-vllm/bin/contextkit bench vllm --json`") from None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # vLLM drops to one OpenMP thread "for serving" unless told; use the machine
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    if args.model:
        model_dir = args.model
    else:
        from contextkit import models

        model_dir = str(models._convert_once())
    work = Path(args.dir or tempfile.mkdtemp(prefix="ck-bench-vllm-"))
    for sub in ("shadow", "local"):
        shutil.rmtree(work / sub, ignore_errors=True)
    stats = work / "stats.jsonl"
    stats.unlink(missing_ok=True)
    config = {"block_size": args.block_size, "codec": args.codec,
              "shadow_url": f"file://{work / 'shadow'}", "local_store": f"file://{work / 'local'}",
              "stats_path": str(stats)}
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps(_prompts(model_dir, args.prompts, args.prompt_tokens)))
    harness = [sys.executable, "-m", "integrations.vllm.harness", "--model", model_dir,
               "--connector-config", json.dumps(config), "--prompts", str(prompts_file),
               "--max-tokens", str(args.max_tokens), "--block-size", str(args.block_size)]
    t0 = time.perf_counter()
    _run([*harness, "--out", str(work / "cold.json")], work / "cold.log")
    t1 = time.perf_counter()
    _run([sys.executable, "-m", "contextkit.cli", "recover", "--for-vllm", "--model", model_dir,
          "--connector-config", json.dumps(config), "--json", "--no-progress"],
         work / "recover.log")
    recovery = json.loads((work / "recover.log").read_text().strip().splitlines()[-1])
    t2 = time.perf_counter()
    cold = json.loads((work / "cold.json").read_text())["results"]
    (work / "reference.json").write_text(json.dumps([r["token_ids"] for r in cold]))
    _run([*harness, "--out", str(work / "recovered.json"),
          "--reference", str(work / "reference.json")], work / "recovered.log")
    t3 = time.perf_counter()
    recovered = json.loads((work / "recovered.json").read_text())
    warm = recovered["results"]
    agreement = recovered["teacher_forced_agreement"]
    ttft_cold = statistics.median(r["ttft_ms"] for r in cold)
    ttft_warm = statistics.median(r["ttft_ms"] for r in warm)
    matches = [_greedy(a["token_ids"], b["token_ids"]) for a, b in zip(cold, warm, strict=True)]
    hits = [(r["connector"] or {}).get("external_hit_tokens", 0) for r in warm]
    result: dict[str, Any] = {
        "bench": "vllm",
        "ttft_cold_ms": round(ttft_cold, 1),
        "ttft_recovered_ms": round(ttft_warm, 1),
        "speedup": round(ttft_cold / ttft_warm, 2) if ttft_warm else None,
        "external_hit_tokens": int(statistics.median(hits)),
        "greedy_match": round(statistics.mean(m[0] for m in matches), 4),
        "greedy_prefix_match": round(statistics.mean(m[1] for m in matches), 2),
        "teacher_forced_agreement": round(statistics.mean(agreement), 4),
        "first_token_match": sum(a["token_ids"][:1] == b["token_ids"][:1]
                                 for a, b in zip(cold, warm, strict=True)) / len(cold),
        "prompt_tokens": args.prompt_tokens,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "block_size": args.block_size,
        "codec": args.codec,
        "ttft_cold_ms_each": [round(r["ttft_ms"], 1) for r in cold],
        "ttft_recovered_ms_each": [round(r["ttft_ms"], 1) for r in warm],
        "recovered_blocks": recovery.get("snapshot_blocks"),
        "recover_seconds": recovery.get("seconds"),
        "seconds": {"cold_process": round(t1 - t0, 1), "recover": round(t2 - t1, 1),
                    "recovered_process": round(t3 - t2, 1)},
        "vllm": __import__("vllm").__version__,
        "omp_num_threads": os.environ["OMP_NUM_THREADS"],
        "machine": machine_info(),
    }
    print_table("vLLM TTFT: cold vs restart + recovery (median over prompts)", [
        ("prompt tokens", args.prompt_tokens),
        ("TTFT cold (ms)", result["ttft_cold_ms"]),
        ("TTFT recovered (ms)", result["ttft_recovered_ms"]),
        ("speedup", result["speedup"]),
        ("external hit tokens", result["external_hit_tokens"]),
        ("greedy match", result["greedy_match"]),
        ("greedy identical prefix", result["greedy_prefix_match"]),
        ("teacher-forced top-1 agreement", result["teacher_forced_agreement"]),
    ])
    if args.out:
        write_result(args.out, result)
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return result
