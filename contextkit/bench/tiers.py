"""``contextkit bench tiers``: warm/spill bandwidth against a plain copy of the same bytes."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from contextkit.bench._common import machine_info, positive_int, print_table, sync
from gpu_cache import CacheConfig, CacheIdentity, Tier, TQGPUCache

__all__ = ["HELP", "add_arguments", "measure", "run"]

HELP = "warm (DDR->VRAM) and spill (VRAM->DDR) GB/s vs a plain torch copy of the same bytes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=positive_int, default=1024,
                        help="blocks moved per warm/spill (default 1024; Llama-3-8B shape, "
                             "557 KB each)")
    parser.add_argument("--layers", type=positive_int, nargs="+", default=[32, 4],
                        help="layer counts to measure copies_per_move at (default 32 4)")
    parser.add_argument("--repeats", type=positive_int, default=7)


def measure(num_layers: int, num_blocks: int, repeats: int) -> dict[str, Any]:
    identity = CacheIdentity("bench-tiers", num_layers=num_layers, num_kv_heads=8, head_dim=128)
    # Device tier holds exactly the moved set, so a warm needs no eviction.
    cache = TQGPUCache(identity, CacheConfig(num_device_blocks=num_blocks,
                                             num_host_blocks=num_blocks))
    ids = cache.allocate(num_blocks, Tier.DEVICE)
    assert ids is not None
    for t in cache.storage(Tier.DEVICE).tensors():
        t.view(torch.uint8).random_(0, 255)
    nbytes = num_blocks * cache.bytes_per_block
    dev = cache.device
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cache.storage(Tier.HOST).pinned)
    device = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    device.random_(0, 255)

    def timed(fn: Callable[[], object]) -> float:
        sync(dev)
        start = time.perf_counter()
        fn()
        sync(dev)
        return time.perf_counter() - start

    # Interleave the moves and the plain copies round by round, so background load
    # hits both sides of each ratio alike. Each round: spill all, warm all back.
    spill_t, warm_t, d2h_t, h2d_t = [], [], [], []
    copies = set()
    for _ in range(repeats + 1):
        spill_t.append(timed(lambda: cache.spill_blocks(ids)))
        copies.add(cache.stats.last_move_copies)
        d2h_t.append(timed(lambda: host.copy_(device, non_blocking=True)))
        warm_t.append(timed(lambda: cache.warm_blocks(ids)))
        copies.add(cache.stats.last_move_copies)
        h2d_t.append(timed(lambda: device.copy_(host, non_blocking=True)))
    med = {name: statistics.median(ts[1:]) for name, ts in
           (("spill", spill_t), ("warm", warm_t), ("d2h", d2h_t), ("h2d", h2d_t))}
    gb = nbytes / 1e9
    assert len(copies) == 1, f"moves used different copy counts: {copies}"
    return {
        "num_layers": num_layers, "blocks": num_blocks, "bytes": nbytes,
        "warm_gbps": gb / med["warm"], "spill_gbps": gb / med["spill"],
        "memcpy_h2d_gbps": gb / med["h2d"], "memcpy_d2h_gbps": gb / med["d2h"],
        "copies_per_move": copies.pop(),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    per_layers = [measure(n, args.blocks if n == args.layers[0] else max(64, args.blocks // 8),
                           args.repeats) for n in args.layers]
    main = per_layers[0]
    memcpy = (main["memcpy_h2d_gbps"] + main["memcpy_d2h_gbps"]) / 2
    result: dict[str, Any] = {
        "bench": "tiers",
        "machine": machine_info(),
        "blocks": main["blocks"],
        "bytes": main["bytes"],
        "num_layers": main["num_layers"],
        "warm_gbps": main["warm_gbps"],
        "spill_gbps": main["spill_gbps"],
        "memcpy_gbps": memcpy,
        "memcpy_h2d_gbps": main["memcpy_h2d_gbps"],
        "memcpy_d2h_gbps": main["memcpy_d2h_gbps"],
        "warm_ratio": main["warm_gbps"] / main["memcpy_h2d_gbps"],
        "spill_ratio": main["spill_gbps"] / main["memcpy_d2h_gbps"],
        "copies_per_move": main["copies_per_move"],
        "copies_per_move_by_layers": {str(r["num_layers"]): r["copies_per_move"]
                                      for r in per_layers},
    }
    print_table("bench tiers", [
        ("layers | blocks | bytes", f"{main['num_layers']} | {main['blocks']} | "
                                    f"{main['bytes'] / 1e9:.2f} GB"),
        ("warm GB/s (ratio to h2d copy)", f"{result['warm_gbps']:.2f} "
                                          f"({result['warm_ratio']:.2f})"),
        ("spill GB/s (ratio to d2h copy)", f"{result['spill_gbps']:.2f} "
                                           f"({result['spill_ratio']:.2f})"),
        ("plain copy GB/s h2d | d2h", f"{main['memcpy_h2d_gbps']:.2f} | "
                                      f"{main['memcpy_d2h_gbps']:.2f}"),
        ("copies per move by layers", result["copies_per_move_by_layers"]),
    ])
    return result
