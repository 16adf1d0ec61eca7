"""The driver of ``contextkit bench agents-vllm`` (run by module name, in .venv-vllm).

``python -m integrations.vllm.bench.agents_bench --out FILE [--dir DIR] [--agents N]
[--tenants N] [--steps N] [--seed N] [--scale X] [--max-tokens N] [--configs a,b]``
drives the multi-agent workload of :class:`contextkit.workloads.agents.MultiAgentWorkload`
through LangChain agents (one ``create_agent`` over ``ChatOpenAI`` per agent) against
one vLLM OpenAI server per configuration, all up at once with each step sent to each
in turn (``--sequential``: one after another), and writes the raw rows as JSON: per step
the client's TTFT, prompt and cached tokens and the connector's hit tokens, per
configuration the server's sizes and what the connector stored, and the teacher-forced
logprobs of the quality probe. The figures are computed by
:mod:`contextkit.bench.agents_vllm`, which starts this module so that contextkit
imports nothing from integrations.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from integrations.vllm.bench.agent_bench import (
    SERVED,
    chat_model,
    plain_prompt,
    server_env,
    ttft_timer,
)
from integrations.vllm.bench.harness import params_for, read_stats
from integrations.vllm.bench.interleave import check_memory, rotation, settle, start_lanes
from integrations.vllm.bench.oracle import KnownSpans, oracle_middleware

__all__ = ["CONFIGS", "main", "measure"]

BLOCK = 32
#: Words of the requests each fresh server answers before the schedule (its one-time
#: costs); the connector records them too, ahead of the steps.
WARMUP_WORDS = (60, 1500, 1500)

#: Every configuration, in the order they run (the ceiling first: the quality probe
#: compares the others with its logprobs).
CONFIGS = ("ceiling", "apc", "ordering", "connector", "connector_lru", "connector_fp16",
           "connector_int8", "connector_tq4", "connector_saves_all_cores",
           "connector_store_volatile", "connector_all", "connector_hints", "connector_chunks",
           "lmcache", "lmcache_ordering", "oracle")
#: The body fields of ``connector_hints``' agents: Dynamo's cache_control (a TTL, which
#: Dynamo clamps to at least 300 s) and an SGLang-style priority (higher is kept longer).
HINT_FIELDS: dict[str, Any] = {"nvext": {"cache_control": {"type": "ephemeral",
                                                           "ttl": "5m"}},
                               "priority": 60}
#: ``connector_all``'s DDR budget in B: enough for every block the default schedule
#: saves (the run reports its evictions), so no eviction policy at B can do better.
ALL_BUDGET_FACTOR = 8.0
#: The precision policy of ``connector_fp16``: every block fp16 (no sink, no raised
#: layers, no byte cap) in the tq4 key identity, so the byte budget's unit is the same.
FP16_POLICY = {"default": "fp16", "sink_blocks": 0, "layers": {}, "importance": [],
               "pinned": None, "key_offsets": False, "max_vs_fp16": None}
#: ``connector_int8``: every block int8 (the fp16 sink kept), no byte cap: the precision
#: the default policy gives its late layers, everywhere.
INT8_POLICY: dict[str, Any] = {"default": "int8", "layers": {}, "importance": [], "pinned": None,
               "max_vs_fp16": None}
#: ``connector_tq4``: the default policy before k5v4 (tq4 where it stores k5v4, the late
#: layers int8 within 0.33 of fp16), to measure what k5v4 changed.
TQ4_POLICY: dict[str, Any] = {"default": "tq4", "max_vs_fp16": 0.33}


@dataclass(frozen=True)
class Setup:
    """What one configuration runs: contextkit's order, a connector, the KV size."""

    name: str
    contextkit: bool  # the pipeline's order and labels (ContextKitMiddleware)
    connector: dict[str, Any] | None  # ConnectorConfig overrides; None: no connector
    pin: bool = True  # the middleware asks the connector to pin stable prefixes
    ceiling: bool = False  # a KV space that holds every agent
    lmcache: bool = False
    probe: bool = True  # run the quality probe (configurations with a connector or ceiling)
    budget_factor: float = 1.0  # the connector's DDR budget in B
    hints: bool = False  # agents send their session header and HINT_FIELDS
    chunks: bool = False  # chunk reuse: the pipelines opt in, the server loads the model
    oracle: bool = False  # chunk reuse's bound (integrations.vllm.bench.oracle)


