"""One chunk-reuse scenario on vLLM's offline engine (the CPU build), run in a child
process by ``test_vllm_chunks``: ``python -m tests.integrations.vllm.chunk_probe
SCENARIO OUT_JSON``. Each scenario starts an ``LLM`` with contextkit's connector, sends
its prompts and writes what the tests assert on: the cache reports, vLLM's cached
tokens, the greedy replies and, through ``collective_rpc``, the worker's pages against
a fresh computation by the served model.

Scenarios: ``kv`` (native codec: a moved chunk's K/V against a fresh prefill, opt-out
and foreign requests, sources read for another tenant), ``gate`` (thresholds no model meets:
the model check turns chunk reuse off), ``no-loader`` (vLLM's default loader: the
connector has no model to repair seams with), ``replica-a`` then ``replica-b`` (two
servers one after the other on one shared tier, ``$CK_PROBE_SHARED``: B's first turn
reuses the documents A computed, in another order, from A's span objects; B computes
its seams with bfloat16 projections).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

DOC_WORDS = ("alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota",
             "kappa", "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau")
TENANT = "acme"


def _worker_check(worker: Any, ids: list[int]) -> dict[str, Any]:
    """On the worker (``collective_rpc``): the last chunk load's pages against the
    served model's own full prefill of ``ids``; max abs differences per layer for the
    moved (not recomputed) tokens and for the seam the connector computed right after
    the exact prefix."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from integrations.vllm.chunk_forward import ContiguousKV, PagedKV, served_llama
    from integrations.vllm.served_model import served_model

    connector = get_kv_transfer_group().worker
    chunk = connector.recent_chunks[-1]
    model, _ = served_llama(served_model())
    full = ContiguousKV(model.num_layers, model.num_kv_heads, chunk.end, model.head_dim)
    model.forward(ids[:chunk.end], range(chunk.end), full)
    paged = PagedKV([connector._pages[name] for name in connector._names],
                    connector._layout.split, connector._key_order, chunk.block_ids,
                    connector.block_size)
    computed = set(chunk.compute)
    moved = [p for p in range(chunk.start, chunk.end) if p not in computed]
    # the first run of computed tokens (the first moved document's seam): what precedes
    # it is the rules text, reused where it was computed (the same position, nothing
    # before it), so their context is exact
    seam = [p for i, p in enumerate(chunk.compute) if p == chunk.compute[0] + i]
    unmoved = all(c.position == c.source_position for c in chunk.chunks
                  if c.position < seam[0])
    out: dict[str, Any] = {"start": chunk.start, "end": chunk.end, "moved": len(moved),
                           "seam": len(seam), "before_seam_unmoved": unmoved,
                           "layers": {}}
    for layer in range(model.num_layers):
        k, v = paged.context(layer, chunk.end)
        dk, dv = (k - full.k[layer]).abs(), (v - full.v[layer]).abs()
        out["layers"][layer] = {
            "k_moved": dk[:, moved].max().item(), "v_moved": dv[:, moved].max().item(),
            "k_seam": dk[:, seam].max().item() if seam else 0.0,
            "v_seam": dv[:, seam].max().item() if seam else 0.0}
    return out


def _projections_check(worker: Any, ids: list[int]) -> dict[str, Any]:
    """On the worker: the connector's projection dtype, and the K/V of the last chunk
    load's range computed with its projections against the model's own (relative
    error, the worst layer)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from integrations.vllm.chunk_forward import ContiguousKV

    connector = get_kv_transfer_group().worker
    model, chunk = connector._served, connector.recent_chunks[-1]
    kvs = []
    for exact in (True, False):
        kv = ContiguousKV(model.num_layers, model.num_kv_heads, chunk.end, model.head_dim)
        model.forward(ids[:chunk.end], range(chunk.end), kv, exact=exact)
        kvs.append(kv)
    full, low = kvs

    def rel(a: Any, b: Any) -> float:
        return float(max(((a[i] - b[i]).norm() / b[i].norm()).item() for i in range(len(b))))

    return {"dtype": str(model.matmul_dtype), "rel_k": rel(low.k, full.k),
            "rel_v": rel(low.v, full.v)}


def _foreign_sources(worker: Any) -> dict[str, bool]:
    """On the worker: the last chunk load's source blocks read for their own tenant and
    for another one (the store checks the tenant of every block it hands out)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group().worker
    chunk = connector.recent_chunks[-1]
    keys = list(dict.fromkeys(k for moved in chunk.chunks for k in moved.source_keys))
    # what the worker reads a chunk's sources with
    return {"own": connector.store.export_all(keys, chunk.tenant) is not None,
            "foreign": connector.store.export_all(keys, "globex#ck-chunks") is not None}


