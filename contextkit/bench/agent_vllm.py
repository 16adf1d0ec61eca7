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
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from contextkit.bench._common import machine_info, positive_float, positive_int, print_table

__all__ = ["CONFIGS", "HELP", "add_arguments", "check_args", "label_coverage", "run",
           "speedups", "token_bounds"]

HELP = ("TTFT per turn of a LangChain agent on vLLM's OpenAI server: no cache, vLLM APC, "
        "contextkit + APC, contextkit + connector (restart halfway)")

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
    parser.add_argument("--out", default=None, help="also write the JSON result here")
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


# ---------------------------------------------------------------------- the agents
def _timer() -> Any:
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


def _plain_prompt(replay: Any, box: dict[str, Any], salt: Any) -> Any:
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
        self.timer = _timer()
        self.agent: Any = None
        self.connect(base_url)

    def connect(self, base_url: str) -> None:
        """(Re)build the agent on the server at ``base_url``; history and pipeline stay."""
        from langchain.agents import create_agent
        from langchain_openai import ChatOpenAI
        from pydantic import SecretStr

        model = ChatOpenAI(model=SERVED, base_url=base_url, api_key=SecretStr("none"),
                           use_responses_api=False, temperature=0, streaming=True,
                           stream_usage=True, max_completion_tokens=self.max_tokens,
                           max_retries=0, timeout=900, extra_body={"ignore_eos": True})
        replay = self.replay
        if self.pipeline is not None:
            from integrations.langchain import ContextKitMiddleware

            middleware: Any = ContextKitMiddleware(
                self.pipeline, lambda request: replay.build_marked(self.box["turn"]))
        elif self.name == "nocache":
            def salt() -> str:  # a new salt per call: no prefix can match
                self.box["calls"] += 1
                return f"nocache-{os.getpid()}-{self.box['calls']}"
            middleware = _plain_prompt(replay, self.box, salt)
        else:
            tenant = self.tenant
            middleware = _plain_prompt(replay, self.box, lambda: tenant)
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
    from integrations.vllm.harness import OpenAIServer

    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4",
           # vLLM drops to one OpenMP thread "for serving" unless told; use the machine
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1)),
           # vLLM's CPU build binds the worker's threads to the cores left after
           # reserving one for its scheduler, and one more when a KV connector is
           # configured; on 2 cores that second reservation fails and the connector's
           # worker gets both cores while the others get one (a 2x difference in
           # prefill that is not the cache's). Reserve none, for every server alike.
           "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")}
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


def _plot(path: Path, ttft: Mapping[str, Sequence[float]], restart: int, title: str) -> None:
    import matplotlib

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
def run(args: argparse.Namespace) -> dict[str, Any]:
    check_args(args)
    try:
        import langchain_openai  # noqa: F401
        import vllm  # noqa: F401
    except ImportError:
        raise SystemExit("contextkit bench agent-vllm runs inside the vLLM virtualenv: "
                         "`make test-vllm` creates .venv-vllm, then "
                         "`.venv-vllm/bin/python -m contextkit.cli bench agent-vllm --json`"
                         ) from None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    from contextkit import AgentReplay, CacheAwareContextPipeline
    from contextkit.remote import ServedModel
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
    restart = restart_turn(args.turns)
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
                row = agent.turn(turn.index, turn.user_message)
                print(f"{agent.name:>21} turn {row['turn']:>2}: ttft {row['ttft_ms']:>8.1f} ms"
                      f"  prompt {row['prompt_tokens']}  cached {row['cached_tokens']}",
                      file=sys.stderr, flush=True)
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
                row = ck.turn(turn.index, turn.user_message)
                print(f"{ck.name:>21} turn {row['turn']:>2}: ttft {row['ttft_ms']:>8.1f} ms"
                      f"  prompt {row['prompt_tokens']}  cached {row['cached_tokens']}",
                      file=sys.stderr, flush=True)
        finally:
            srv.stop()
    seconds["connector_total"] = round(time.perf_counter() - t0, 1)
    loadavg["after_connector_servers"] = round(os.getloadavg()[0], 2)
    assert ck is not None
    manifest = shadow_manifest(config)
    labels = label_coverage(manifest.blocks if manifest else [], "acme",
                            config.default_source_layer)
    agents["contextkit_connector"] = ck

    ttft = {name: [r["ttft_ms"] for r in agents[name].rows] for name in CONFIGS}
    recomputed = {n: [(r["prompt_tokens"] or 0) - (r["cached_tokens"] or 0)
                      for r in agents[n].rows] for n in CONFIGS}
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
        "prompt_tokens_first_turn": {n: agents[n].rows[0]["prompt_tokens"] for n in CONFIGS},
        "prompt_tokens_last_turn": {n: agents[n].rows[-1]["prompt_tokens"] for n in CONFIGS},
        "max_tokens": args.max_tokens,
        "ttft_ms": ttft,
        "prompt_tokens": {n: [r["prompt_tokens"] for r in agents[n].rows] for n in CONFIGS},
        "cached_tokens": {n: [r["cached_tokens"] for r in agents[n].rows] for n in CONFIGS},
        "model_ttft_ms": {n: [r["model_ttft_ms"] for r in agents[n].rows] for n in CONFIGS},
        "client_ms": {n: [r["client_ms"] for r in agents[n].rows] for n in CONFIGS},
        "recomputed_tokens": recomputed,
        "ratio_per_turn": {f"{base}_over_connector": [
            _ratio(x, y) for x, y in zip(ttft[base], ttft["contextkit_connector"], strict=True)]
            for base in ("nocache", "apc", "contextkit_apc")},
        # what the workload allows if TTFT were proportional to the tokens computed
        "token_bounds": token_bounds(recomputed, {n: [r["prompt_tokens"] or 0 for r in
                                                     agents[n].rows] for n in CONFIGS},
                                     restart),
        "apc_recompute_share": _share_changed(replay, served),
        "changed_layers": [list(t.changed_layers) for t in turns],
        "topics": [t.topic for t in turns],
        "recovery": {k: recovery.get(k) for k in ("recovered_blocks", "seconds", "skipped")
                     if k in recovery} or recovery,
        "seconds": {**seconds, "total": round(time.perf_counter() - t_start, 1)},
        "model": "packaged SmolLM2-135M-Instruct (float32)" if not args.model else args.model,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "vllm_cpu_num_of_reserved_cpu": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
        "loadavg_1min": loadavg,
        "machine": machine_info(),
        "method": "client-side TTFT: agent.invoke -> first streamed chunk (ChatOpenAI "
                  "streaming); nocache = a fresh cache_salt per request on the APC server",
    }
    rows: list[tuple[str, Any]] = [(f"ttft p50 {n} (ms)", statistics.median(ttft[n][1:]))
                                   for n in CONFIGS]
    rows += [(k, result[k]) for k in ("speedup_vs_apc_p50", "speedup_vs_nocache_p50",
                                      "restart_turn_speedup", "label_coverage")]
    print_table(f"agent on vLLM ({args.turns} turns, ~{result['prompt_tokens_first_turn']['apc']}"
                f"-token prompt)", rows)
    if args.plot:
        _plot(Path(args.plot), ttft, restart,
              f"LangChain agent on vLLM CPU, {args.turns} turns, "
              f"~{result['prompt_tokens_first_turn']['apc']} prompt tokens")
        result["plot"] = str(args.plot)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return result
