"""The driver of ``contextkit bench chunks-vllm`` (run by module name, in .venv-vllm).

``python -m integrations.vllm.bench.chunks_bench --out FILE --configs a,b [--dir DIR]
[--agents N] [--steps N] [--docs K] ...`` serves a RAG workload: agents whose
prompt is a system text, the documents a memory graph retrieves for the turn (their
order and membership change every turn, placed before the conversation), the
conversation so far and the new question. The prompt is sent as token ids with
contextkit's spans (one per document, one per conversation message) through
``/v1/completions``, to one vLLM OpenAI server per configuration, all up at once, each
step sent to each in turn, on one transcript (the full prefill's replies). With
``--ingest``, each tenant's documents are prefilled once before the schedule on every
server but ``full``, as an application does when a document enters its store:

- ``full``: no reuse across turns (a fresh ``cache_salt`` per turn): the quality
  reference, whose replies every configuration's conversation carries;
- ``ceiling``: vLLM's prefix cache with room for every agent: the prefix-only bound;
- ``apc``: vLLM's prefix cache under pressure (about ``--kv-agents`` prompts);
- ``connector``: contextkit's connector, prefix reuse only;
- ``connector_chunks``: the same connector with chunk reuse (requests opt in);
- ``lmcache``: LMCache's connector (prefix chunks), the same DDR budget;
- ``oracle``: chunk reuse's bound: vLLM computing only the tokens no earlier prompt
  of the tenant held (new documents, the last reply, the question), exactly, at the
  prompt's length. Its prompt puts the spans the tenant sent before first, warmed
  untimed into vLLM's prefix cache (rounded up to whole blocks), and the new tokens
  after them: what a cache holding every chunk at every position would leave to
  compute, with no seams and no placement.

Per step it records each configuration's TTFT (a one-token request), prompt, cached
and computed tokens and the connector's cache report; on the turns where
``connector_chunks`` reused chunks it teacher-forces the full prefill's reply through
``full``, ``connector`` and ``connector_chunks`` (top-20 logprobs per position). The
figures are computed by :mod:`contextkit.bench.chunks_vllm`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import sys
import tempfile
import time
import urllib.error
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from integrations.vllm.bench.interleave import check_memory, rotation, settle, start_lanes
from integrations.vllm.bench.oracle import KnownSpans

__all__ = ["CONFIGS", "main"]

BLOCK = 32
SERVED = "contextkit-chunks"
CONFIGS = ("full", "ceiling", "apc", "connector", "connector_chunks", "lmcache", "oracle")
#: Configurations teacher-forced on chunk turns (the first is the reference).
PROBED = ("full", "connector", "connector_chunks")
SYSTEM = ("You are the on-call assistant of a payments platform. Answer the user's "
          "question from the documents retrieved for it and from the conversation; say "
          "which document you used, and say so when none of them answers it.")


@dataclass(frozen=True)
class Setup:
    name: str
    connector: dict[str, Any] | None = None  # ConnectorConfig overrides; None: none
    chunks: bool = False  # the requests opt into chunk reuse
    ceiling: bool = False  # KV room for every agent
    fresh: bool = False  # a new cache_salt every turn: nothing reused across turns
    lmcache: bool = False
    oracle: bool = False  # the tenant's known spans first, the new tokens after


SETUPS = {
    "full": Setup("full", fresh=True, ceiling=True),
    "ceiling": Setup("ceiling", ceiling=True),
    "apc": Setup("apc"),
    "connector": Setup("connector", {"eviction": "semantic"}),
    "connector_chunks": Setup("connector_chunks", {"eviction": "semantic",
                                                   "chunk_reuse": True}, chunks=True),
    "lmcache": Setup("lmcache", lmcache=True),
    "oracle": Setup("oracle", ceiling=True, oracle=True),
}


class WordHashEmbedder:
    """Bag-of-words vectors (hashed words): the workload's retriever, deterministic and
    without a model download (``memory_graph.Embedder``)."""

    dim = 256
    model_id = "bench-word-hash-256"

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for word in re.findall(r"[a-z0-9]+", text.lower()):
                digest = hashlib.sha256(word.encode()).digest()
                out[i, digest[0]] += 1.0 if digest[1] % 2 else -1.0
            out[i, -1] += 1e-3
        return out / np.linalg.norm(out, axis=1, keepdims=True)


# ---------------------------------------------------------------------- the workload
@dataclass
class Agent:
    name: str
    tenant: str
    topics: list[str]
    history: list[tuple[str, str]] = field(default_factory=list)  # (question, reply)


class RagWorkload:
    """The agents, their questions and the documents retrieved for each turn."""

    def __init__(self, args: argparse.Namespace, tokenizer: Any) -> None:
        from contextkit.workloads.replay import AgentReplay
        from contextkit.workloads.replay_content import TOPIC_QUERIES
        from memory_graph import MemoryGraph

        self.tok = tokenizer
        self.replay = AgentReplay(turns=max(2, args.steps), seed=args.seed, tenant="docs")
        self.graph = MemoryGraph(embedder=WordHashEmbedder())
        self.replay.seed_memory(self.graph)
        # a document: consecutive memories of the corpus (one topic's episodes and
        # decisions), retrieved when the graph ranks any of them
        corpus = self.replay.memory_corpus()
        per = args.memories_per_doc
        self.docs = [" ".join(corpus[i:i + per]) for i in range(0, len(corpus), per)]
        self.doc_of = {text: i // per for i, text in enumerate(corpus)}
        self.queries = TOPIC_QUERIES
        topics = sorted(TOPIC_QUERIES)
        rng = random.Random(args.seed)
        self.agents = [Agent(f"agent{a}", f"tenant{a % args.tenants}",
                             rng.sample(topics, len(topics))) for a in range(args.agents)]
        self.k = args.docs
        self.steps = args.steps

    def agent_of(self, step: int) -> Agent:
        return self.agents[step % len(self.agents)]

    def question(self, agent: Agent, turn: int) -> str:
        return self.replay.turn(turn % self.replay.num_turns).user_message

    def documents(self, agent: Agent, turn: int) -> list[str]:
        """The graph's top documents for the turn's topic and question, best first: the
        topic drifts, so membership and order change every turn."""
        topic = agent.topics[(turn // 2) % len(agent.topics)]
        query = f"{self.queries[topic]} {self.question(agent, turn)}"
        hits = self.graph.hybrid_query(query, 4 * self.k, 1, self.replay.tenant)
        score: dict[int, float] = {}
        for hit in hits:
            doc = self.doc_of.get(hit.node.text)
            if doc is not None:
                score[doc] = score.get(doc, 0.0) + max(hit.score, 0.0)
        ranked = sorted(score, key=lambda d: (-score[d], d))[: self.k]
        rng = random.Random(f"{agent.name}:{turn}")
        rng.shuffle(ranked)  # retrieval scores move from turn to turn: so does the order
        return [self.docs[d] for d in ranked]

    def _ids(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def ingest_prompts(self) -> list[tuple[list[int], list[tuple[int, int, str]]]]:
        """One prompt per document, as an application prefills a document when it
        enters the store (CacheBlend's offline step): the system text, the document as
        it sits in a turn's prompt (the same tokens and label), and a closing text long
        enough that the document ends inside full blocks (only full blocks are
        stored)."""
        out = []
        closing = self._ids("\n\n[CONVERSATION]\n" + "(no conversation yet) " * 8)
        for doc in self.docs:
            ids: list[int] = ([self.tok.bos_token_id] if self.tok.bos_token_id is not None
                              else [])
            ids += self._ids(SYSTEM) + self._ids("\n\n[DOCUMENTS]")
            piece = self._ids("\n- " + doc)
            out.append((ids + piece + closing, [(len(ids), len(ids) + len(piece),
                                                 "documents")]))
        return out

    def prompt(self, agent: Agent, turn: int) -> tuple[list[int], list[tuple[int, int, str]]]:
        """Token ids and spans ``(start, end, layer)`` of the agent's prompt this turn."""
        ids: list[int] = [self.tok.bos_token_id] if self.tok.bos_token_id is not None else []
        spans: list[tuple[int, int, str]] = []

        def add(text: str, layer: str | None) -> None:
            piece = self._ids(text)
            if layer is not None:
                spans.append((len(ids), len(ids) + len(piece), layer))
            ids.extend(piece)

        add(SYSTEM, "rules")
        add("\n\n[DOCUMENTS]", None)
        for doc in self.documents(agent, turn):
            add("\n- " + doc, "documents")
        add("\n\n[CONVERSATION]", None)
        for question, reply in agent.history:
            add(f"\nUser: {question}", "user_turn")
            add(f"\nAssistant: {reply}", "user_turn")
        add(f"\nUser: {self.question(agent, turn)}", "user_turn")
        add("\nAssistant:", None)
        return ids, spans


# ---------------------------------------------------------------------- servers
class Lane:
    """One configuration: its server (and LMCache's), its rows."""

    def __init__(self, setup: Setup, args: argparse.Namespace, work: Path,
                 sizes: dict[str, Any]) -> None:
        self.setup, self.args, self.work, self.sizes = setup, args, work, sizes
        self.srv: Any = None
        self.lmcache: Any = None
        self.rows: list[dict[str, Any]] = []
        self.metrics: dict[str, float] = {}

    def start(self) -> Lane:
        from integrations.vllm.bench.agent_bench import server_env
        from integrations.vllm.bench.harness import OpenAIServer, fresh_connector_files
        from integrations.vllm.config import ConnectorConfig
        from integrations.vllm.served_model import LOAD_FORMAT

        setup, sizes = self.setup, self.sizes
        blocks = sizes["kv_blocks_ceiling"] if setup.ceiling else sizes["kv_blocks_pressure"]
        config = ConnectorConfig(block_size=BLOCK)
        if setup.connector is not None:
            overrides = dict(setup.connector)
            if setup.chunks:
                overrides["chunk_repair_first"] = self.args.repair_first
                overrides["chunk_seam_lead"] = self.args.seam_lead
                overrides["chunk_repair_ratio"] = self.args.repair_ratio
            local_store, stats_path = fresh_connector_files(self.work, setup.name)
            config = ConnectorConfig(
                block_size=BLOCK, shadow_url="", local_store=local_store,
                stats_path=stats_path,
                host_blocks=sizes["host_blocks"], **overrides)
        extra = ["--enable-prompt-tokens-details", "--num-gpu-blocks-override", str(blocks),
                 "--max-logprobs", "20"]
        if setup.chunks:
            extra += ["--load-format", LOAD_FORMAT]
        self.srv = OpenAIServer(self.args.model_dir, config,
                                self.work / f"server-{setup.name}.log", served_name=SERVED,
                                block_size=BLOCK, max_model_len=sizes["max_model_len"],
                                extra_args=extra, env=server_env())
        at = self.srv.cmd.index("--kv-transfer-config")
        if setup.lmcache:
            from integrations.vllm.bench.lmcache_server import LMCacheServer

            self.lmcache = LMCacheServer(self.work, chunk_tokens=BLOCK,
                                         budget_bytes=sizes["host_blocks"] * sizes["fp16_block"])
            self.lmcache.start()
            self.srv.cmd[at + 1] = json.dumps(self.lmcache.kv_transfer_config())
            self.srv.env.update(self.lmcache.env())
        elif setup.connector is None:
            del self.srv.cmd[at:at + 2]
        self.srv.start()
        for words in (60, 600):  # the first requests' one-time costs
            self.srv.post("/v1/completions", {"model": SERVED, "max_tokens": 2,
                                              "prompt": "warm up: " + "tick " * words,
                                              "cache_salt": "warmup"})
        return self

    def salt(self, agent: Agent, step: int) -> str:
        from contextkit.pipeline.served.wire import chunk_salt

        if self.setup.fresh:
            return f"full-{step}"
        return chunk_salt(agent.tenant) if self.setup.chunks else agent.tenant

    def body(self, ids: list[int], spans: list[tuple[int, int, str]], salt: str,
             **more: Any) -> dict[str, Any]:
        from integrations.vllm.planning import semantic_params

        body: dict[str, Any] = {"model": SERVED, "prompt": ids, "temperature": 0,
                                "cache_salt": salt, **more}
        if self.setup.connector is not None:
            body["kv_transfer_params"] = semantic_params(spans, prompt_token_ids=ids)
        return body

    def turn(self, step: int, agent: Agent, ids: list[int],
             spans: list[tuple[int, int, str]], warm: list[int] | None = None
             ) -> dict[str, Any]:
        """One timed one-token request; ``warm`` is sent first, untimed."""
        if warm:
            self.srv.post("/v1/completions", self.body(warm, [], self.salt(agent, step),
                                                       max_tokens=1))
        t0 = time.perf_counter()
        reply = self.srv.post("/v1/completions",
                              self.body(ids, spans, self.salt(agent, step), max_tokens=1))
        ttft = 1000 * (time.perf_counter() - t0)
        usage = reply.get("usage") or {}
        cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
        report = ((reply.get("kv_transfer_params") or {}).get("contextkit_cache") or None)
        row = {"step": step, "agent": agent.name, "tenant": agent.tenant,
               "turn": len(agent.history), "ttft_ms": round(ttft, 1),
               "prompt_tokens": int(usage.get("prompt_tokens") or len(ids)),
               "cached_tokens": cached, "report": report}
        self.rows.append(row)
        print(f"{self.setup.name:>17} step {step:>3} {agent.name}: ttft {ttft:>8.1f} ms  "
              f"prompt {row['prompt_tokens']}  cached {cached}  "
              f"{(report or {}).get('reuse', '')} {(report or {}).get('chunk_reused_tokens', '')}",
              file=sys.stderr, flush=True)
        return row

    def generate(self, step: int, agent: Agent, ids: list[int],
                 spans: list[tuple[int, int, str]], tokens: int) -> list[int]:
        reply = self.srv.post("/v1/completions", self.body(
            ids, spans, self.salt(agent, step), max_tokens=tokens,
            return_tokens_as_token_ids=True, logprobs=1))
        return [int(t.split(":", 1)[1]) for t in reply["choices"][0]["logprobs"]["tokens"]]

    def forced(self, step: int, agent: Agent, ids: list[int],
               spans: list[tuple[int, int, str]], forced: list[int]) -> list[dict[str, float]]:
        """Top-20 logprobs at each position of ``forced`` after the prompt (each forced
        token's own logprob too; a logit bias makes greedy sampling pick it and vLLM
        returns the sampled token's raw logprob)."""
        tops = []
        for j, token in enumerate(forced):
            body = self.body(ids + forced[:j], spans, self.salt(agent, step), max_tokens=1,
                             logprobs=20, return_tokens_as_token_ids=True,
                             logit_bias={str(token): 100})
            try:
                reply = self.srv.post("/v1/completions", body)
            except urllib.error.HTTPError as exc:
                raise RuntimeError(exc.read().decode(errors="replace")[:500]) from None
            lp = reply["choices"][0]["logprobs"]
            top = {k.split(":", 1)[1]: float(v) for k, v in lp["top_logprobs"][0].items()}
            top.setdefault(lp["tokens"][0].split(":", 1)[1], float(lp["token_logprobs"][0]))
            tops.append(top)
        return tops

    def stop(self) -> None:
        if self.srv is not None:
            from integrations.vllm.bench.agents_bench import scrape_connector_metrics

            self.metrics = scrape_connector_metrics(self.srv)
            self.srv.stop()
            self.srv = None
        if self.lmcache is not None:
            self.lmcache.stop()
            self.lmcache = None


# ---------------------------------------------------------------------- measure
def plan_sizes(workload: RagWorkload, args: argparse.Namespace) -> dict[str, Any]:
    from integrations.vllm.identity import vllm_cache_identity

    lengths = []
    for step in range(min(args.steps, 2 * len(workload.agents))):
        agent = workload.agent_of(step)
        lengths.append(len(workload.prompt(agent, 0)[0]))
    prompt = sum(lengths) / len(lengths)
    turns = -(-args.steps // len(workload.agents))
    longest = max(lengths) + turns * (args.max_tokens + 80)
    fp16 = vllm_cache_identity(args.model_dir, BLOCK, "fp16").bytes_per_block
    tq4 = vllm_cache_identity(args.model_dir, BLOCK, "tq4").bytes_per_block
    pressure = max(-(-longest // BLOCK) + 2, int(args.kv_agents * longest / BLOCK))
    ceiling = len(workload.agents) * (-(-longest // BLOCK) + 8) + 64
    # the DDR tier holds every block the run saves: chunk reuse, not eviction, decides
    host = int(1.2 * args.steps * (-(-longest // BLOCK)))
    return {"prompt_tokens_first_mean": round(prompt), "longest_prompt_tokens": longest,
            "kv_blocks_pressure": pressure, "kv_blocks_ceiling": ceiling,
            "host_blocks": host, "fp16_block": fp16, "tq4_block": tq4,
            "max_model_len": (pressure - 1) * BLOCK}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    workload = RagWorkload(args, tokenizer)
    sizes = plan_sizes(workload, args)
    names = [n for n in CONFIGS if n in args.configs]
    extra = sum((sizes["kv_blocks_ceiling"] if SETUPS[n].ceiling else sizes["kv_blocks_pressure"])
                * 2 * sizes["fp16_block"] for n in names)
    extra += sum(sizes["host_blocks"] * sizes["fp16_block"]
                 for n in names if SETUPS[n].connector is not None or SETUPS[n].lmcache)
    check_memory(len(names), extra / 2**30)
    work = Path(args.dir or tempfile.mkdtemp(prefix="ck-chunks-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    errors: dict[str, str] = {}
    lanes: dict[str, Lane] = start_lanes(
        names, lambda n: Lane(SETUPS[n], args, work, sizes), errors, required="full")
    probes: list[dict[str, Any]] = []
    known = KnownSpans()
    ingested = 0
    try:
        if args.ingest:  # every tenant's documents prefilled once, not timed
            prompts = workload.ingest_prompts()
            tenants = sorted({a.tenant for a in workload.agents})
            for tenant in tenants:
                for ids, spans in prompts:
                    known.add(tenant, ids, spans)
            for name, lane in lanes.items():
                if SETUPS[name].fresh:
                    continue
                for tenant in tenants:
                    agent = next(a for a in workload.agents if a.tenant == tenant)
                    for ids, spans in prompts:
                        lane.srv.post("/v1/completions", lane.body(
                            ids, spans, lane.salt(agent, -1), max_tokens=1))
                        ingested += 1
        for step in range(args.steps):
            agent = workload.agent_of(step)
            ids, spans = workload.prompt(agent, len(agent.history))
            oracle, warm, _ = known.oracle_prompt(agent.tenant, ids, spans)
            rows = {}
            for name in rotation(list(lanes), step):
                settle()
                if SETUPS[name].oracle:
                    rows[name] = lanes[name].turn(step, agent, oracle, [], warm=warm)
                else:
                    rows[name] = lanes[name].turn(step, agent, ids, spans)
            known.add(agent.tenant, ids, spans)
            reply_ids = lanes["full"].generate(step, agent, ids, spans, args.max_tokens)
            chunk_row = rows.get("connector_chunks")
            if chunk_row and (chunk_row["report"] or {}).get("reuse") == "chunk" \
                    and len(probes) < args.quality_turns:
                forced = reply_ids[:args.quality_tokens]
                probes.append({"step": step, "forced": forced, "tops": {
                    n: lanes[n].forced(step, agent, ids, spans, forced)
                    for n in PROBED if n in lanes}})
            agent.history.append((workload.question(agent, len(agent.history)),
                                  str(tokenizer.decode(reply_ids, skip_special_tokens=True))))
    finally:
        for lane in lanes.values():
            lane.stop()
    return {"configs": {n: {"rows": lane.rows, "metrics": lane.metrics,
                            "setup": {"connector": SETUPS[n].connector,
                                      "chunks": SETUPS[n].chunks,
                                      "ceiling": SETUPS[n].ceiling,
                                      "fresh": SETUPS[n].fresh,
                                      "oracle": SETUPS[n].oracle}}
                        for n, lane in lanes.items()},
            "probes": probes, "errors": errors, "sizes": sizes, "interleaved": True,
            "ingested_prompts": ingested,
            "workload": {"agents": args.agents, "tenants": args.tenants,
                         "steps": args.steps, "docs": args.docs, "seed": args.seed,
                         "documents": len(workload.docs), "ingest": args.ingest,
                         "repair_first": args.repair_first, "seam_lead": args.seam_lead,
                         "repair_ratio": args.repair_ratio,
                         "max_tokens": args.max_tokens},
            "loadavg_1min": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m integrations.vllm.bench.chunks_bench")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--tenants", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--docs", type=int, default=5)
    parser.add_argument("--memories-per-doc", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--kv-agents", type=float, default=1.5)
    parser.add_argument("--quality-turns", type=int, default=8)
    parser.add_argument("--quality-tokens", type=int, default=16)
    parser.add_argument("--configs", required=True)
    parser.add_argument("--ingest", action="store_true",
                        help="prefill each document once before the schedule")
    parser.add_argument("--repair-first", type=int, default=4)
    parser.add_argument("--seam-lead", type=int, default=16)
    parser.add_argument("--repair-ratio", type=float, default=0.0)
    parser.add_argument("--model", default=None)
    args = parser.parse_args(argv)
    args.configs = {c.strip() for c in args.configs.split(",") if c.strip()} | {"full"}
    if args.model is None:
        from integrations.vllm.model import packaged_model_dir

        args.model_dir = str(packaged_model_dir())
    else:
        args.model_dir = args.model
    raw = measure(args)
    Path(args.out).write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
