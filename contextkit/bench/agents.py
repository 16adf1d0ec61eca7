"""``contextkit bench agents``: many agents sharing a cache too small for all of them.

The workload is :class:`contextkit.workloads.agents.MultiAgentWorkload` (6 agents of 3 tenants
by default, ten-layer prompts of 1.5K-3K tokens, a seeded schedule of round-robin
passes, bursts and agents that return after long pauses). One engine is loaded; each
policy runs the whole schedule on its own fresh cache of identical sizes
(:meth:`~contextkit.engine.engine.Engine.sibling`), one pipeline per agent, in one process.
Each step goes to every configuration in turn (:func:`run_interleaved`), all fed the
same transcript:

- ``lru``: eviction by recency only (``eviction_policy="lru"``), no pins, no tier
  manager;
- ``semantic``: eviction by layer priority and importance, each agent's stable prefix
  pinned, no tier manager;
- ``semantic+ooda``: the same plus a :class:`~contextkit.loop.tiers.ContextTierManager`
  that knows every agent's blocks (the pipelines register them) and the schedule's
  look-ahead: between turns it runs one OODA cycle, then
  :meth:`~contextkit.loop.tiers.ContextTierManager.prefetch` makes the room the turn needs
  (blocks no agent is due to read first, then the lowest effective priority, the agent
  due furthest among equals) and warms the blocks the turn reuses. That time
  is reported as ``ooda_cycle_ms``, never inside a TTFT, and every prefetch finishes
  before its turn's generate starts (``prefetch_before_generate``).

Sizes come from a dry build of every step's prompt (no model run): the device tier
holds ``--device-agents`` times the largest agent's prompt plus reply headroom, the
host tier ``--host-agents`` times the mean agent's. Pins may take what the largest
request leaves free, so a request never has to reclaim a pin; at a size where that
room is smaller than an agent's stable prefix, the pinning policies run unpinned
(``pins`` in the sizes says so). The sweep reruns the first ``--sweep-steps`` steps at
each device size (the main size's rows are a prefix of the main run).

Figures (all computed from the per-step rows by :func:`policy_figures`, :func:`speedups`
and :func:`bounds`): TTFT per step, ``ttft_p50``/``ttft_p95`` and the speedups over the
*warm* steps (the agent's second turn on: a first turn is the same cold prefill under
every policy); hit rates over all steps: ``device_hit_rate`` is reused tokens already on
the device over prompt tokens, ``host_hit_rate`` reused tokens the request brought up
from the host tier (:attr:`~contextkit.engine.engine.GenerationResult.warmed_tokens`)
over prompt tokens; blocks and bytes moved between tiers; ``pinned_blocks_evicted``
counts blocks pinned when a step began that were off the device when it ended (must be
0). Reuse beyond the prefix (:mod:`contextkit.engine.chunks`) is on unless
``--no-chunk-reuse``: per policy ``chunk_reused_tokens`` and ``repaired_tokens``; the
ceiling (every agent fits) is run with it and again with prefix reuse only
(``computed_tokens_prefix_only``: the floor of prefix reuse on this schedule). The
ceiling is stated in tokens computed, which no policy can beat on the same prompts;
``bounds`` gives each policy's share of lru's avoidable tokens that it avoided. """

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contextkit.bench._agents_report import (
    POLICIES,
    bounds,
    percentile,
    policy_figures,
    speedups,
)
from contextkit.bench._agents_report import plot as _plot
from contextkit.bench._common import (
    machine_info,
    non_negative_int,
    positive_float,
    positive_int,
    print_table,
)
from contextkit.config import require

if TYPE_CHECKING:
    from contextkit.engine.engine import Engine
    from contextkit.workloads.agents import MultiAgentWorkload

__all__ = ["CEILING", "HELP", "POLICIES", "PREFIX_ONLY", "PolicyRun", "Sizes", "add_arguments",
           "bounds", "check_args", "dry_build", "parse_sweep", "percentile", "plan_sizes",
           "policy_figures", "run", "run_interleaved", "run_policies", "run_policy", "speedups"]

HELP = ("many agents sharing a cache too small for all of them: TTFT per step under lru, "
        "semantic and semantic+ooda (look-ahead prefetch), and a device-size sweep")
