"""The driver of ``contextkit bench agent-vllm`` (run by module name, in .venv-vllm).

``python -m integrations.vllm.bench.agent_bench --out FILE [--model DIR] [--dir DIR] [--turns N]
[--scale X] [--max-tokens N] [--max-model-len N]`` runs the replay agent through
LangChain on vLLM's OpenAI server in the bench's four configurations and writes the raw
per-turn rows, the connector's stored blocks and timings as JSON. The figures
(speedups, label coverage, plot) are computed by :mod:`contextkit.bench.agent_vllm`,
which starts this module so that contextkit imports nothing from integrations.
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

__all__ = ["chat_model", "main", "measure", "server_env"]

SERVED = "contextkit-bench"
BLOCK = 32


# ---------------------------------------------------------------------- the agents
def ttft_timer() -> Any:
    """A LangChain callback that stamps the model call's start and first streamed chunk."""
    from langchain_core.callbacks import BaseCallbackHandler

    class Timer(BaseCallbackHandler):
        def __init__(self) -> None:
            self.model_start: float | None = None
            self.first_chunk: float | None = None

        def reset(self) -> None:
            self.model_start = self.first_chunk = None

        def on_chat_model_start(self, *args: Any, **kwargs: Any) -> None:
            self.model_start = time.perf_counter()

        def on_llm_new_token(self, *args: Any, **kwargs: Any) -> None:
            if self.first_chunk is None:
                self.first_chunk = time.perf_counter()

    return Timer()


def chat_model(base_url: str, max_tokens: int, user: str | None = None,
               extra: dict[str, Any] | None = None) -> Any:
    """The agents' ``ChatOpenAI``: greedy, streamed with usage, ``max_tokens`` long
    replies (``ignore_eos``, so every configuration's history grows alike); ``user``:
    OpenAI's ``user`` field and the ``x-session-id`` header (a router's session key:
    vllm-router 0.1.17's ``consistent_hash`` reads the header on chat requests, and
    contextkit's connector names the agent's session with it); ``extra``: more body
    fields (agent hints in a serving stack's dialect)."""
    from langchain_openai import ChatOpenAI
    from pydantic import SecretStr

    return ChatOpenAI(model=SERVED, base_url=base_url, api_key=SecretStr("none"),
                      use_responses_api=False, temperature=0, streaming=True,
                      stream_usage=True, max_completion_tokens=max_tokens, max_retries=0,
                      timeout=900,
                      extra_body={"ignore_eos": True, **({"user": user} if user else {}),
                                  **(extra or {})},
                      default_headers={"x-session-id": user} if user else None)


def server_env() -> dict[str, str]:
    """The environment of every bench server: offline, the machine's cores for vLLM's
    OpenMP threads, none reserved (see below)."""
    return {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4",
            # vLLM drops to one OpenMP thread "for serving" unless told; use the machine
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1)),
            # vLLM's CPU build binds the worker's threads to the cores left after
            # reserving one for its scheduler, and one more when a KV connector is
            # configured; on 2 cores that second reservation fails and the connector's
            # worker gets both cores while the others get one (a difference in prefill
            # that is not the cache's). Reserve none, for every server alike.
            "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")}


def plain_prompt(replay: Any, box: dict[str, Any], salt: Any) -> Any:
    """Middleware for the configurations without contextkit: the replay's layered
    prompt as one plain system message, in the user's own order, and a cache salt."""
    from langchain.agents.middleware import AgentMiddleware
    from langchain_core.messages import SystemMessage

    class PlainPrompt(AgentMiddleware):
        def wrap_model_call(self, request: Any, handler: Any) -> Any:
            extra = {**(request.model_settings.get("extra_body") or {}),
                     "cache_salt": salt()}
            return handler(request.override(
                system_message=SystemMessage(replay.build_marked(box["turn"])),
                model_settings={**request.model_settings, "extra_body": extra}))

    return PlainPrompt()


