"""``contextkit bench ooda``: tier-manager cycle time over many items, and its overhead.

A real :class:`gpu_cache.TQGPUCache` holds one block per item for the first items
(half of the device tier in the prompt tier, half of the host tier in working
memory); the rest are context-only items in working memory or the archive. Each
simulated interval a fraction of the items is used (their blocks attended, or the
access recorded), the clock advances by the interval, and one OODA cycle runs and
moves blocks for real. The cycle's median wall time over the interval is the
fraction of one core the scheduled manager costs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from contextkit.bench._common import (
    fraction,
    machine_info,
    non_negative_int,
    positive_float,
    positive_int,
    print_table,
)
from contextkit.loop.tiers import ContextTier, ContextTierManager, TierManagerConfig
from gpu_cache import CacheConfig, CacheIdentity, Tier, TQGPUCache

__all__ = ["HELP", "add_arguments", "run"]

HELP = "OODA tier-manager cycle time over N items and its overhead at the 60 s interval"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--items", type=positive_int, default=100_000,
                        help="items managed (default 100000)")
    parser.add_argument("--cycles", type=positive_int, default=15, help="timed cycles (default 15)")
    parser.add_argument("--warmup", type=non_negative_int, default=3,
                        help="untimed cycles first; the first settles the initial tiers")
    parser.add_argument("--interval", type=positive_float, default=60.0,
                        help="scheduled interval in seconds (default 60)")
    parser.add_argument("--access-fraction", type=fraction, default=0.01,
                        help="fraction of items used per interval (default 0.01)")
    parser.add_argument("--device-blocks", type=positive_int, default=1024)
    parser.add_argument("--host-blocks", type=positive_int, default=4096)
    parser.add_argument("--seed", type=non_negative_int, default=0)


class _Clock:
    """Simulated wall clock: intervals pass without waiting for them."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.items < 1 or args.cycles < 1:
        raise ValueError("--items and --cycles must be >= 1")
    rng = np.random.default_rng(args.seed)
    identity = CacheIdentity("bench-ooda", num_layers=4, num_kv_heads=2, head_dim=64)
    cache = TQGPUCache(identity, CacheConfig(num_device_blocks=args.device_blocks,
                                             num_host_blocks=args.host_blocks))
    clock = _Clock(time.time())
    config = TierManagerConfig(interval_s=args.interval)
    manager = ContextTierManager(cache, config=config, clock=clock)

    num_on_device = min(args.items, args.device_blocks // 2)
    num_on_host = min(args.items - num_on_device, args.host_blocks // 2)
    device_ids = cache.allocate(num_on_device, Tier.DEVICE, source_layer="memories") or []
    host_ids = cache.allocate(num_on_host, Tier.HOST, source_layer="memories") or []
    block_of = device_ids + host_ids
    relevance = rng.uniform(0.0, 1.0, args.items)
    idle = rng.exponential(config.recency_half_life_s, args.items)
    later = rng.uniform(size=args.items) < 0.3
    for i in range(args.items):
        blocks: tuple[int, ...]
        if i < num_on_device:
            tier, blocks = ContextTier.PROMPT, (block_of[i],)
        elif i < len(block_of):
            tier, blocks = ContextTier.WORKING, (block_of[i],)
        else:
            tier, blocks = (ContextTier.WORKING if later[i] else ContextTier.ARCHIVE), ()
        manager.add_item(f"mem:{i}", tier=tier, block_ids=blocks, relevance=relevance[i],
                         last_access=clock.now - idle[i])

    num_used = max(1, int(args.items * args.access_fraction))
    durations: list[float] = []
    phases: dict[str, list[float]] = {}
    moved = actions = 0
    try:
        for cycle in range(args.warmup + args.cycles):
            clock.now += args.interval
            for i in rng.choice(args.items, num_used, replace=False).tolist():
                item = f"mem:{i}"
                held = manager.get(item).block_ids
                if held:
                    cache.metadata.touch(held, now=clock.now)
                else:
                    manager.record_access(item)
            start = time.perf_counter()
            report = manager.run_once()
            elapsed = time.perf_counter() - start
            if cycle >= args.warmup:
                durations.append(elapsed)
                moved += report.metrics.num_blocks_moved
                actions += len(report.decisions)
                for name, ms in report.metrics.phase_ms.items():
                    phases.setdefault(name, []).append(ms)
        tiers = manager.tier_counts()
    finally:
        manager.close()

    p50 = statistics.median(durations)
    result: dict[str, Any] = {
        "bench": "ooda",
        "machine": machine_info(),
        "items": args.items,
        "items_with_blocks": len(block_of),
        "cycles": args.cycles,
        "cycle_ms_p50": p50 * 1e3,
        "cycle_ms_p90": float(np.percentile(durations, 90)) * 1e3,
        "cycle_ms_max": max(durations) * 1e3,
        "phase_ms_p50": {name: statistics.median(v) for name, v in phases.items()},
        "interval_s": args.interval,
        "overhead_fraction": p50 / args.interval,
        "blocks_moved": moved,
        "decisions": actions,
        "items_by_tier": tiers,
        "accesses_per_cycle": num_used,
        "cache": {"device_blocks": args.device_blocks, "host_blocks": args.host_blocks,
                  "bytes_per_block": cache.bytes_per_block},
    }
    print_table("bench ooda", [
        ("items (with blocks)", f"{args.items:,} ({len(block_of):,})"),
        ("cycle ms p50 | p90 | max", f"{result['cycle_ms_p50']:.2f} | "
                                     f"{result['cycle_ms_p90']:.2f} | "
                                     f"{result['cycle_ms_max']:.2f}"),
        ("phase ms p50", ", ".join(f"{k} {v:.2f}" for k, v in
                                   result["phase_ms_p50"].items())),
        ("interval s", args.interval),
        ("overhead fraction", f"{result['overhead_fraction']:.2e}"),
        ("decisions | blocks moved", f"{actions:,} | {moved:,} over {args.cycles} cycles"),
        ("items by tier", tiers),
    ])
    return result