#: ``--out`` names a JSON file; the CLI writes the result there with its provenance.
OUT_IS_JSON = True

#: the policies, in the order they run and are reported
#: messages of the agent's own conversation each turn carries
HISTORY_MESSAGES = 4
#: The configurations run beside the policies: every agent fits (the ceiling), and the
#: same with prefix reuse only.
CEILING = "ceiling"
PREFIX_ONLY = "ceiling, prefix reuse only"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--agents", type=positive_int, default=6, help="agents (default 6)")
    parser.add_argument("--tenants", type=positive_int, default=3,
                        help="tenants; agents of one share its organisation layers (default 3)")
    parser.add_argument("--steps", type=positive_int, default=36,
                        help="steps of the schedule, >= 2 x agents (default 36)")
    parser.add_argument("--scale", type=positive_float, default=1.0,
                        help="workload scale (default 1.0: 1.5K-3K-token prompts)")
    parser.add_argument("--device-agents", type=positive_int, default=2,
                        help="device tier: this many of the largest agent's prompts plus reply "
                             "headroom (default 2)")
    parser.add_argument("--host-agents", type=non_negative_int, default=1,
                        help="host tier: this many mean agent prompts (default 1: with the "
                             "device tier of 2 the six agents do not fit; 4 holds them all)")
    parser.add_argument("--sweep", default="1,2,4,all",
                        help="device sizes in agents for the sweep, comma-separated; 'all': "
                             "every agent fits; '' skips it (default 1,2,4,all)")
    parser.add_argument("--sweep-steps", type=positive_int, default=12,
                        help="steps of the schedule each sweep size runs: the first N of the "
                             "main run's (default 12; the defaults take ~12 min on 2 cores)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=1,
                        help="reply length per turn (default 1: TTFT is the figure)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="workload seed")
    parser.add_argument("--no-chunk-reuse", action="store_true",
                        help="prefix reuse only (the ablation of reuse beyond the prefix: "
                             "docs/chunks.md)")
    parser.add_argument("--out", default=None,
                        help="also write the JSON result (with its provenance) here")
    parser.add_argument("--plot", default=None,
                        help="write the TTFT-per-step and sweep plot (PNG) here")


def parse_sweep(text: str, num_agents: int) -> list[int]:
    """Device sizes in agents from ``--sweep`` (``all`` is ``num_agents``), sorted.

    Raises:
        ValueError: a size that is not a positive integer or ``all`` (one line).
    """
    sizes: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part == "all":
            sizes.add(num_agents)
            continue
        try:
            value = int(part)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"--sweep takes device sizes in agents (integers >= 1) or 'all', "
                             f"comma-separated, e.g. 1,2,4,all; got {part!r}")
        sizes.add(min(value, num_agents))
    return sorted(sizes)


def check_args(args: argparse.Namespace) -> None:
    """Refuse arguments the bench cannot run, in one line.

    Raises:
        SystemExit: tenants over agents, too few steps, a bad sweep or plot path.
    """
    if args.agents < 2:
        raise SystemExit(f"--agents must be >= 2 (agents share the cache), got {args.agents}")
    if args.tenants > args.agents:
        raise SystemExit(f"--tenants must be at most --agents ({args.agents}), got "
                         f"{args.tenants}")
    if args.steps < 2 * args.agents:
        raise SystemExit(f"--steps must be >= 2 x --agents = {2 * args.agents} (every agent "
                         f"takes 2 turns), got {args.steps}")
    try:
        parse_sweep(args.sweep, args.agents)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if args.plot and not str(args.plot).endswith(".png"):
        raise SystemExit(f"--plot writes a PNG: give a path ending in .png, got {args.plot}")