class _Agent:
    """One configuration's agent: its history, timer and per-turn rows."""

    def __init__(self, name: str, base_url: str, replay: Any, max_tokens: int,
                 pipeline: Any = None, tenant: str = "default") -> None:
        self.name, self.replay, self.pipeline, self.tenant = name, replay, pipeline, tenant
        self.max_tokens = max_tokens
        self.box: dict[str, Any] = {"turn": 0, "calls": 0}
        self.history: list[Any] = []
        self.rows: list[dict[str, Any]] = []
        self.timer = ttft_timer()
        self.agent: Any = None
        self.connect(base_url)

    def connect(self, base_url: str) -> None:
        """(Re)build the agent on the server at ``base_url``; history and pipeline stay."""
        from langchain.agents import create_agent

        model = chat_model(base_url, self.max_tokens)
        replay = self.replay
        if self.pipeline is not None:
            from integrations.langchain import ContextKitMiddleware

            middleware: Any = ContextKitMiddleware(
                self.pipeline, lambda request: replay.build_marked(self.box["turn"]))
        elif self.name == "nocache":
            def salt() -> str:  # a new salt per call: no prefix can match
                self.box["calls"] += 1
                return f"nocache-{os.getpid()}-{self.box['calls']}"
            middleware = plain_prompt(replay, self.box, salt)
        else:
            tenant = self.tenant
            middleware = plain_prompt(replay, self.box, lambda: tenant)
        self.agent = create_agent(model, tools=[], context_schema=dict, middleware=[middleware])

    def turn(self, index: int, message: str) -> dict[str, Any]:
        from langchain_core.messages import AIMessage

        self.box["turn"] = index
        self.timer.reset()
        t0 = time.perf_counter()
        state = self.agent.invoke({"messages": [*self.history, ("user", message)]},
                                  config={"callbacks": [self.timer]},
                                  context={"tenant": self.tenant})
        total = time.perf_counter() - t0
        self.history = state["messages"]
        reply = self.history[-1]
        if not isinstance(reply, AIMessage) or self.timer.first_chunk is None:
            raise RuntimeError(f"{self.name}: turn {index + 1} streamed no reply")
        usage: dict[str, Any] = dict(reply.usage_metadata or {})
        first = self.timer.first_chunk
        start = self.timer.model_start or t0
        row = {"turn": index + 1,
               "ttft_ms": round(1000 * (first - t0), 1),
               "model_ttft_ms": round(1000 * (first - start), 1),
               "client_ms": round(1000 * (start - t0), 1),
               "total_ms": round(1000 * total, 1),
               "prompt_tokens": usage.get("input_tokens"),
               "cached_tokens": (usage.get("input_token_details") or {}).get("cache_read")}
        self.rows.append(row)
        return row


# ---------------------------------------------------------------------- servers
def _server(model_dir: str, work: Path, name: str, config: Any, args: argparse.Namespace,
            *, connector: bool) -> Any:
    from integrations.vllm.bench.harness import OpenAIServer

    env = server_env()
    srv = OpenAIServer(model_dir, config, work / f"server-{name}.log", served_name=SERVED,
                       block_size=BLOCK, max_model_len=args.max_model_len,
                       extra_args=["--enable-prompt-tokens-details"], env=env)
    if not connector:  # the same server, without --kv-transfer-config
        at = srv.cmd.index("--kv-transfer-config")
        del srv.cmd[at:at + 2]
    srv.start()
    # one-time costs of the first requests (a short and a long prefill, then the
    # prefix-cached path), on unrelated prompts with their own cache salt
    for words in (60, 1500, 1500):
        srv.post("/v1/chat/completions", {
            "model": SERVED, "max_tokens": 2, "cache_salt": "warmup",
            "messages": [{"role": "user", "content": "warm up: " + "tick " * words}]})
    return srv


def _recover(model_dir: str, config: Any, log: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "contextkit.cli", "recover", "--for-vllm", "--model",
           model_dir, "--connector-config", json.dumps(config.to_extra_config()), "--json",
           "--no-progress"]
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False)
    text = log.read_text()
    if proc.returncode:
        raise RuntimeError(f"contextkit recover --for-vllm failed ({proc.returncode}); "
                           f"log {log}:\n{text[-3000:]}")
    result: dict[str, Any] = json.loads(text.strip().splitlines()[-1])
    return result


def _share_changed(replay: Any, served: Any) -> list[float]:
    """Per turn: the share of the plain prompt's tokens from the first layer that
    changed since the previous turn to the end of the system prompt (what ``apc``
    recomputes at least, before the conversation)."""
    out = []
    for turn in replay.turns():
        text = replay.build_marked(turn.index)
        total = served.count_tokens(text)
        changed = [layer for layer in turn.changed_layers]
        starts = [text.find(f"[{layer.upper()}]") for layer in changed]
        starts = [s for s in starts if s >= 0]
        first = min(starts) if starts else len(text)
        out.append(round(served.count_tokens(text[first:]) / total, 3) if total else 0.0)
    return out