def _wait_spans(shared: str, n: int, wait_s: float = 120.0) -> int:
    """The span objects in the shared tier's directory once ``n`` are there (or the
    wait ends): A's uploads are write-behind."""
    import time
    from pathlib import Path

    deadline = time.monotonic() + wait_s
    while True:
        found = len([p for p in Path(shared).rglob("span-*") if p.is_file()])
        if found >= n or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def main(scenario: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(fn)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from contextkit.pipeline.served.wire import cache_report, chunk_salt
    from integrations.vllm.config import ConnectorConfig, kv_transfer_config
    from integrations.vllm.model import packaged_model_dir
    from integrations.vllm.planning import semantic_params
    from integrations.vllm.served_model import LOAD_FORMAT

    work = tempfile.mkdtemp(prefix=f"ck-chunk-probe-{scenario}-")
    overrides: dict[str, Any] = {"chunk_reuse": True}
    if scenario == "kv":  # the model's own projections: exact up to float32 rounding
        overrides.update(codec="native", chunk_matmul_dtype="model")
    if scenario == "replica-b":  # bfloat16 projections on every CPU (AMX or not)
        overrides["chunk_matmul_dtype"] = "bfloat16"
    if scenario == "gate":
        overrides.update(chunk_gate_min_agreement=1.0, chunk_gate_max_kl=0.0)
    shared = os.environ.get("CK_PROBE_SHARED", "")
    if scenario.startswith("replica-"):  # no warm-up: B starts with nothing of A's
        overrides.update(shared_url=f"file://{shared}", shared_warm_share=0.0)
    config = ConnectorConfig(block_size=32, shadow_url="", local_store=f"file://{work}/local",
                             stats_path=f"{work}/stats.jsonl", **overrides)
    kwargs: dict[str, Any] = {}
    if scenario != "no-loader":
        kwargs["load_format"] = LOAD_FORMAT
    llm = LLM(model=str(packaged_model_dir()), dtype="float32", block_size=32,
              max_model_len=4096, enforce_eager=True, seed=0,
              kv_transfer_config=KVTransferConfig(**kv_transfer_config(config)), **kwargs)
    tok = llm.get_tokenizer()
    texts = {name: f"Document {name}: " + " ".join(
        f"the {w} of {name} is {i}" for i, w in enumerate(DOC_WORDS * 2)) for name in "ABCD"}
    system = list(tok.encode("System: answer from the documents. " * 3))

    def build(order: str, question: str) -> tuple[list[int], list[tuple[int, int, str]]]:
        ids, spans = list(system), [(0, len(system), "rules")]
        for name in order:
            piece = tok.encode(" " + texts[name], add_special_tokens=False)
            spans.append((len(ids), len(ids) + len(piece), "documents"))
            ids += piece
        piece = tok.encode(f" Question: {question}", add_special_tokens=False)
        spans.append((len(ids), len(ids) + len(piece), "user_turn"))
        return ids + piece, spans

    def ask(ids: list[int], spans: list[tuple[int, int, str]], salt: str,
            tokens: int = 8) -> dict[str, Any]:
        params = semantic_params(spans, prompt_token_ids=ids)
        sampling = SamplingParams(max_tokens=tokens, temperature=0,
                                  extra_args={"kv_transfer_params": params})
        out = llm.generate({"prompt_token_ids": ids, "cache_salt": salt}, sampling,
                           use_tqdm=False)[0]
        return {"report": cache_report(out.kv_transfer_params),
                "cached": out.num_cached_tokens, "reply": list(out.outputs[0].token_ids)}

    salt = chunk_salt(TENANT)
    ids1, spans1 = build("ABC", "what is the beta of A?")
    ids2, spans2 = build("CDA", "what is the gamma of C?")
    if scenario == "replica-b":
        result: dict[str, Any] = {"turn2": ask(ids2, spans2, salt)}
        result["projections"] = llm.collective_rpc(_projections_check,
                                                   kwargs={"ids": ids2})[0]
        result.update(full2=ask(ids2, spans2, "fresh"),
                      other_tenant=ask(ids2, spans2, chunk_salt("globex")))
        with open(out_path, "w") as f:
            json.dump(result, f)
        return
    result = {"turn1": ask(ids1, spans1, salt)}
    llm.collective_rpc(lambda worker: __import__(
        "vllm.distributed.kv_transfer", fromlist=["_"]).get_kv_transfer_group().flush())
    if scenario == "replica-a":  # the spans' uploads land behind the finish
        result["spans"] = _wait_spans(shared, 4)
        with open(out_path, "w") as f:
            json.dump(result, f)
        return
    result["turn2"] = ask(ids2, spans2, salt)
    result["full2"] = ask(ids2, spans2, "fresh")
    if scenario == "kv":
        result["check"] = llm.collective_rpc(_worker_check, kwargs={"ids": ids2})[0]
        # the same prompt: opted in again (vLLM's cache serves the moved blocks to the
        # namespace that opted in), then without opting in (nothing approximated)
        result["again_opted_in"] = ask(ids2, spans2, salt)
        result["again_opted_out"] = ask(ids2, spans2, TENANT)
        # another tenant, opted in, with the same documents: none of acme's chunks
        result["other_tenant"] = ask(ids2, spans2, chunk_salt("globex"))
        result["sources"] = llm.collective_rpc(_foreign_sources)[0]
        # documents in a third order: chunks from both earlier turns (D was computed by
        # the connector in turn 2, under a moved key)
        ids3, spans3 = build("BDAC", "what is the delta of B?")
        result["turn3"] = ask(ids3, spans3, salt)
        result["full3"] = ask(ids3, spans3, "fresh3")
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
