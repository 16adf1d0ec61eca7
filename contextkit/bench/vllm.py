"""vLLM bench: answers and TTFT of agent prompts, cold vs after a restart with recovery,
per precision policy of the connector.

Runs inside the vLLM virtualenv (``make test-vllm`` creates ``.venv-vllm``). The
prompts are ``--prompts`` turns of the agent replay (layered system prompt,
conversation, user message; :mod:`contextkit.workloads.vllm_prompts`), each with its
layer labels and its own ``cache_salt``. For each policy of ``--policies`` (see
:data:`contextkit.bench._vllm_report.POLICIES`), in its own work folder:

1. a vLLM process with ``ContextKitConnector`` serves the prompts once each (cold:
   nothing stored; the connector stores their blocks in the formats the policy
   chooses from the labels and shadows them), then stops;
2. ``contextkit recover --for-vllm`` restores the shadow into the connector's store
   (its summary gives the stored bytes per token, per format);
3. a new vLLM process serves the same prompts; the connector loads their prefixes.

TTFT is vLLM's own ``first_token_latency`` per request (arrival to first token),
median over the prompts. ``external_hit_tokens`` is what the connector reported as
matched *and* its worker loaded (median over prompts). ``greedy_match`` is the
fraction of prompts whose ``--max-tokens`` greedy reply is identical to the cold
server's; ``greedy_prefix_match`` the mean length of the identical prefix;
``greedy_token_match`` the fraction of positions that agree. ``teacher_forced_agreement``
scores every position: fed the cold run's tokens, does the recovered server pick
the same next token? ``vs_fp16`` is the stored bytes per token over fp16's.

The top-level keys of the old single-policy bench are the default policy's
(``importance``, the server's default), with ``acceptance``: issue 17's targets.
The vLLM processes are started by module name (``integrations.vllm.bench.harness``), so
contextkit imports nothing from integrations.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from contextkit.bench._common import machine_info, positive_int, print_table
from contextkit.bench._vllm_report import (
    DEFAULT_POLICY,
    POLICIES,
    acceptance,
    parse_policies,
    plot,
    policy_config,
    policy_dirname,
    policy_metrics,
    table_rows,
)

__all__ = ["HELP", "add_arguments", "build_prompts", "run"]

HELP = ("answers and TTFT of agent prompts on vLLM (CPU), cold vs after a restart with "
        "recovery, per precision policy")
#: ``--out`` names a JSON file; the CLI writes the result there with its provenance.
OUT_IS_JSON = True

#: figures of the default policy repeated at the top level (the old bench's keys)
_TOP_LEVEL = ("ttft_cold_ms", "ttft_recovered_ms", "speedup", "external_hit_tokens",
              "greedy_match", "greedy_prefix_match", "greedy_token_match",
              "teacher_forced_agreement", "first_token_match", "bytes_per_token", "vs_fp16",
              "ttft_cold_ms_each", "ttft_recovered_ms_each", "recovered_blocks",
              "recover_seconds")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-tokens", type=positive_int, default=2048,
                        help="tokens per prompt, at most (default 2048)")
    parser.add_argument("--prompts", type=positive_int, default=8,
                        help="agent prompts (replay turns), each measured once per run "
                             "(default 8)")
    parser.add_argument("--max-tokens", type=positive_int, default=32,
                        help="greedy tokens generated per prompt (default 32)")
    parser.add_argument("--block-size", type=positive_int, default=32)
    parser.add_argument("--policies", type=parse_policies, default=list(POLICIES),
                        help=f"comma-separated connector policies to compare (default "
                             f"{','.join(POLICIES)})")
    parser.add_argument("--model", default=None,
                        help="model directory (default: the packaged SmolLM2, converted); "
                             "its tokenizer must be SmolLM2's (the prompts are built with it)")
    parser.add_argument("--dir", default=None,
                        help="work directory for the shadows and local stores (default: temp)")
    parser.add_argument("--out", default=None,
                        help="also write the JSON result (with its provenance) here")
    parser.add_argument("--plot", default=None,
                        help="write a PNG: agreement and stored size per policy")


def build_prompts(num: int, prompt_tokens: int, model_dir: str | None = None
                  ) -> list[dict[str, Any]]:
    """The bench's labelled agent prompts, built with the packaged SmolLM2 on the
    embedded engine (no generation), which is then released.

    Raises:
        SystemExit: ``model_dir``'s tokenizer is not the packaged model's, or
            ``prompt_tokens`` is too few for the agent prompt (one line each).
    """
    import gc

    from contextkit.engine.engine import Engine, tokenizer_fingerprint
    from contextkit.workloads.vllm_prompts import agent_prompts

    engine = Engine.from_pretrained(num_device_blocks=8, num_host_blocks=8)
    try:
        if model_dir is not None:
            from transformers import AutoTokenizer

            theirs = tokenizer_fingerprint(AutoTokenizer.from_pretrained(model_dir))
            ours = tokenizer_fingerprint(engine.tokenizer)
            if theirs != ours:
                raise SystemExit(f"--model {model_dir}: its tokenizer ({theirs}) is not the "
                                 f"packaged SmolLM2's ({ours}) the agent prompts are built "
                                 f"with; serve a SmolLM2 model")
        try:
            return agent_prompts(engine, num, prompt_tokens)
        except ValueError as exc:
            raise SystemExit(f"contextkit bench vllm: {exc}") from None
    finally:
        del engine
        gc.collect()


def _run(cmd: list[str], log: Path) -> None:
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False)
    if proc.returncode:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}); "
                           f"log {log}:\n{tail}")


def _policy_run(name: str, work: Path, model_dir: str, prompts_file: Path,
                args: argparse.Namespace) -> dict[str, Any]:
    """Cold process -> ``recover --for-vllm`` -> recovered process, for one policy."""
    pdir = work / policy_dirname(name)
    shutil.rmtree(pdir, ignore_errors=True)
    pdir.mkdir(parents=True)
    config = policy_config(name, {
        "block_size": args.block_size, "shadow_url": f"file://{pdir / 'shadow'}",
        "local_store": f"file://{pdir / 'local'}", "stats_path": str(pdir / "stats.jsonl")})
    harness = [sys.executable, "-m", "integrations.vllm.bench.harness", "--model", model_dir,
               "--connector-config", json.dumps(config), "--prompts", str(prompts_file),
               "--max-tokens", str(args.max_tokens), "--block-size", str(args.block_size)]
    t0 = time.perf_counter()
    _run([*harness, "--out", str(pdir / "cold.json")], pdir / "cold.log")
    t1 = time.perf_counter()
    _run([sys.executable, "-m", "contextkit.cli", "recover", "--for-vllm", "--model", model_dir,
          "--connector-config", json.dumps(config), "--json", "--no-progress"],
         pdir / "recover.log")
    recovery = json.loads((pdir / "recover.log").read_text().strip().splitlines()[-1])
    t2 = time.perf_counter()
    cold = json.loads((pdir / "cold.json").read_text())["results"]
    (pdir / "reference.json").write_text(json.dumps([r["token_ids"] for r in cold]))
    _run([*harness, "--out", str(pdir / "recovered.json"),
          "--reference", str(pdir / "reference.json")], pdir / "recovered.log")
    t3 = time.perf_counter()
    recovered = json.loads((pdir / "recovered.json").read_text())
    out = policy_metrics(cold, recovered, recovery)
    out["config"] = {k: config[k] for k in ("codec", "precision") if k in config}
    out["seconds"] = {"cold_process": round(t1 - t0, 1), "recover": round(t2 - t1, 1),
                      "recovered_process": round(t3 - t2, 1)}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    try:
        # vLLM itself, not a directory named vllm on sys.path (pytest puts
        # tests/integrations there, whose vllm/ imports as a namespace package)
        from vllm import __version__  # noqa: F401
    except ImportError:
        raise SystemExit("contextkit bench vllm runs inside the vLLM virtualenv: "
                         "`make test-vllm` creates .venv-vllm, then "
                         "`.venv-vllm/bin/contextkit bench vllm --json`") from None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # vLLM drops to one OpenMP thread "for serving" unless told; use the machine
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    prompts = build_prompts(args.prompts, args.prompt_tokens, args.model)
    if args.model:
        model_dir = args.model
    else:
        from contextkit.engine import models

        model_dir = str(models._convert_once())
    work = Path(args.dir or tempfile.mkdtemp(prefix="ck-bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    policies = {name: _policy_run(name, work, model_dir, prompts_file, args)
                for name in args.policies}
    default = DEFAULT_POLICY if DEFAULT_POLICY in policies else args.policies[0]
    ours = policies[default]
    result: dict[str, Any] = {
        "bench": "vllm",
        **{key: ours.get(key) for key in _TOP_LEVEL},
        "default_policy": default,
        "acceptance": acceptance(ours),
        "policies": policies,
        "prompt_tokens": args.prompt_tokens,
        "prompt_tokens_each": [len(p["token_ids"]) for p in prompts],
        "prompts": args.prompts,
        "prompt_spans": [{"cache_salt": p["cache_salt"], "turn": p["turn"],
                          "spans": p["spans"]} for p in prompts],
        "max_tokens": args.max_tokens,
        "block_size": args.block_size,
        "codec": POLICIES[default].get("codec"),
        "seconds": ours["seconds"],
        "vllm": __import__("vllm").__version__,
        "omp_num_threads": os.environ["OMP_NUM_THREADS"],
        "machine": machine_info(),
    }
    print_table(f"vLLM, {args.prompts} agent prompts of <= {args.prompt_tokens} tokens: "
                f"cold vs restart + recovery, per policy (medians over prompts)",
                [*table_rows(policies),
                 *((f"acceptance ({default}): {k}", v) for k, v in result["acceptance"].items())])
    if args.plot:
        plot(args.plot, policies, f"vLLM {result['vllm']}, {args.prompts} agent prompts")
    if not args.dir:
        shutil.rmtree(work, ignore_errors=True)
    return result
