"""How long the connector's own forward takes (chunk reuse's seams and changed spans),
by the number and layout of the tokens it computes, on this machine.

    .venv-vllm/bin/python scripts/chunk_pass_timings.py [--context 2700] [--json OUT]

Starts vLLM's offline engine (the CPU build, the packaged SmolLM2, float32) with
contextkit's connector and chunk reuse on, then, on its worker, times
:meth:`~integrations.vllm.chunk_forward.ServedLlama.forward` over chosen positions of a
context of ``--context`` tokens in vLLM's pages (median of 7 after one warm-up), with
the connector's projection and attention dtypes; where its attention runs in a lower
dtype than the model's, also in the model's, the two taking turns (every size, past
the connector's own threshold). vLLM's own prefill of as many new tokens after a
cached prefix is timed beside it (``LLM.generate``, one output token: its scheduling
and sampling included). Takes about 2 minutes on 2 cores; nothing else
should run beside it. docs/chunks.md cites its figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: name -> the positions computed, as offsets back from the context's end
CASES: dict[str, list[int]] = {
    "1 token": [1],
    "4 tokens": list(range(4, 0, -1)),
    "16 tokens": list(range(16, 0, -1)),
    "5 seams of 4": [back - i for back in (1500, 1200, 900, 600, 300) for i in range(4)],
    "40 tokens": list(range(40, 0, -1)),
    "250 tokens": list(range(250, 0, -1)),
}


def _median_ms(fn: Any, reps: int = 5) -> float:
    return _medians_ms({"": fn}, reps)[""]


def _medians_ms(fns: dict[str, Any], reps: int = 5) -> dict[str, float]:
    """Each function's median time after one warm-up, the functions taking turns
    within every repetition (drift hits them alike)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: round(statistics.median(t) * 1000, 1) for name, t in times.items()}


def _connector_pass(worker: Any, context: int) -> dict[str, Any]:
    """On the worker (``collective_rpc``): the served model's pass per case."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from integrations.vllm.chunk_forward import PagedKV

    connector = get_kv_transfer_group().worker
    model = connector._served
    if model is None:
        return {"error": "chunk reuse is off on this server (see its log)"}
    blocks = -(-context // connector.block_size)
    paged = PagedKV([connector._pages[name] for name in connector._names],
                    connector._layout.split, connector._key_order,
                    list(range(1, blocks + 1)), connector.block_size, isa=connector._isa)
    low = model.attention_dtype
    model.low_attention_from = 1  # both dtypes at every size: where the cast pays
    out: dict[str, Any] = {"matmul_dtype": str(model.matmul_dtype or "model"),
                           "attention": connector._isa or "torch",
                           "attention_dtype": str(low or "model")}
    for name, backs in CASES.items():
        positions = [context - back for back in backs]
        ids = [100 + p % 1000 for p in positions]
        # the connector's attention dtype, and (where it is lower) the model's beside it
        dtypes = {name: low}
        if low is not None:
            dtypes[f"{name}, attention in the model's dtype"] = None

        def run(dtype: Any, p: list[int] = positions, i: list[int] = ids) -> None:
            model.attention_dtype = dtype
            model.forward(i, p, paged)

        out.update(_medians_ms({key: (lambda d=dtype: run(d)) for key, dtype in dtypes.items()},
                               reps=7))
        model.attention_dtype = low
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=2700,
                        help="tokens of context in the pages (default 2700)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(fn)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from integrations.vllm.config import ConnectorConfig, kv_transfer_config
    from integrations.vllm.model import packaged_model_dir
    from integrations.vllm.served_model import LOAD_FORMAT

    work = tempfile.mkdtemp(prefix="ck-chunk-pass-")
    config = ConnectorConfig(block_size=32, shadow_url="", local_store=f"file://{work}/local",
                             chunk_reuse=True)
    llm = LLM(model=str(packaged_model_dir()), dtype="float32", block_size=32,
              max_model_len=args.context + 512, enforce_eager=True, seed=0,
              load_format=LOAD_FORMAT,
              kv_transfer_config=KVTransferConfig(**kv_transfer_config(config)))
    one = SamplingParams(max_tokens=1, temperature=0)
    for _ in range(3):  # the engine's first requests are slower (warm-up)
        llm.generate([{"prompt_token_ids": list(range(500, 900))}], one, use_tqdm=False)
    vllm_ms: dict[str, float] = {}
    for n in (4, 40, 250):
        base = list(range(1000, 1000 + args.context - n))
        llm.generate([{"prompt_token_ids": base}], one, use_tqdm=False)  # cached prefix
        turn = iter(range(10**6))  # a new token each request: nothing past base cached
        vllm_ms[f"{n} tokens"] = _median_ms(lambda b=base, k=n, t=turn: llm.generate(
            [{"prompt_token_ids": b + [50 + next(t) % 900] * k}], one, use_tqdm=False))
    connector = llm.collective_rpc(_connector_pass, kwargs={"context": args.context})[0]
    result = {"context": args.context, "connector_pass_ms": connector,
              "vllm_generate_ms": vllm_ms}
    print(f"context {args.context} tokens; projections {connector.get('matmul_dtype')}, "
          f"attention {connector.get('attention')} in {connector.get('attention_dtype')}")
    for name in CASES:
        line = f"  {name:>14}: connector pass {connector.get(name, '-'):>7} ms"
        model_dtype = connector.get(f"{name}, attention in the model's dtype")
        if model_dtype is not None:
            line += f" (attention in the model's dtype {model_dtype:>7} ms)"
        if name in vllm_ms:
            line += f"   vLLM prefill (generate) {vllm_ms[name]:>7} ms"
        print(line)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