# ---------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class Sizes:
    """Tier sizes of one run, in blocks, and the pin budget that goes with them."""

    block_size: int
    device_agents: int
    host_agents: int
    largest_prompt_blocks: int
    mean_prompt_blocks: int
    headroom_blocks: int
    largest_stable_blocks: int

    @property
    def request_blocks(self) -> int:
        """Blocks the largest request needs (prompt + reply headroom)."""
        return self.largest_prompt_blocks + self.headroom_blocks

    @property
    def device_blocks(self) -> int:
        return self.device_agents * self.request_blocks

    @property
    def host_blocks(self) -> int:
        return max(1, self.host_agents * self.mean_prompt_blocks)

    @property
    def pin_budget(self) -> int:
        """Device blocks pins may hold: what the largest request leaves free."""
        return self.device_blocks - self.request_blocks

    @property
    def pins(self) -> bool:
        """Whether every agent's stable prefix fits the pin budget (else no pins)."""
        return self.largest_stable_blocks <= self.pin_budget and self.pin_budget > 0

    def describe(self) -> dict[str, Any]:
        bs = self.block_size
        return {
            "block_size": bs,
            "device_agents": self.device_agents, "device_blocks": self.device_blocks,
            "device_tokens": self.device_blocks * bs,
            "host_agents": self.host_agents, "host_blocks": self.host_blocks,
            "host_tokens": self.host_blocks * bs,
            "largest_prompt_blocks": self.largest_prompt_blocks,
            "mean_prompt_blocks": self.mean_prompt_blocks,
            "headroom_blocks": self.headroom_blocks,
            "largest_stable_prefix_blocks": self.largest_stable_blocks,
            "pin_budget_blocks": max(0, self.pin_budget),
            "pins": ("on: stable prefixes pinned within the pin budget" if self.pins else
                     "off: the room the largest request leaves cannot hold a stable prefix"),
        }