# ---------------------------------------------------------------------- measure
def _say_turn(name: str, row: dict[str, Any]) -> None:
    """One progress line per served turn (stderr; stdout carries the JSON)."""
    print(f"{name:>21} turn {row['turn']:>2}: ttft {row['ttft_ms']:>8.1f} ms"
          f"  prompt {row['prompt_tokens']}  cached {row['cached_tokens']}",
          file=sys.stderr, flush=True)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the four configurations; the raw rows, stored blocks and timings."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    from contextkit import AgentReplay, CacheAwareContextPipeline
    from contextkit.pipeline.served.model import ServedModel
    from integrations.vllm.config import ConnectorConfig
    from integrations.vllm.store import shadow_manifest

    if args.model:
        model_dir = args.model
        served = ServedModel(model_dir, name=SERVED)
    else:
        from integrations.vllm.model import packaged_model_dir

        model_dir = str(packaged_model_dir())
        served = ServedModel.packaged(name=SERVED)
    work = Path(args.dir or tempfile.mkdtemp(prefix="ck-bench-agent-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    for sub in ("shadow", "local"):
        shutil.rmtree(work / sub, ignore_errors=True)
    (work / "stats.jsonl").unlink(missing_ok=True)
    config = ConnectorConfig(block_size=BLOCK, shadow_url=f"file://{work / 'shadow'}",
                             local_store=f"file://{work / 'local'}",
                             stats_path=str(work / "stats.jsonl"))
    replay = AgentReplay(turns=args.turns, scale=args.scale)
    turns = replay.turns()
    restart = args.turns // 2  # contextkit.bench.agent_vllm.restart_turn
    seconds: dict[str, float] = {}
    # the 1-minute load average as each phase starts and ends: other work on the
    # machine slows the phase it overlaps (2 cores; vLLM runs 2 OpenMP threads)
    loadavg: dict[str, float] = {"start": round(os.getloadavg()[0], 2)}
    t_start = time.perf_counter()

    # 1. one server, no connector: nocache, apc, contextkit_apc interleaved per turn
    t0 = time.perf_counter()
    srv = _server(model_dir, work, "apc", config, args, connector=False)
    seconds["apc_server_start"] = round(srv.startup_s or 0.0, 1)
    try:
        agents = {
            "nocache": _Agent("nocache", srv.base_url, replay, args.max_tokens),
            "apc": _Agent("apc", srv.base_url, replay, args.max_tokens, tenant="plain"),
            "contextkit_apc": _Agent("contextkit_apc", srv.base_url, replay, args.max_tokens,
                                     CacheAwareContextPipeline(served=served),
                                     tenant="ck-apc")}
        for turn in turns:
            for agent in agents.values():
                _say_turn(agent.name, agent.turn(turn.index, turn.user_message))
    finally:
        srv.stop()
    seconds["apc_server_total"] = round(time.perf_counter() - t0, 1)
    loadavg["after_apc_server"] = round(os.getloadavg()[0], 2)

    # 2. the connector: a server for the first half, recovery, a new one for the rest
    t0 = time.perf_counter()
    ck: _Agent | None = None
    recovery: dict[str, Any] = {}
    for part, span in (("first", turns[:restart]), ("second", turns[restart:])):
        if part == "second":
            t1 = time.perf_counter()
            recovery = _recover(model_dir, config, work / "recover.log")
            seconds["recover"] = round(time.perf_counter() - t1, 1)
        srv = _server(model_dir, work, f"connector-{part}", config, args, connector=True)
        seconds[f"connector_server_start_{part}"] = round(srv.startup_s or 0.0, 1)
        try:
            if ck is None:
                ck = _Agent("contextkit_connector", srv.base_url, replay, args.max_tokens,
                            CacheAwareContextPipeline(served=served), tenant="acme")
            else:
                ck.connect(srv.base_url)  # same agent, history and pipeline; new server
            for turn in span:
                _say_turn(ck.name, ck.turn(turn.index, turn.user_message))
        finally:
            srv.stop()
    seconds["connector_total"] = round(time.perf_counter() - t0, 1)
    loadavg["after_connector_servers"] = round(os.getloadavg()[0], 2)
    assert ck is not None
    manifest = shadow_manifest(config)
    agents["contextkit_connector"] = ck
    return {
        "rows": {name: agent.rows for name, agent in agents.items()},
        "restart": restart,
        "seconds": {**seconds, "total": round(time.perf_counter() - t_start, 1)},
        "loadavg_1min": loadavg, "recovery": recovery,
        "default_layer": config.default_source_layer,
        "blocks": [{"source_layer": r.source_layer, "importance": r.importance,
                    "tenant": r.tenant, "pinned": r.pinned}
                   for r in (manifest.blocks if manifest else [])],
        "changed_layers": [list(t.changed_layers) for t in turns],
        "topics": [t.topic for t in turns],
        "apc_recompute_share": _share_changed(replay, served),
        "vllm_cpu_num_of_reserved_cpu": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m integrations.vllm.bench.agent_bench")
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=8192)
    args = parser.parse_args(argv)
    Path(args.out).write_text(json.dumps(measure(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