SETUPS = {
    "ceiling": Setup("ceiling", True, None, ceiling=True),
    "apc": Setup("apc", False, None),
    "ordering": Setup("ordering", True, None),
    "connector": Setup("connector", True, {"eviction": "semantic"}),
    "connector_lru": Setup("connector_lru", True, {"eviction": "lru"}, pin=False),
    "connector_fp16": Setup("connector_fp16", True, {"eviction": "semantic",
                                                     "precision": FP16_POLICY}),
    "connector_int8": Setup("connector_int8", True, {"eviction": "semantic",
                                                     "precision": INT8_POLICY}),
    "connector_tq4": Setup("connector_tq4", True, {"eviction": "semantic",
                                                   "precision": TQ4_POLICY}),
    # the save thread's kernels on every core, as before save_threads: what it changed
    "connector_saves_all_cores": Setup("connector_saves_all_cores", True, {
        "eviction": "semantic", "save_threads": os.cpu_count() or 1}),
    # every volatile tail stored, as before store_volatile: what skipping them changed
    "connector_store_volatile": Setup("connector_store_volatile", True, {
        "eviction": "semantic", "store_volatile": "always"}),
    "connector_all": Setup("connector_all", True, {"eviction": "semantic"}, probe=False,
                           budget_factor=ALL_BUDGET_FACTOR),
    # agent hints in the stacks' dialects: the x-session-id header (a learned pause),
    # Dynamo's cache_control TTL and an SGLang priority
    "connector_hints": Setup("connector_hints", True, {"eviction": "semantic"}, hints=True),
    # chunk reuse: sections after a changed one (memories) moved in, seams recomputed
    "connector_chunks": Setup("connector_chunks", True, {"eviction": "semantic",
                                                         "chunk_reuse": True}, chunks=True),
    "lmcache": Setup("lmcache", False, None, lmcache=True),
    "lmcache_ordering": Setup("lmcache_ordering", True, None, lmcache=True),
    # chunk reuse's bound: vLLM computing only the spans the tenant never sent before,
    # after the known ones (held in a KV space with room for every agent)
    "oracle": Setup("oracle", True, None, ceiling=True, probe=False, oracle=True),
}


# ---------------------------------------------------------------------- the agents
class _Marked:
    """The workload's prompt of a step as one plain marked text, in its own order."""

    def __init__(self, workload: Any) -> None:
        self.workload = workload

    def build_marked(self, step: int) -> str:
        from contextkit.prompt.markup import render_marked

        return render_marked(self.workload.system_prompt(step))


