"""The driver of ``contextkit bench replicas`` (run by module name, in .venv-vllm).

``python -m integrations.vllm.bench.replicas_bench --out FILE [--dir DIR] [--agents N]
[--tenants N] [--steps N] [--configs a,b] [--router PATH]`` drives the multi-agent
workload (:class:`contextkit.workloads.agents.MultiAgentWorkload`, LangChain agents
with contextkit's middleware) against vLLM OpenAI servers, each configuration on its
own fresh servers with the same schedule, all up at once with each step sent to each
configuration in turn (``--sequential``: one after another), and writes the raw rows
as JSON. Every agent's turns
alternate between the two replicas (turn ``k`` of agent ``i`` goes to replica
``(i + k) % 2``), so every turn after an agent's first lands on the other replica
than its previous one. The figures are computed by :mod:`contextkit.bench.replicas`.

Configurations: ``single`` (one replica serves every turn: what a single replica
reuses, the ceiling of the shared tier), ``apc`` (two replicas, vLLM's prefix cache
alone), ``local`` (+ the connector, each replica its own DDR tier), ``shared`` (+ the
live shared tier on moto's S3 server over HTTP), ``routed`` (``shared`` behind
vllm-router, by default its ``consistent_hash`` policy on the agent's session: OpenAI's
``user`` field; ``--router-policy kv_aware`` feeds it the replicas' KV events, but
vllm-router 0.1.17 gives no cache credit to requests with a ``cache_salt``, which every
tenant's request has) and ``failover``
(``shared``, replica 1 stopped halfway: its agents go on on replica 0);
``single_chunks`` and ``shared_chunks``: ``single`` and ``shared`` with chunk reuse
(the agents' requests opt in; a layer that changed mid-prompt no longer costs what
follows it; ``shared_chunks``' replicas find each other's spans in the shared tier);
``oracle``: chunk reuse's bound, one replica with room for every agent computing only
what the tenant never sent (:mod:`integrations.vllm.bench.oracle`).
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
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from integrations.vllm.bench.agent_bench import SERVED, server_env
from integrations.vllm.bench.agents_bench import (
    BLOCK,
    WorkloadAgent,
    plan_sizes,
    scrape_connector_metrics,
)
from integrations.vllm.bench.harness import (
    free_port,
    fresh_connector_files,
    read_events,
    read_stats,
)
from integrations.vllm.bench.interleave import check_memory, rotation, settle, start_lanes
from integrations.vllm.bench.oracle import KnownSpans, oracle_middleware

__all__ = ["CONFIGS", "main", "measure"]

CONFIGS = ("single", "apc", "local", "shared", "routed", "failover", "single_chunks",
           "shared_chunks", "oracle")
#: The MAC key every replica of the bench shares (a deployment sets its own).
BENCH_KEY = "contextkit-bench-replicas"
BUCKET = "ck-replicas"


@dataclass(frozen=True)
class Setup:
    name: str
    replicas: int = 2
    connector: bool = True
    shared: bool = False
    router: bool = False
    stop_at: float | None = None  # stop replica 1 after this share of the steps
    chunks: bool = False  # chunk reuse on; the agents' requests opt in
    oracle: bool = False  # chunk reuse's bound: KV room for every agent, the oracle answers


SETUPS = {
    "single": Setup("single", replicas=1),
    "apc": Setup("apc", connector=False),
    "local": Setup("local"),
    "shared": Setup("shared", shared=True),
    "routed": Setup("routed", shared=True, router=True),
    "failover": Setup("failover", shared=True, stop_at=0.5),
    "single_chunks": Setup("single_chunks", replicas=1, chunks=True),
    "shared_chunks": Setup("shared_chunks", shared=True, chunks=True),
    "oracle": Setup("oracle", replicas=1, connector=False, oracle=True),
}


class MotoS3:
    """moto's S3 server over HTTP in a child process (a real endpoint: boto3 talks to
    it as to AWS)."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> MotoS3:
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT)
        for _ in range(200):
            try:
                urllib.request.urlopen(self.url, timeout=1)
                break
            except Exception:
                time.sleep(0.1)
        self.client().create_bucket(Bucket=BUCKET)
        return self

    def client(self) -> Any:
        """A boto3 S3 client of this server."""
        import boto3

        return boto3.client("s3", endpoint_url=self.url,
                            aws_access_key_id=AWS_ENV["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=AWS_ENV["AWS_SECRET_ACCESS_KEY"],
                            region_name=AWS_ENV["AWS_DEFAULT_REGION"])

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(30)


#: moto's credentials and region, as the replicas' environment gives them to boto3.
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}