def plan_sizes(prompt_blocks: Mapping[str, int], stable_blocks: Mapping[str, int], *,
               block_size: int, device_agents: int, host_agents: int,
               max_new_tokens: int) -> Sizes:
    """Tier sizes from each agent's largest prompt (blocks) and stable prefix (blocks).

    Reply headroom covers the reply and the two earlier replies in the history.

    Raises:
        ValueError: no agents, or a size below 1 agent on the device.
    """
    if not prompt_blocks:
        raise ValueError("no agents to size the tiers for")
    if device_agents < 1:
        raise ValueError(f"device_agents must be >= 1, got {device_agents}")
    headroom = -(-(3 * max_new_tokens + block_size) // block_size)
    return Sizes(block_size=block_size, device_agents=device_agents, host_agents=host_agents,
                 largest_prompt_blocks=max(prompt_blocks.values()),
                 mean_prompt_blocks=round(statistics.mean(prompt_blocks.values())),
                 headroom_blocks=headroom,
                 largest_stable_blocks=max(stable_blocks.values(), default=0))


def dry_build(engine: Engine, workload: MultiAgentWorkload, steps: int
              ) -> tuple[list[int], dict[str, int], dict[str, int]]:
    """Every step's prompt tokens, laid out as the run will (no model run), and per
    agent its largest prompt and stable prefix in blocks."""
    from contextkit.pipeline.pipeline import CacheAwareContextPipeline

    bs = engine.cache.block_size
    pipes = {a.name: CacheAwareContextPipeline(engine, tenant=a.tenant, agent=a.name,
                                               pin_stable=False, metrics=False)
             for a in workload.agents}
    history: dict[str, list[tuple[str, str]]] = {a.name: [] for a in workload.agents}
    tokens: list[int] = []
    prompt: dict[str, int] = {}
    stable: dict[str, int] = {}
    for i in range(steps):
        step = workload.step(i)
        pipe = pipes[step.agent]
        pipe.build(workload.system_prompt(i))
        ids, _, stable_end = pipe.assemble(step.user_message,
                                           history[step.agent][-HISTORY_MESSAGES:])
        tokens.append(len(ids))
        prompt[step.agent] = max(prompt.get(step.agent, 0), -(-len(ids) // bs))
        stable[step.agent] = max(stable.get(step.agent, 0), stable_end // bs)
        history[step.agent] += [("user", step.user_message), ("assistant", "ok")]
    return tokens, prompt, stable


# ---------------------------------------------------------------------- one policy
def _pinned_on_device(cache: Any) -> set[int]:
    return {m.block_id for m in cache.metadata.pinned()}


def _off_device(cache: Any, block_ids: set[int]) -> int:
    from gpu_cache import Tier

    return sum(1 for b in block_ids
               if b not in cache.metadata or cache.metadata.get(b).tier is not Tier.DEVICE)


class PolicyRun:
    """One configuration of the bench: ``policy`` on its own fresh cache of ``sizes``, fed
    the schedule one step at a time so that configurations can take turns.

    ``engine`` gives the model (:meth:`~contextkit.engine.engine.Engine.sibling` shares
    it); ``chunk_reuse`` overrides the engine's setting for this configuration.
    """

    def __init__(self, engine: Engine, workload: MultiAgentWorkload, policy: str,
                 sizes: Sizes, *, max_new_tokens: int, chunk_reuse: bool | None = None
                 ) -> None:
        from contextkit.loop.tiers import ContextTierManager, TierManagerConfig
        from contextkit.pipeline.pipeline import CacheAwareContextPipeline
        from gpu_cache.config import PinConfig

        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        pinning = policy != "lru" and sizes.pins
        share = max(sizes.pin_budget, 1) / sizes.device_blocks
        extra: dict[str, Any] = {} if chunk_reuse is None else {"chunk_reuse": chunk_reuse}
        self.engine = engine.sibling(num_device_blocks=sizes.device_blocks,
                                     num_host_blocks=sizes.host_blocks,
                                     eviction_policy="lru" if policy == "lru" else "semantic",
                                     pins=PinConfig(tenant_share=share, total_share=share,
                                                    idle_ttl_s=None),
                                     metrics=False, **extra)
        self.cache = self.engine.cache
        self.workload = workload
        self.policy = policy
        self.max_new_tokens = max_new_tokens
        # The prefetch is told exactly what each turn reuses (plan_turn), which protects
        # the due agent; protecting the agents due after it too (protect_horizon > 0) kept
        # their blocks at the cost of cheaper victims (docs/agents.md).
        self.manager = (ContextTierManager(self.cache,
                                           config=TierManagerConfig(protect_horizon=0))
                        if policy == "semantic+ooda" else None)
        self.pipes = {a.name: CacheAwareContextPipeline(self.engine, tenant=a.tenant,
                                                        agent=a.name, pin_stable=pinning,
                                                        tiers=self.manager, metrics=False)
                      for a in workload.agents}
        self.homes = {a.name: a.tenant for a in workload.agents}
        self.rows: list[dict[str, Any]] = []

    def step(self, i: int, history: Sequence[tuple[str, str]]) -> tuple[dict[str, Any], str]:
        """Run step ``i`` with the agent's ``history``; its row and this run's reply."""
        from gpu_cache import Tier

        cache, manager = self.cache, self.manager
        step = self.workload.step(i)
        pipe = self.pipes[step.agent]
        pipe.build(self.workload.system_prompt(i))
        pinned = _pinned_on_device(cache)
        moved0 = cache.stats.blocks_warmed + cache.stats.blocks_spilled
        bytes0 = cache.stats.bytes_moved
        row: dict[str, Any] = {"step": i, "agent": step.agent, "tenant": step.tenant,
                               "kind": step.kind, "agent_turn": step.agent_turn}
        if manager is not None:
            t0 = time.perf_counter()
            manager.set_lookahead(self.workload.lookahead(i - 1), tenants=self.homes)
            cycle_moved = manager.run_once().metrics.num_blocks_moved
            cycle_ms = (time.perf_counter() - t0) * 1e3
            # what the turn will reuse and allocate: its assembled prompt looked up
            t1 = time.perf_counter()
            plan = pipe.plan_turn(step.user_message, history=history,
                                  max_new_tokens=self.max_new_tokens)
            need = plan.need_blocks
            plan_ms = (time.perf_counter() - t1) * 1e3
            pre = manager.prefetch(step.agent, need_blocks=need, blocks=plan.reuse_block_ids)
            row.update(ooda_ms=cycle_ms + plan_ms + pre.duration_s * 1e3, cycle_ms=cycle_ms,
                       plan_ms=plan_ms, prefetch_ms=pre.duration_s * 1e3,
                       prefetch_need_blocks=need, prefetch_warmed=len(pre.warmed),
                       prefetch_spilled=len(pre.spilled), prefetch_removed=len(pre.removed),
                       prefetch_bytes=pre.bytes_moved, cycle_blocks_moved=cycle_moved,
                       prefetch_finished_at=pre.finished_at)
        row["generate_started_at"] = time.perf_counter()
        res = pipe.generate(step.user_message, history=history,
                            max_new_tokens=self.max_new_tokens)
        g = res.generation
        row.update(prompt_tokens=g.prompt_tokens, reused_tokens=g.reused_tokens,
                   warmed_tokens=g.warmed_tokens, computed_tokens=g.computed_tokens,
                   chunk_reused_tokens=g.chunk_reused_tokens, repaired_tokens=g.repaired_tokens,
                   ttft_ms=g.ttft_ms, prefix_broken_by=res.report.prefix_broken_by,
                   pin_state=res.report.pin_state,
                   blocks_moved=(cache.stats.blocks_warmed + cache.stats.blocks_spilled
                                 - moved0),
                   bytes_moved=cache.stats.bytes_moved - bytes0,
                   pinned_blocks=len(_pinned_on_device(cache)),
                   pinned_blocks_evicted=_off_device(cache, pinned),
                   device_used=cache.num_used(Tier.DEVICE), host_used=cache.num_used(Tier.HOST))
        self.rows.append(row)
        return row, res.text

    def close(self) -> dict[str, Any]:
        """Stop the tier manager; the rows, the tiers at the end and ``leak_free`` (free +
        used == capacity in every tier)."""
        from gpu_cache import Tier

        if self.manager is not None:
            self.manager.close()
        cache = self.cache
        tiers = {t.value: {"capacity": cache.capacity(t), "used": cache.num_used(t),
                           "free": cache.num_free(t)} for t in Tier}
        leak_free = all(v["free"] + v["used"] == v["capacity"] for v in tiers.values())
        return {"rows": self.rows, "tiers": tiers, "leak_free": leak_free,
                "pinned_blocks": len(_pinned_on_device(cache))}


def run_interleaved(runs: Mapping[str, PolicyRun], workload: MultiAgentWorkload, *,
                    steps: int, progress: bool = True,
                    on_step: Callable[[str, dict[str, Any]], None] | None = None
                    ) -> dict[str, dict[str, Any]]:
    """Send each of the first ``steps`` steps to every run in turn, then the next step.

    Interleaving makes machine drift hit every configuration alike, and the order within
    a step rotates so none always runs first. Every run sees the same prompts: the
    history is one transcript, the first run's replies, and each row's
    ``reply_matches_transcript`` says whether that run answered the same.
    """
    tqdm = require("tqdm", "bench").tqdm
    labels = list(runs)
    history: dict[str, list[tuple[str, str]]] = {a.name: [] for a in workload.agents}
    bar = tqdm(total=steps * len(labels), desc=" + ".join(labels), unit="turn",
               file=sys.stderr, disable=not progress)
    try:
        for i in range(steps):
            step = workload.step(i)
            turn = history[step.agent][-HISTORY_MESSAGES:]
            shift = i % len(labels)
            replies: dict[str, str] = {}
            for label in labels[shift:] + labels[:shift]:
                row, replies[label] = runs[label].step(i, turn)
                if on_step is not None:
                    on_step(label, row)
                bar.update(1)
            for label in labels:
                runs[label].rows[-1]["reply_matches_transcript"] = (
                    replies[label] == replies[labels[0]])
            history[step.agent] += [("user", step.user_message),
                                    ("assistant", replies[labels[0]])]
    finally:
        bar.close()
        results = {label: run.close() for label, run in runs.items()}
    return results


def run_policy(engine: Engine, workload: MultiAgentWorkload, policy: str, sizes: Sizes, *,
               steps: int, max_new_tokens: int, progress: bool = True,
               on_step: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """One configuration alone: the first ``steps`` steps under ``policy`` (see
    :class:`PolicyRun` and :func:`run_interleaved`)."""
    run = PolicyRun(engine, workload, policy, sizes, max_new_tokens=max_new_tokens)
    return run_interleaved({policy: run}, workload, steps=steps, progress=progress,
                           on_step=None if on_step is None else
                           (lambda _label, row: on_step(row)))[policy]


# ---------------------------------------------------------------------- run
def run_policies(engine: Engine, workload: MultiAgentWorkload, sizes: Sizes, *, steps: int,
                 max_new_tokens: int, policies: Sequence[str] = POLICIES,
                 progress: bool = True) -> dict[str, dict[str, Any]]:
    """Every policy on identical fresh caches of ``sizes``, interleaved step by step."""
    runs = {p: PolicyRun(engine, workload, p, sizes, max_new_tokens=max_new_tokens)
            for p in policies}
    return run_interleaved(runs, workload, steps=steps, progress=progress)


def summarize(runs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Per-policy figures and the speedups from :func:`run_policies`' output."""
    rows = runs["lru"]["rows"]
    figures = {p: {**policy_figures(r["rows"]), "leak_free": r["leak_free"],
                   "tiers_at_end": r["tiers"]} for p, r in runs.items()}
    ttft = {p: [row["ttft_ms"] for row in r["rows"]] for p, r in runs.items()}
    return {"policies": figures, **speedups(ttft, rows)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    check_args(args)
    from contextkit.engine.engine import Engine
    from contextkit.workloads.agents import MultiAgentWorkload

    started = time.perf_counter()
    workload = MultiAgentWorkload(args.agents, num_tenants=args.tenants, steps=args.steps,
                                  seed=args.seed, scale=args.scale)
    engine = Engine.from_pretrained(num_device_blocks=16, num_host_blocks=16, metrics=False,
                                    chunk_reuse=not args.no_chunk_reuse)
    tokens, prompt_blocks, stable_blocks = dry_build(engine, workload, args.steps)

    def size(device_agents: int) -> Sizes:
        return plan_sizes(prompt_blocks, stable_blocks, block_size=engine.cache.block_size,
                          device_agents=device_agents, host_agents=args.host_agents,
                          max_new_tokens=args.max_new_tokens)

    main = size(min(args.device_agents, args.agents))
    # The workload's ceiling on this schedule: the same steps on a cache that holds every
    # agent (semantic; only dead blocks are ever evicted), run in turn with the policies
    # on the same prompts, so no policy can compute fewer tokens. With chunk reuse on,
    # the same ceiling with prefix reuse only is the floor reuse by prefix cannot go under.
    everyone = size(args.agents)
    configs = {p: PolicyRun(engine, workload, p, main, max_new_tokens=args.max_new_tokens)
               for p in POLICIES}
    configs[CEILING] = PolicyRun(engine, workload, "semantic", everyone,
                                 max_new_tokens=args.max_new_tokens)
    if engine.chunk_reuse.enabled:
        configs[PREFIX_ONLY] = PolicyRun(engine, workload, "semantic", everyone,
                                         max_new_tokens=args.max_new_tokens,
                                         chunk_reuse=False)
    done = run_interleaved(configs, workload, steps=args.steps)
    runs = {p: done[p] for p in POLICIES}
    result: dict[str, Any] = {"bench": "agents", **summarize(runs)}
    fits = done[CEILING]["rows"]
    warm_total = {k: sum(r["ttft_ms"] for r in v["rows"] if r["agent_turn"] >= 1)
                  for k, v in done.items()}
    bound = speedups({"lru": [r["ttft_ms"] for r in runs["lru"]["rows"]],
                      "fits": [r["ttft_ms"] for r in fits]}, runs["lru"]["rows"])
    result["ceiling"] = {
        "device_blocks": everyone.device_blocks, "host_blocks": everyone.host_blocks,
        "ttft_ms": [round(r["ttft_ms"], 1) for r in fits],
        "ttft_p50": policy_figures(fits)["ttft_p50"],
        "computed_tokens": sum(r["computed_tokens"] for r in fits),
        "chunk_reused_tokens": sum(r["chunk_reused_tokens"] for r in fits),
        "speedup_vs_lru_total": bound["speedup_vs_lru_total"]["fits"],
    }
    if PREFIX_ONLY in done:
        result["ceiling"]["computed_tokens_prefix_only"] = sum(
            r["computed_tokens"] for r in done[PREFIX_ONLY]["rows"])
    result["bounds"] = bounds({k: sum(r["computed_tokens"] for r in v["rows"])
                               for k, v in done.items() if k != PREFIX_ONLY},
                              warm_total, ceiling=CEILING)
    result["replies_differing_from_transcript"] = {
        k: sum(not r["reply_matches_transcript"] for r in v["rows"]) for k, v in done.items()}
    sweep_steps = min(args.sweep_steps, args.steps)
    sweep: list[dict[str, Any]] = []
    for device_agents in parse_sweep(args.sweep, args.agents):
        s = size(device_agents)
        if device_agents == main.device_agents:
            part = {p: {**r, "rows": r["rows"][:sweep_steps]} for p, r in runs.items()}
        else:
            part = run_policies(engine, workload, s, steps=sweep_steps,
                                max_new_tokens=args.max_new_tokens)
        summary = summarize(part)
        sweep.append({"device_agents": device_agents, "device_blocks": s.device_blocks,
                      "device_tokens": s.device_blocks * s.block_size,
                      "pins": s.pins, "steps": sweep_steps,
                      "speedup_vs_lru_total": summary["speedup_vs_lru_total"],
                      "speedup_vs_lru_p50": summary["speedup_vs_lru_p50"],
                      "ttft_p50": {p: f["ttft_p50"] for p, f in summary["policies"].items()},
                      "device_hit_rate": {p: f["device_hit_rate"]
                                          for p, f in summary["policies"].items()},
                      "pinned_blocks_evicted": sum(f["pinned_blocks_evicted"]
                                                   for f in summary["policies"].values())})
    result.update({
        "sweep": sweep,
        "sizes": main.describe(),
        "workload": {**workload.describe(), "prompt_tokens": tokens,
                     "history_messages": HISTORY_MESSAGES,
                     "max_new_tokens": args.max_new_tokens},
        "rows": {p: r["rows"] for p, r in runs.items()},
        "measured_steps": "ttft_p50/p95 and speedups: steps of an agent's second turn on; "
                          "hit rates, moves and evictions: every step",
        "method": "every step is sent to each configuration in turn (the order rotates), "
                  "all fed one transcript (lru's replies); bounds are in tokens computed",
        "model": "packaged SmolLM2-135M-Instruct (float32), TQ4 cache",
        "seconds": round(time.perf_counter() - started, 1),
        "machine": machine_info(),
    })
    pol = result["policies"]
    table: list[tuple[str, Any]] = [
        ("sizes", f"device {main.device_blocks} blocks ({main.device_agents} agents), host "
                  f"{main.host_blocks} blocks ({main.host_agents} agents), "
                  f"{main.block_size} tokens/block"),
        *[(f"ttft p50 | p95 {p} (ms)", f"{pol[p]['ttft_p50']:,.0f} | {pol[p]['ttft_p95']:,.0f}")
          for p in POLICIES],
        *[(f"speedup vs lru, TTFT sums | p50 of ratios {p}",
           f"{result['speedup_vs_lru_total'][p]} | {result['speedup_vs_lru_p50'][p]}")
          for p in POLICIES[1:]],
        ("ceiling: speedup vs lru (TTFT sums) if every agent fit",
         result["ceiling"]["speedup_vs_lru_total"]),
        *[(f"share of lru's avoidable tokens avoided {p}",
           result["bounds"][p]["ceiling_fraction"]) for p in POLICIES[1:]],
        *[(f"tokens computed | moved in as chunks {p}",
           f"{pol[p]['computed_tokens']:,} | {pol[p]['chunk_reused_tokens']:,}") for p in POLICIES],
        ("ceiling: tokens computed | with prefix reuse only",
         f"{result['ceiling']['computed_tokens']:,} | "
         f"{result['ceiling'].get('computed_tokens_prefix_only', '-')}"),
        *[(f"hit rate device | host {p}", f"{pol[p]['device_hit_rate']:.2f} | "
                                          f"{pol[p]['host_hit_rate']:.2f}") for p in POLICIES],
        ("pinned_blocks_evicted", {p: pol[p]["pinned_blocks_evicted"] for p in POLICIES}),
        ("ooda_cycle_ms_p50", pol["semantic+ooda"]["ooda_cycle_ms_p50"]),
        *[(f"sweep {s['device_agents']} agents: speedup (TTFT sums)", s["speedup_vs_lru_total"])
          for s in sweep],
    ]
    print_table(f"bench agents ({args.agents} agents, {args.steps} steps)", table)
    if args.plot:
        _plot(Path(args.plot), {p: [r["ttft_ms"] for r in runs[p]["rows"]] for p in POLICIES},
              sweep,
              f"{args.agents} agents sharing a {main.device_agents}-agent device tier "
              f"({machine_info()['device_name']})")
        result["plot"] = str(args.plot)
    return result