class WorkloadAgent:
    """One agent of the workload in one configuration: its LangChain agent and history."""

    def __init__(self, name: str, tenant: str, workload: Any, base_url: str,
                 max_tokens: int, pipeline: Any = None, oracle: Any = None) -> None:
        self.name, self.tenant, self.workload = name, tenant, workload
        self.pipeline, self.max_tokens = pipeline, max_tokens
        self.oracle = oracle  # answers the model calls instead (oracle_middleware)
        self.box: dict[str, Any] = {"turn": 0}
        self.history: list[Any] = []
        self.timer = ttft_timer()
        self.agent: Any = None
        self.user: str | None = None  # OpenAI's user field (a router's affinity key)
        self.extra: dict[str, Any] | None = None  # more body fields (agent hints)
        self.connect(base_url)

    def connect(self, base_url: str) -> None:
        from langchain.agents import create_agent

        model = chat_model(base_url, self.max_tokens, self.user, self.extra)
        if self.pipeline is not None:
            from integrations.langchain import ContextKitMiddleware

            workload, box = self.workload, self.box
            middleware: Any = ContextKitMiddleware(
                self.pipeline, lambda request: workload.system_prompt(box["turn"]))
        else:
            tenant = self.tenant  # vLLM's cache_salt keeps tenants apart
            middleware = plain_prompt(_Marked(self.workload), self.box, lambda: tenant)
        chain = [middleware] if self.oracle is None else [middleware, self.oracle]
        self.agent = create_agent(model, tools=[], context_schema=dict, middleware=chain)

    def turn(self, step: int, message: str, tool_result: bool = False) -> dict[str, Any]:
        """One model call: a user turn (``message`` from the user), or, with
        ``tool_result``, the tool round that resumes the agent's previous turn: its
        reply becomes a tool call and ``message`` the tool's result. A tool round keeps
        the turn's system prompt, so the previous prompt and reply are its prefix."""
        from langchain_core.messages import AIMessage, ToolMessage

        if tool_result and self.history and isinstance(self.history[-1], AIMessage):
            call = {"name": "lookup", "args": {"step": step}, "id": f"call-{step}",
                    "type": "tool_call"}
            said = self.history[-1]
            messages = [*self.history[:-1],
                        AIMessage(content=said.content, tool_calls=[call], id=said.id),
                        ToolMessage(content=message, tool_call_id=call["id"])]
        else:
            tool_result = False
            self.box["turn"] = step
            messages = [*self.history, ("user", message)]
        self.timer.reset()
        t0 = time.perf_counter()
        state = self.agent.invoke({"messages": messages},
                                  config={"callbacks": [self.timer]},
                                  context={"tenant": self.tenant})
        self.history = state["messages"]
        reply = self.history[-1]
        if not isinstance(reply, AIMessage):
            raise RuntimeError(f"{self.name}: step {step} streamed no reply")
        if self.oracle is not None:  # the oracle's own request, its setup left out
            ttft = 1000 * (self.oracle.last.entered - t0) + self.oracle.last.server_ms
        elif self.timer.first_chunk is not None:
            ttft = 1000 * (self.timer.first_chunk - t0)
        else:
            raise RuntimeError(f"{self.name}: step {step} streamed no reply")
        usage: dict[str, Any] = dict(reply.usage_metadata or {})
        return {"step": step, "agent": self.name, "tenant": self.tenant,
                "tool_result": tool_result, "ttft_ms": round(ttft, 1),
                "total_ms": round(1000 * (time.perf_counter() - t0), 1),
                "prompt_tokens": usage.get("input_tokens"),
                "cached_tokens": (usage.get("input_token_details") or {}).get("cache_read")}