def _start_replica(setup: Setup, idx: int, work: Path, sizes: dict[str, Any],
                   args: argparse.Namespace, s3: MotoS3 | None) -> tuple[Any, Any, int | None]:
    from integrations.vllm.bench.harness import OpenAIServer
    from integrations.vllm.config import ConnectorConfig

    name = f"{setup.name}-{idx}"
    local_store, stats_path = fresh_connector_files(work, name)
    overrides: dict[str, Any] = {}
    if setup.shared and s3 is not None:
        overrides = {"shared_url": f"s3://{BUCKET}/{setup.name}", "shared_endpoint_url": s3.url,
                     "shared_chunk_blocks": args.chunk_blocks,
                     "shared_deadline_s": args.deadline_s}
    if setup.chunks:
        overrides["chunk_reuse"] = True
    config = (ConnectorConfig(block_size=BLOCK, shadow_url="",
                              local_store=local_store,
                              stats_path=stats_path, host_blocks=sizes["host_blocks"],
                              session_id=name, **overrides)
              if setup.connector else ConnectorConfig(block_size=BLOCK))
    env = {**server_env(), **AWS_ENV, "CONTEXTKIT_SHADOW_KEY": BENCH_KEY}
    extra = ["--enable-prompt-tokens-details", "--num-gpu-blocks-override",
             str(sizes["kv_blocks_ceiling" if setup.oracle else "kv_blocks_pressure"])]
    if setup.chunks:  # the connector repairs seams with the served model's weights
        from integrations.vllm.served_model import LOAD_FORMAT

        extra += ["--load-format", LOAD_FORMAT]
    events_port = None
    if setup.router:
        events_port = free_port()
        extra += ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://*:{events_port}", "topic": "kv-events"})]
    srv = OpenAIServer(args.model_dir, config, work / f"server-{name}.log", served_name=SERVED,
                       block_size=BLOCK, max_model_len=sizes["max_model_len"],
                       extra_args=extra, env=env)
    if not setup.connector:
        at = srv.cmd.index("--kv-transfer-config")
        del srv.cmd[at:at + 2]
    srv.start()
    for words in (60, 1500):  # one-time costs of the first requests
        srv.post("/v1/chat/completions", {
            "model": SERVED, "max_tokens": 2, "cache_salt": "warmup",
            "messages": [{"role": "user", "content": "warm up: " + "tick " * words}]})
    return srv, config, events_port


def default_router() -> str:
    """vllm-router on PATH, else beside this Python (a virtualenv run without activating)."""
    beside = Path(sys.executable).parent / "vllm-router"
    return shutil.which("vllm-router") or (str(beside) if beside.exists() else "vllm-router")