# ---------------------------------------------------------------------- sizes
def plan_sizes(workload: Any, served: Any, args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's KV blocks (pressure: about ``--kv-agents`` agents' prompts; ceiling: every
    agent's longest prompt plus room) and the connector's byte budget (``--budget-agents``
    agents' prompts in fp16), from the prompts' token counts."""
    from contextkit.prompt.markup import render_marked
    from integrations.vllm.identity import vllm_cache_identity

    first = {}
    for i, step in enumerate(workload.steps()):
        if step.agent not in first:
            text = render_marked(workload.system_prompt(i))
            first[step.agent] = served.count_tokens(text) + served.count_tokens(
                step.user_message)
    prompt = sum(first.values()) / len(first)
    # an agent's prompt grows by its history: two messages of max_tokens per turn
    turns = max(len(workload.turns_of(a)) for a in first)
    longest = max(first.values()) + turns * (args.max_tokens + 64)
    pressure = math.ceil(args.kv_agents * prompt / BLOCK)
    ceiling = math.ceil(len(first) * longest / BLOCK) + 64
    fp16 = vllm_cache_identity(args.model_dir, BLOCK, "fp16").bytes_per_block
    tq4 = vllm_cache_identity(args.model_dir, BLOCK, "tq4").bytes_per_block
    budget = int(args.budget_agents * math.ceil(prompt / BLOCK) * fp16)
    return {"prompt_tokens_mean": round(prompt), "prompt_tokens_first": first,
            "longest_prompt_tokens": longest, "kv_blocks_pressure": pressure,
            "kv_blocks_ceiling": ceiling, "kv_agents": args.kv_agents,
            "budget_agents": args.budget_agents, "budget_bytes": budget,
            "host_blocks": max(1, budget // tq4), "bytes_per_block_fp16": fp16,
            "bytes_per_block_tq4": tq4,
            "max_model_len": min(args.max_model_len, (pressure - 1) * BLOCK)}


# ---------------------------------------------------------------------- servers
def allocated_bytes(setup: Setup, sizes: dict[str, Any]) -> int:
    """What a configuration's server allocates at start beyond the model: vLLM's KV
    blocks (float32: twice the fp16 bytes) and the connector's DDR tier, whose slots
    are sized for fp16 blocks (LMCache's L1 takes the same budget)."""
    fp16 = sizes["bytes_per_block_fp16"]
    blocks = sizes["kv_blocks_ceiling"] if setup.ceiling else sizes["kv_blocks_pressure"]
    host = 0
    if setup.connector is not None:
        host = max(1, int(sizes["host_blocks"] * setup.budget_factor)) * fp16
    elif setup.lmcache:
        host = sizes["budget_bytes"]
    return blocks * 2 * fp16 + host


def _connector_config(work: Path, name: str, sizes: dict[str, Any], overrides: dict[str, Any],
                      budget_factor: float = 1.0) -> Any:
    from integrations.vllm.bench.harness import fresh_connector_files
    from integrations.vllm.config import ConnectorConfig

    shutil.rmtree(work / f"shadow-{name}", ignore_errors=True)
    local_store, stats_path = fresh_connector_files(work, name)
    return ConnectorConfig(block_size=BLOCK, shadow_url="", local_store=local_store,
                           stats_path=stats_path,
                           host_blocks=max(1, int(sizes["host_blocks"] * budget_factor)),
                           **overrides)


def _server(setup: Setup, work: Path, sizes: dict[str, Any], args: argparse.Namespace,
            lmcache: Any = None) -> tuple[Any, Any]:
    from integrations.vllm.bench.harness import OpenAIServer
    from integrations.vllm.config import ConnectorConfig

    blocks = sizes["kv_blocks_ceiling"] if setup.ceiling else sizes["kv_blocks_pressure"]
    overrides = dict(setup.connector or {})
    if args.device_blocks:  # the connectors' pin space (device tier)
        overrides["device_blocks"] = args.device_blocks
    config = (_connector_config(work, setup.name, sizes, overrides, setup.budget_factor)
              if setup.connector is not None else ConnectorConfig(block_size=BLOCK))
    env = server_env()
    extra = ["--enable-prompt-tokens-details", "--num-gpu-blocks-override", str(blocks),
             "--max-logprobs", "20"]
    if setup.chunks:
        from integrations.vllm.served_model import LOAD_FORMAT

        extra += ["--load-format", LOAD_FORMAT]
    srv = OpenAIServer(args.model_dir, config, work / f"server-{setup.name}.log",
                       served_name=SERVED, block_size=BLOCK, max_model_len=sizes["max_model_len"],
                       extra_args=extra, env=env)
    at = srv.cmd.index("--kv-transfer-config")
    if lmcache is not None:
        srv.cmd[at + 1] = json.dumps(lmcache.kv_transfer_config())
        srv.env.update(lmcache.env())
    elif setup.connector is None:
        del srv.cmd[at:at + 2]
    srv.start()
    for words in WARMUP_WORDS:  # one-time costs of the first requests
        srv.post("/v1/chat/completions", {
            "model": SERVED, "max_tokens": 2, "cache_salt": "warmup",
            "messages": [{"role": "user", "content": "warm up: " + "tick " * words}]})
    return srv, config


# ---------------------------------------------------------------------- quality
def _top(srv: Any, prompt: list[int], salt: str, params: dict[str, Any] | None = None,
         force: int | None = None) -> dict[int, float]:
    """The top-20 next-token logprobs after ``prompt`` (token ids), the connector's
    labels ``params`` (``kv_transfer_params``) refitted to this prompt; with ``force``,
    also that token's own logprob, wherever it ranks: a logit bias makes greedy
    sampling pick it and vLLM v1 returns the sampled token's raw logprob (taken
    before any bias)."""
    body: dict[str, Any] = {
        "model": SERVED, "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "logprobs": 20, "return_tokens_as_token_ids": True, "cache_salt": salt}
    if force is not None:
        body["logit_bias"] = {str(force): 100}
    if params is not None:
        body["kv_transfer_params"] = params_for(params, prompt)
    try:
        reply = srv.post("/v1/completions", body)
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"/v1/completions refused a {len(prompt)}-token probe: "
                           f"{exc.read().decode(errors='replace')[:500]}") from None
    logprobs = reply["choices"][0]["logprobs"]
    top = {int(k.split(":", 1)[1]): float(v) for k, v in logprobs["top_logprobs"][0].items()}
    # the sampled token's own logprob: vLLM leaves it out of top_logprobs below rank 20
    top.setdefault(int(logprobs["tokens"][0].split(":", 1)[1]),
                   float(logprobs["token_logprobs"][0]))
    return top


def quality_probe(srv: Any, prompts: list[Probe], reference: list[list[int]] | None,
                  reply_tokens: int, filler: list[int]) -> dict[str, Any]:
    """Teacher-forced next-token distributions over ``reply_tokens`` positions of each
    prompt, the prompt's KV read back from wherever the server keeps it.

    Each prompt is served once (the connector stores it), then ``filler`` (a prompt of
    vLLM's whole KV size) pushes it out of vLLM's own cache, so the first forced
    position loads it from the connector (or recomputes it without one) and the others
    reuse those pages. ``reference``: the forced tokens (the ceiling's greedy reply);
    ``None`` makes this server's own greedy reply the reference.
    """
    out: dict[str, Any] = {"tops": [], "forced": []}
    for probe in prompts:
        _top(srv, probe.ids, probe.salt, probe.params)
    for i, probe in enumerate(prompts):
        _top(srv, filler, "filler")  # evict the prompts from vLLM's KV
        _top(srv, filler[:BLOCK], "filler")  # one more step: the connector's saves land
        forced = list(reference[i]) if reference is not None else []
        tops = []
        for j in range(reply_tokens):
            top = _top(srv, probe.ids + forced[:j], probe.salt, probe.params,
                       force=forced[j] if reference is not None else None)
            tops.append(top)
            if reference is None:
                forced.append(max(top, key=lambda t: top[t]))
        out["tops"].append([{str(k): v for k, v in t.items()} for t in tops])
        out["forced"].append(forced)
    return out


@dataclass(frozen=True)
class Probe:
    """A prompt of the quality probe, as an agent of the workload sends it."""

    ids: list[int]
    salt: str  # the tenant
    params: dict[str, Any] | None  # the connector's labels (kv_transfer_params)


def _quality_prompts(workload: Any, served: Any, count: int, seed: int) -> list[Probe]:
    """``count`` steps' prompts laid out and labelled by contextkit's pipeline for the
    step's agent and tenant (its first turn: no history), as the server tokenizes them."""
    from contextkit import CacheAwareContextPipeline

    rng = random.Random(seed)
    steps = sorted(rng.sample(range(workload.num_steps), count))
    probes = []
    for i in steps:
        step = workload.step(i)
        pipeline = CacheAwareContextPipeline(served=served, tenant=step.tenant,
                                             agent=step.agent)
        pipeline.build(workload.system_prompt(i))
        messages = pipeline.openai_messages([{"role": "user", "content": step.user_message}])
        fields = pipeline.request_fields(messages)
        probes.append(Probe(list(served.render(messages).token_ids),
                            str(fields.get("cache_salt", step.tenant)),
                            fields.get("kv_transfer_params")))
    return probes


# ---------------------------------------------------------------------- measure
def scrape_connector_metrics(srv: Any) -> dict[str, float]:
    """The connector's counters (``vllm:contextkit_*``) and vLLM's prefix-cache ones."""
    totals: dict[str, float] = {}
    try:
        text = srv.get("/metrics")
    except Exception:
        return totals
    for line in text.splitlines():
        if line.startswith("#") or not (line.startswith("vllm:contextkit_")
                                        or "prefix_cache" in line or "external" in line):
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{", 1)[0]
        try:
            totals[base] = totals.get(base, 0.0) + float(value)
        except ValueError:
            continue
    return totals


class Lane:
    """One configuration for the whole run: its server (and LMCache's), its agents,
    its rows. Started once; each step is one :meth:`turn`; :meth:`finish` probes the
    quality and :meth:`stop` ends the servers and gives the configuration's raw result."""

    def __init__(self, setup: Setup, workload: Any, served: Any, sizes: dict[str, Any],
                 work: Path, args: argparse.Namespace) -> None:
        self.setup, self.workload, self.served = setup, workload, served
        self.sizes, self.work, self.args = sizes, work, args
        self.rows: list[dict[str, Any]] = []
        self.agents: dict[str, WorkloadAgent] = {}
        self.srv: Any = None
        self.config: Any = None
        self.lmcache: Any = None
        self.started_s = 0.0
        self.busy_s = 0.0  # seconds spent in this configuration's own requests
        self.metrics: dict[str, float] = {}
        self.probe: dict[str, Any] | None = None

    def start(self) -> Lane:
        from contextkit import CacheAwareContextPipeline

        setup, t0 = self.setup, time.perf_counter()
        if setup.lmcache:
            from integrations.vllm.bench.lmcache_server import LMCacheServer

            self.lmcache = LMCacheServer(self.work, chunk_tokens=BLOCK,
                                         budget_bytes=self.sizes["budget_bytes"])
            self.lmcache.start()
        self.srv, self.config = _server(setup, self.work, self.sizes, self.args, self.lmcache)
        known = KnownSpans()  # the oracle's: one cache for the server's agents
        for spec in self.workload.agents:
            pipeline = (CacheAwareContextPipeline(served=self.served, tenant=spec.tenant,
                                                  agent=spec.name, pin_stable=setup.pin,
                                                  reuse_chunks=setup.chunks)
                        if setup.contextkit else None)
            oracle = (oracle_middleware(self.served, self.srv, known, SERVED)
                      if setup.oracle else None)
            agent = WorkloadAgent(spec.name, spec.tenant, self.workload,
                                  self.srv.base_url, self.args.max_tokens, pipeline, oracle)
            if setup.hints:
                agent.user, agent.extra = spec.name, dict(HINT_FIELDS)
                agent.connect(self.srv.base_url)
            self.agents[spec.name] = agent
        self.started_s = round(time.perf_counter() - t0, 1)
        return self

    def turn(self, step: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        row = self.agents[step.agent].turn(step.step, step.user_message,
                                           tool_result=is_tool_result(self.args, step))
        self.busy_s += time.perf_counter() - t0
        row["kind"], row["agent_turn"] = step.kind, step.agent_turn
        self.rows.append(row)
        print(f"{self.setup.name:>15} step {step.step:>2} {step.agent:>10}: ttft "
              f"{row['ttft_ms']:>8.1f} ms  prompt {row['prompt_tokens']}  cached "
              f"{row['cached_tokens']}", file=sys.stderr, flush=True)
        return row

    def reply(self, agent: str) -> str:
        return str(self.agents[agent].history[-1].content)

    def adopt(self, agent: str, other: Lane) -> None:
        """``agent``'s history becomes ``other``'s: one transcript, the same prompts."""
        self.agents[agent].history = list(other.agents[agent].history)

    def finish(self, quality: dict[str, Any]) -> None:
        """The connector's counters after the schedule, then the quality probe (the
        ceiling's forced tokens become the reference of the others)."""
        setup, t0 = self.setup, time.perf_counter()
        self.metrics = scrape_connector_metrics(self.srv)
        if setup.probe and (setup.connector is not None or setup.ceiling):
            rng = random.Random(7)
            filler = [rng.randrange(100, 20000) for _ in range(self.sizes["max_model_len"] - 8)]
            self.probe = quality_probe(self.srv, quality["prompts"], quality.get("reference"),
                                       self.args.quality_tokens, filler)
            if setup.ceiling:
                quality["reference"] = self.probe["forced"]
        self.busy_s += time.perf_counter() - t0

    def stop(self) -> None:
        if self.srv is not None:
            self.srv.stop()
            self.srv = None
        if self.lmcache is not None:
            self.lmcache.stop()

    def result(self) -> dict[str, Any]:
        setup = self.setup
        stats = (read_stats(Path(self.config.stats_path))[0]
                 if setup.connector is not None and self.config is not None else [])
        return {"rows": self.rows, "server_start_s": self.started_s,
                "seconds": round(self.started_s + self.busy_s, 1),
                "kv_blocks": self.sizes["kv_blocks_ceiling"] if setup.ceiling
                else self.sizes["kv_blocks_pressure"],
                "connector": dict(setup.connector) if setup.connector is not None else None,
                "pin": setup.pin, "contextkit_order": setup.contextkit,
                "metrics": self.metrics, "connector_stats": stats, "probe": self.probe,
                # the connector records the warm-up requests first: the figures drop them
                "warmup_requests": len(WARMUP_WORDS) if setup.connector is not None else 0,
                "lmcache": self.lmcache.describe() if self.lmcache is not None else None,
                "loadavg_1min": round(os.getloadavg()[0], 2)}


def is_tool_result(args: argparse.Namespace, step: Any) -> bool:
    """With ``--tool-rounds``: an agent's odd turns are the result of the tool its
    previous turn called (a tool round), its even turns new user turns."""
    return bool(args.tool_rounds) and step.agent_turn % 2 == 1


def tool_pause(args: argparse.Namespace, step: Any) -> float:
    """With ``--tool-pauses SCALE``: every turn ends in a tool call, and the agent's
    next turn waits for the tool, a pause drawn from 1-60 s (seeded per agent and
    turn) times SCALE; 0 without. With ``--tool-rounds`` only tool rounds wait (a new
    user turn follows the answer)."""
    scale = args.tool_pauses
    if not scale or step.agent_turn < 1 or (args.tool_rounds
                                            and not is_tool_result(args, step)):
        return 0.0
    rng = random.Random(f"{args.seed}:{step.agent}:{step.agent_turn}")
    return round(rng.uniform(1.0, 60.0) * scale, 3)


def run_config(setup: Setup, workload: Any, served: Any, sizes: dict[str, Any], work: Path,
               args: argparse.Namespace, quality: dict[str, Any]) -> dict[str, Any]:
    """One configuration on a fresh server alone: every step, then the probe."""
    lane = Lane(setup, workload, served, sizes, work, args)
    try:
        lane.start()
        for step in workload.steps():
            lane.turn(step)
        lane.finish(quality)
    finally:
        lane.stop()
    return lane.result()


def run_interleaved(names: list[str], workload: Any, served: Any, sizes: dict[str, Any],
                    work: Path, args: argparse.Namespace, quality: dict[str, Any],
                    errors: dict[str, str]) -> dict[str, Any]:
    """Every configuration's server up at once, each step sent to each in turn (the
    order rotating), after the machine went quiet; one transcript: the ceiling's
    replies become every agent's history, so all send the same prompts, and each row
    says whether its configuration answered the same (``reply_matches_transcript``).
    A configuration that fails is stopped and reported in ``errors``; the ceiling's
    failure ends the run."""
    check_memory(len(names) + sum(SETUPS[n].lmcache for n in names),
                 extra_gib=sum(allocated_bytes(SETUPS[n], sizes) for n in names) / 2**30)
    lanes: dict[str, Lane] = start_lanes(
        names, lambda name: Lane(SETUPS[name], workload, served, sizes, work, args), errors,
        required="ceiling")
    try:
        reference = lanes["ceiling"]
        ended: dict[str, float] = {}  # an agent's previous turn ended (all lanes)
        for i, step in enumerate(workload.steps()):
            pause = tool_pause(args, step)
            if pause and step.agent in ended:  # the tool runs at least this long
                time.sleep(max(0.0, ended[step.agent] + pause - time.monotonic()))
            for name in rotation(list(lanes), i):
                row_settle = settle()
                try:
                    lanes[name].turn(step)["settle_s"] = row_settle
                except Exception as exc:
                    if name == "ceiling":
                        raise
                    errors[name] = f"{type(exc).__name__} at step {i}: {str(exc)[:2000]}"
                    print(f"{name}: stopped: {errors[name]}", file=sys.stderr, flush=True)
                    lanes.pop(name).stop()
            ended[step.agent] = time.monotonic()
            said = reference.reply(step.agent)
            for lane in lanes.values():
                lane.rows[-1]["tool_pause_s"] = pause
                if lane is not reference:
                    if not lane.setup.oracle:  # the oracle answers one token
                        lane.rows[-1]["reply_matches_transcript"] = (lane.reply(step.agent)
                                                                     == said)
                    lane.adopt(step.agent, reference)
        for lane in lanes.values():  # the ceiling first: its replies are the reference
            settle()
            lane.finish(quality)
    finally:
        for lane in lanes.values():
            lane.stop()
    return {name: lane.result() for name, lane in lanes.items()}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    from contextkit.pipeline.served.model import ServedModel
    from contextkit.workloads.agents import MultiAgentWorkload

    if args.model:
        args.model_dir = args.model
        served = ServedModel(args.model, name=SERVED)
    else:
        from integrations.vllm.model import packaged_model_dir

        args.model_dir = str(packaged_model_dir())
        served = ServedModel.packaged(name=SERVED)
    work = Path(args.dir or tempfile.mkdtemp(prefix="ck-bench-agents-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    workload = MultiAgentWorkload(args.agents, num_tenants=args.tenants, steps=args.steps,
                                  seed=args.seed, scale=args.scale)
    sizes = plan_sizes(workload, served, args)
    quality: dict[str, Any] = {"prompts": _quality_prompts(workload, served,
                                                           args.quality_steps, args.seed)}
    configs = [c for c in args.configs if c != "ceiling"]
    configs.insert(0, "ceiling")  # the reference of the quality probe and the ratio
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    if not args.sequential:
        results = run_interleaved(configs, workload, served, sizes, work, args, quality,
                                  errors)
    else:
        for name in configs:
            try:
                results[name] = run_config(SETUPS[name], workload, served, sizes, work, args,
                                           quality)
            except (Exception, SystemExit) as exc:
                if name == "ceiling":
                    raise
                errors[name] = f"{type(exc).__name__}: {str(exc)[:2000]}"
                print(f"{name}: did not run: {errors[name]}", file=sys.stderr, flush=True)
        if args.ceiling_last:  # the ceiling's timing again, after the others (drift check)
            again = dataclasses.replace(SETUPS["ceiling"], name="ceiling_last", probe=False)
            results["ceiling_last"] = run_config(again, workload, served, sizes, work, args,
                                                 quality)
    return {"configs": results, "errors": errors, "sizes": sizes, "order": configs,
            "interleaved": not args.sequential, "tool_pauses_scale": args.tool_pauses,
            "tool_rounds": args.tool_rounds, "device_blocks": args.device_blocks or None,
            "workload": workload.describe(), "quality_prompt_tokens":
            [len(p.ids) for p in quality["prompts"]],
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "vllm_cpu_num_of_reserved_cpu": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m integrations.vllm.bench.agents_bench")
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--agents", type=int, default=6)
    parser.add_argument("--tenants", type=int, default=3)
    parser.add_argument("--steps", type=int, default=36)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--kv-agents", type=float, default=2.0)
    parser.add_argument("--budget-agents", type=float, default=3.0)
    parser.add_argument("--quality-steps", type=int, default=3)
    parser.add_argument("--quality-tokens", type=int, default=16)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--ceiling-last", action="store_true")
    parser.add_argument("--sequential", action="store_true")
    parser.add_argument("--tool-pauses", type=float, default=0.0)
    parser.add_argument("--tool-rounds", action="store_true")
    parser.add_argument("--device-blocks", type=int, default=0)
    args = parser.parse_args(argv)
    if args.ceiling_last and not args.sequential:
        parser.error("--ceiling-last measures drift between back-to-back runs: add "
                     "--sequential (interleaved runs need no drift check)")
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(args.configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configurations {unknown}; pick from {', '.join(CONFIGS)}")
    Path(args.out).write_text(json.dumps(measure(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