class Router:
    """vllm-router (the PyPI wheel's Rust binary) in front of the replicas."""

    def __init__(self, binary: str, workers: list[str], events: list[int | None],
                 log: Path, policy: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [binary, "--host", "127.0.0.1", "--port", str(self.port),
                    "--prometheus-port", str(free_port()), "--worker-urls", *workers,
                    "--policy", policy]
        if policy == "kv_aware":
            for url, port in zip(workers, events, strict=True):
                if port is not None:
                    self.cmd += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{port}"]
            self.cmd += ["--kv-event-block-size", str(BLOCK)]
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Router:
        if not Path(self.cmd[0]).exists() and shutil.which(self.cmd[0]) is None:
            raise SystemExit(f"no vllm-router at {self.cmd[0]}: pip install vllm-router "
                             "(scripts/vllm_venv.sh installs it in .venv-vllm)")
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT)
        for _ in range(300):
            if self.proc.poll() is not None:
                raise SystemExit(f"vllm-router exited: see {self.log}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1)
                return self
            except Exception:
                time.sleep(0.1)
        raise SystemExit(f"vllm-router did not answer: see {self.log}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(30)


def _served_requests(srv: Any) -> float:
    """Requests a replica has finished (its /metrics), to tell where a routed step went."""
    totals = 0.0
    try:
        text = srv.get("/metrics")
    except Exception:
        return -1.0
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total"):
            totals += float(line.rpartition(" ")[2])
    return totals


def tenant_probe(servers: list[Any], configs: list[Any], workload: Any) -> dict[str, int]:
    """One prompt sent by tenant ``probe-a`` to replica 0, then the identical prompt by
    ``probe-b`` and by ``probe-a`` to replica 1: the shared tokens each got there (the
    other tenant's must be 0; the same tenant's shows the tier works)."""
    from contextkit.prompt.markup import render_marked

    text = render_marked(workload.system_prompt(0))
    out: dict[str, int] = {}
    for tenant, idx in (("probe-a", 0), ("probe-b", 1), ("probe-a", 1)):
        start = Path(configs[idx].stats_path).stat().st_size
        servers[idx].post("/v1/chat/completions", {
            "model": SERVED, "max_tokens": 1, "temperature": 0, "cache_salt": tenant,
            "messages": [{"role": "system", "content": text},
                         {"role": "user", "content": "probe"}]})
        records: list[dict[str, Any]] = []
        for _ in range(100):
            records = read_stats(Path(configs[idx].stats_path), start)[0]
            if records:
                break
            time.sleep(0.1)
        key = f"{tenant}_on_{idx}_shared_tokens"
        out[key] = int(records[-1].get("shared_hit_tokens") or 0) if records else -1
        if idx == 0:
            time.sleep(3.0)  # its chunks' uploads (the lag is well under this)
    return out


class Lane:
    """One configuration for the whole run: its replicas (and moto, and the router),
    its agents, its rows. Each step is one :meth:`turn`, sent to the replica the
    schedule (or the router) picks."""

    def __init__(self, setup: Setup, workload: Any, served: Any, sizes: dict[str, Any],
                 work: Path, args: argparse.Namespace) -> None:
        self.setup, self.workload, self.served = setup, workload, served
        self.sizes, self.work, self.args = sizes, work, args
        self.s3: MotoS3 | None = None
        self.servers: list[Any] = []
        self.configs: list[Any] = []
        self.router: Router | None = None
        self.rows: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.agents: dict[str, WorkloadAgent] = {}
        self.turns: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.order = {spec.name: i for i, spec in enumerate(workload.agents)}
        self.steps = len(list(workload.steps()))
        self.stop_step = (int(self.steps * setup.stop_at) if setup.stop_at is not None
                          else self.steps + 1)
        self.alive: list[int] = []
        self.started_s = 0.0
        self.busy_s = 0.0
        self.metrics: list[dict[str, float]] = []
        self.probe: dict[str, int] | None = None

    def start(self) -> Lane:
        from contextkit import CacheAwareContextPipeline

        setup, t0 = self.setup, time.perf_counter()
        self.s3 = MotoS3(self.work / f"moto-{setup.name}.log").start() if setup.shared else None
        events: list[int | None] = []
        for idx in range(setup.replicas):
            srv, config, port = _start_replica(setup, idx, self.work, self.sizes, self.args,
                                               self.s3)
            self.servers.append(srv)
            self.configs.append(config)
            events.append(port)
        if setup.router:
            self.router = Router(self.args.router, [s.url for s in self.servers], events,
                                 self.work / f"router-{setup.name}.log",
                                 self.args.router_policy).start()
        self.alive = list(range(setup.replicas))
        known = KnownSpans()  # the oracle's: one cache for every agent
        for spec in self.workload.agents:
            pipeline = CacheAwareContextPipeline(served=self.served, tenant=spec.tenant,
                                                 agent=spec.name, pin_stable=True,
                                                 reuse_chunks=setup.chunks)
            oracle = (oracle_middleware(self.served, self.servers[0], known, SERVED)
                      if setup.oracle else None)
            agent = WorkloadAgent(spec.name, spec.tenant, self.workload,
                                  self.servers[0].base_url, self.args.max_tokens, pipeline,
                                  oracle)
            agent.user = spec.name  # the router's session key
            self.agents[spec.name] = agent
        self.started_s = round(time.perf_counter() - t0, 1)
        return self

    def turn(self, i: int, step: Any) -> dict[str, Any]:
        """Step ``i``; a lost turn is recorded (``error``) and the run goes on."""
        setup, servers = self.setup, self.servers
        if i == self.stop_step and len(self.alive) > 1:
            servers[1].stop()  # replica 1 goes away; its agents go on on replica 0
            self.alive = [0]
        k = self.turns.get(step.agent, 0)
        self.turns[step.agent] = k + 1
        agent = self.agents[step.agent]
        before = None
        if self.router is not None:
            target = -1
            agent.connect(self.router.url + "/v1")
            before = [_served_requests(s) for s in servers]
        else:
            target = self.alive[(self.order[step.agent] + k) % len(self.alive)]
            agent.connect(servers[target].base_url)
        t0 = time.perf_counter()
        try:
            row = agent.turn(step.step, step.user_message)
        except Exception as exc:
            self.errors.append(f"step {step.step} {step.agent}: {type(exc).__name__}: {exc}")
            row = {"step": step.step, "agent": step.agent, "error": str(exc)[:300]}
            self.rows.append(row)
            return row
        finally:
            self.busy_s += time.perf_counter() - t0
        if before is not None:
            after = [_served_requests(s) for s in servers]
            moved = [j for j, (b, a) in enumerate(zip(before, after, strict=True)) if a > b]
            target = moved[0] if len(moved) == 1 else -1
        row.update({"kind": step.kind, "agent_turn": step.agent_turn, "replica": target,
                    "previous_replica": self.last.get(step.agent),
                    "after_stop": i >= self.stop_step})
        self.last[step.agent] = target
        self.rows.append(row)
        print(f"{setup.name:>9} step {step.step:>2} {step.agent:>10} -> {target}: ttft "
              f"{row['ttft_ms']:>8.1f} ms  prompt {row['prompt_tokens']}  cached "
              f"{row['cached_tokens']}", file=sys.stderr, flush=True)
        return row

    def reply(self, agent: str) -> str | None:
        history = self.agents[agent].history
        return str(history[-1].content) if history else None

    def adopt(self, agent: str, other: Lane) -> None:
        """``agent``'s history becomes ``other``'s: one transcript, the same prompts."""
        self.agents[agent].history = list(other.agents[agent].history)

    def finish(self) -> None:
        """Each live replica's counters, then the shared tier's tenant probe."""
        if self.setup.shared:  # the writers' counters reach /metrics at a ledger poll
            from integrations.vllm.metrics import LEDGER_POLL_S

            time.sleep(1.5 * LEDGER_POLL_S)
        self.metrics = [scrape_connector_metrics(s) for j, s in enumerate(self.servers)
                        if j in self.alive]
        if self.setup.shared and len(self.alive) > 1:
            self.probe = tenant_probe(self.servers, self.configs, self.workload)

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None
        for srv in self.servers:
            srv.stop()
        if self.s3 is not None:
            self.s3.stop()
            self.s3 = None

    def result(self) -> dict[str, Any]:
        setup = self.setup
        stats = [read_stats(Path(c.stats_path))[0] if setup.connector else []
                 for c in self.configs]
        uploads = [read_events(Path(c.stats_path), "shared_upload") if setup.connector else []
                   for c in self.configs]
        return {"rows": self.rows, "errors": self.errors, "server_start_s": self.started_s,
                "seconds": round(self.started_s + self.busy_s, 1),
                "replicas": setup.replicas, "metrics": self.metrics,
                "connector_stats": stats, "uploads": uploads, "tenant_probe": self.probe,
                "router": self.router.cmd if self.router is not None else None,
                "loadavg_1min": round(os.getloadavg()[0], 2)}


def run_config(setup: Setup, workload: Any, served: Any, sizes: dict[str, Any], work: Path,
               args: argparse.Namespace) -> dict[str, Any]:
    """One configuration on fresh servers alone: every step of the schedule."""
    lane = Lane(setup, workload, served, sizes, work, args)
    try:
        lane.start()
        for i, step in enumerate(workload.steps()):
            lane.turn(i, step)
        lane.finish()
    finally:
        lane.stop()
    return lane.result()


def run_interleaved(names: list[str], workload: Any, served: Any, sizes: dict[str, Any],
                    work: Path, args: argparse.Namespace, errors: dict[str, str]
                    ) -> dict[str, Any]:
    """Every configuration's replicas up at once, each step sent to each configuration
    in turn (the order rotating) after the machine went quiet. The first
    configuration's replies become every agent's history, so all send the same prompts
    (``reply_matches_transcript``)."""
    fp16 = sizes["bytes_per_block_fp16"]
    per_replica = {n: sizes["kv_blocks_ceiling" if SETUPS[n].oracle else "kv_blocks_pressure"]
                   * 2 * fp16
                   + (sizes["host_blocks"] * fp16 if SETUPS[n].connector else 0)
                   for n in names}
    check_memory(sum(SETUPS[n].replicas for n in names),
                 extra_gib=sum(SETUPS[n].replicas * per_replica[n] for n in names) / 2**30)
    lanes: dict[str, Lane] = start_lanes(
        names, lambda name: Lane(SETUPS[name], workload, served, sizes, work, args), errors)
    try:
        if not lanes:
            return {}
        # the transcript's replies: the first lane that generates them (the oracle
        # answers one token)
        reference = next((lane for lane in lanes.values() if not lane.setup.oracle),
                         next(iter(lanes.values())))
        for i, step in enumerate(workload.steps()):
            for name in rotation(list(lanes), i):
                waited = settle()
                lanes[name].turn(i, step)["settle_s"] = waited
            said = reference.reply(step.agent)
            for lane in lanes.values():
                if (lane is not reference and "error" not in lane.rows[-1]
                        and not lane.setup.oracle):
                    lane.rows[-1]["reply_matches_transcript"] = lane.reply(step.agent) == said
                if lane is not reference:
                    lane.adopt(step.agent, reference)
        for lane in lanes.values():
            settle()
            lane.finish()
    finally:
        for lane in lanes.values():
            lane.stop()
    return {name: lane.result() for name, lane in lanes.items()}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    from contextkit.pipeline.served.model import ServedModel
    from contextkit.workloads.agents import MultiAgentWorkload
    from integrations.vllm.model import packaged_model_dir

    args.model_dir = str(packaged_model_dir())
    served = ServedModel.packaged(name=SERVED)
    work = Path(args.dir or tempfile.mkdtemp(prefix="ck-bench-replicas-"))
    work.mkdir(parents=True, exist_ok=True)
    workload = MultiAgentWorkload(args.agents, num_tenants=args.tenants, steps=args.steps,
                                  seed=args.seed, scale=args.scale)
    sizes = plan_sizes(workload, served, args)
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    if not args.sequential:
        results = run_interleaved(args.configs, workload, served, sizes, work, args, errors)
    else:
        for name in args.configs:
            try:
                results[name] = run_config(SETUPS[name], workload, served, sizes, work, args)
            except (Exception, SystemExit) as exc:
                errors[name] = f"{type(exc).__name__}: {str(exc)[:2000]}"
                print(f"{name}: did not run: {errors[name]}", file=sys.stderr, flush=True)
    return {"configs": results, "errors": errors, "sizes": sizes, "order": args.configs,
            "interleaved": not args.sequential,
            "workload": workload.describe(), "chunk_blocks": args.chunk_blocks,
            "deadline_s": args.deadline_s, "router_policy": args.router_policy}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m integrations.vllm.bench.replicas_bench")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--agents", type=int, default=6)
    parser.add_argument("--tenants", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--kv-agents", type=float, default=2.0)
    parser.add_argument("--budget-agents", type=float, default=3.0)
    parser.add_argument("--chunk-blocks", type=int, default=4)
    parser.add_argument("--deadline-s", type=float, default=1.0)
    parser.add_argument("--router", default=default_router())
    parser.add_argument("--router-policy", default="consistent_hash")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--sequential", action="store_true")
    args = parser.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(args.configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configurations {unknown}; pick from {', '.join(CONFIGS)}")
    Path(args.out).write_text(json.dumps(measure(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
