"""Shadow bench: shadow and recover a Llama-3-8B-shaped TQ4 cache vs plain sequential I/O.

The same run writes and reads a plain file of the same size in the same directory
with the same fsync policy (fsync the file, then its directory), so the ratios say
what the shadow format costs over the disk itself. Integrity is on, as in a deployment
with ``CONTEXTKIT_SHADOW_KEY`` set (a random key per run): every block's MAC (Poly1305 of
its bytes under a one-time key, HMAC-SHA256 of the key, tenant, identity, position and a
random nonce) is computed while it is written and checked before it is imported;
``--unsigned`` measures without a key. ``mac_gbps`` is one core's Poly1305 throughput on
this machine, what the MACs cost.

The reads alternate in ABBA order (plain, shadow, shadow, plain, ...), ``--repeats``
times each, and the read ratio is the ratio of the medians: a virtual disk's throughput
drifts by tens of percent within a minute, and on a VM the file written last (the plain
one) reads up to twice as fast once, from the host's cache, which no guest can drop.

Before every read the files' pages are dropped from the page cache with
``posix_fadvise(DONTNEED)`` (dropping the whole page cache needs root); where that call
is missing the reads may come from memory, and the output says so.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import secrets
import shutil
import statistics
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from contextkit.bench._common import fraction, machine_info, positive_int, print_table
from gpu_cache import BlockHash, CacheConfig, CacheIdentity, Tier, TQGPUCache
from shadow import CacheShadow, LocalStore, MeteredStore, ShadowConfig, recover_session
from shadow.cli import available_memory
from shadow.stores import fsync_dir

__all__ = ["HELP", "add_arguments", "run"]

HELP = "shadow a Llama-3-8B-shaped cache to disk and recover it, vs raw sequential I/O"

#: Llama-3-8B KV shape: 32 layers, 8 KV heads, head_dim 128, 16-token blocks.
LLAMA3_8B = CacheIdentity(model_id="bench/llama-3-8b-shape", num_layers=32, num_kv_heads=8,
                          head_dim=128, block_size=16)
FULL_BLOCKS = 10_000  # ~5.6 GB: the target size
#: The default is scaled down so a run stays near 3 minutes on a ~150 MB/s disk (the
#: shadow and the raw file are each written and read once); --blocks 10000 for full size.
DEFAULT_BLOCKS = 4_000
_CHUNK = 64 * 1024 * 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=positive_int, default=DEFAULT_BLOCKS,
                        help=f"blocks to shadow (default {DEFAULT_BLOCKS:,}, ~2.2 GB; "
                             f"{FULL_BLOCKS:,} is the full ~5.6 GB); scaled down automatically "
                             "when memory or disk is short")
    parser.add_argument("--dir", default=None,
                        help="directory to write to (default: a temp dir under "
                             "~/.cache/contextkit); it is removed afterwards")
    parser.add_argument("--changed-fraction", type=fraction, default=0.01,
                        help="share of blocks replaced before the incremental shadow")
    parser.add_argument("--repeats", type=positive_int, default=5,
                        help="read both the plain file and the shadow this many times, "
                             "alternating (ABBA); the ratio is of the medians (default 5)")
    parser.add_argument("--unsigned", action="store_true",
                        help="shadow and recover without a key (no block MACs); by default "
                             "integrity is on, as with CONTEXTKIT_SHADOW_KEY set")


def _mac_gbps(nbytes: int = 256 << 20) -> float:
    """One core's block-MAC throughput (Poly1305 over 1 MiB blocks, each with its
    one-time key derived as :func:`shadow.auth.block_mac` does), GB/s."""
    from shadow.auth import BlockBinding, block_mac, new_block_nonces

    buf = memoryview(os.urandom(1 << 20))
    key = os.urandom(32)
    blocks = nbytes >> 20
    nonces = new_block_nonces(blocks)
    start = time.perf_counter()
    for i in range(blocks):
        binding = BlockBinding(identity=struct.pack("<Q", i) * 4, session_id="bench",
                               tenant="default", key=None, segment="seg", slot=i)
        block_mac(key, binding, nonces[i], [buf])
    return nbytes / (time.perf_counter() - start) / 1e9


def _drop_cache(paths: list[Path]) -> bool:
    """Evict these files' clean pages from the page cache; False where unsupported."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def _raw_write(path: Path, nbytes: int) -> float:
    buf = memoryview(os.urandom(1 << 20) * (_CHUNK >> 20))
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left:
            n = f.write(buf[:min(left, len(buf))])
            assert n is not None
            left -= n
        os.fsync(f.fileno())
    fsync_dir(path.parent)
    return time.perf_counter() - start


def _raw_read(path: Path) -> float:
    buf = memoryview(bytearray(_CHUNK))
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - start


def _fill(cache: TQGPUCache, num_blocks: int, first_serial: int) -> list[int]:
    """Allocate host blocks, fill them with varied bytes and give each a unique key."""
    ids = cache.allocate(num_blocks, Tier.HOST, source_layer="memories")
    assert ids is not None
    host = cache.storage(Tier.HOST)
    slots = torch.tensor([cache.metadata.get(b).slot for b in ids])
    gen = torch.Generator().manual_seed(first_serial)
    step = 256
    for t in host.tensors():
        shape = (t.shape[0], 1, *t.shape[2:])
        if t.dtype == torch.uint8:
            tile = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        else:
            tile = torch.rand(shape, generator=gen) + 0.5
        for i in range(0, num_blocks, step):
            part = slots[i:i + step]
            t.index_copy_(1, part, tile.expand(-1, part.numel(), *t.shape[2:]))
    # per-block variation so checksums differ between blocks
    host.k_norms[0, slots, 0, 0] = torch.arange(first_serial, first_serial + num_blocks,
                                                dtype=torch.float32)
    for i, bid in enumerate(ids):
        cache.set_key(bid, BlockHash(hashlib.sha256(f"bench-{first_serial + i}".encode()).digest()))
        cache.metadata.annotate(bid, num_tokens=cache.block_size,
                                token_range=(i * cache.block_size, (i + 1) * cache.block_size))
    return ids


def run(args: argparse.Namespace) -> dict[str, Any]:
    identity = LLAMA3_8B
    per_block = identity.bytes_per_block
    requested = int(args.blocks)
    base = Path(args.dir) if args.dir else Path("~/.cache/contextkit").expanduser()
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-shadow-", dir=base))
    changed = max(1, round(requested * args.changed_fraction))
    # one cache lives at a time; keep 4 GiB of memory and disk spare
    fit_mem = (available_memory(unknown=8 << 30) - (4 << 30) - 3 * _CHUNK) // per_block - changed
    fit_disk = (shutil.disk_usage(work).free - (4 << 30)) // (2 * per_block) - changed
    num_blocks = max(16, min(requested, fit_mem, fit_disk))
    notes = []
    if requested < FULL_BLOCKS:
        notes.append(f"{requested:,} of the {FULL_BLOCKS:,}-block (5.6 GB) target; pass "
                     f"--blocks {FULL_BLOCKS} for the full size")
    if num_blocks < requested:
        notes.append(f"scaled down from {requested:,} to {num_blocks:,} blocks to fit "
                     "memory/disk")
    try:
        cache = TQGPUCache(identity, CacheConfig(num_device_blocks=16,
                                                 num_host_blocks=num_blocks + changed,
                                                 device="cpu"))
        ids = _fill(cache, num_blocks, first_serial=0)
        total = num_blocks * per_block
        store = MeteredStore(LocalStore(f"file://{work / 'shadow'}"))
        key = None if getattr(args, "unsigned", False) else secrets.token_bytes(32)
        shadow = CacheShadow(cache, store, "bench",
                             config=ShadowConfig(autostart=False, auth_key=key))
        full = shadow.shadow_now()
        raw_path = work / "raw.bin"
        raw_write_s = _raw_write(raw_path, total)

        # incremental: replace `changed` blocks (the oldest) with new ones
        cache.remove_blocks(ids[:changed])
        _fill(cache, changed, first_serial=num_blocks)
        store.reset()
        inc = shadow.shadow_now()
        inc_bytes = store.bytes_written
        shadow.close()
        del cache, shadow
        gc.collect()

        # reads alternate in ABBA order (raw, shadow, shadow, raw, raw, ...): a virtual
        # disk's throughput drifts by tens of percent within a minute, and the file
        # written last (the raw one) reads up to 2x faster once, from the host's cache
        target = TQGPUCache(identity, CacheConfig(num_device_blocks=16,
                                                  num_host_blocks=num_blocks, device="cpu"))
        raw_reads: list[float] = []
        recoveries: list[float] = []
        dropped = True
        for i in range(args.repeats):
            for what in (("raw", "shadow") if i % 2 == 0 else ("shadow", "raw")):
                dropped &= _drop_cache([p for p in work.rglob("*") if p.is_file()])
                if what == "raw":
                    raw_reads.append(_raw_read(raw_path))
                    continue
                report = recover_session(store, "bench", target, key=key or b"")
                if report.blocks != num_blocks or report.skipped:
                    raise RuntimeError(f"recovery restored {report.blocks} of {num_blocks} "
                                       f"blocks, skipped {len(report.skipped)}")
                recoveries.append(report.seconds)
                target.remove_blocks([b for b in report.block_ids["bench"] if b is not None])
        raw_path.unlink()
        raw_read_s, recover_s = statistics.median(raw_reads), statistics.median(recoveries)
        if not dropped:
            notes.append("posix_fadvise unavailable: reads may come from the page cache")
        else:
            notes.append("page cache dropped per file with posix_fadvise(DONTNEED) before reads")
        notes.append("recovery reads page-aligned ranges with O_DIRECT (StoreConfig.direct_io); "
                     "the plain read is an ordinary buffered read")
        gb = 1e9
        result: dict[str, Any] = {
            "integrity": ("unsigned (CRC-32 per block)" if key is None else
                          "Poly1305 per block (one-time key: HMAC-SHA256 of key, binding "
                          "and nonce; key set) + signed manifest"),
            "mac_gbps": _mac_gbps(),
            "blocks": num_blocks,
            "requested_blocks": requested,
            "bytes": total,
            "bytes_per_block": per_block,
            "write_gbps": total / full.seconds / gb,
            "read_gbps": total / recover_s / gb,
            "raw_write_gbps": total / raw_write_s / gb,
            "raw_read_gbps": total / raw_read_s / gb,
            "write_ratio": raw_write_s / full.seconds,
            "read_ratio": raw_read_s / recover_s,
            "read_ratio_per_pair": [r / s for r, s in zip(raw_reads, recoveries, strict=True)],
            "read_repeats": args.repeats,
            "incremental_blocks": inc.blocks_written,
            "incremental_bytes": inc_bytes,
            "incremental_bytes_fraction": inc_bytes / total,
            "shadow_seconds": full.seconds,
            "recover_seconds": recover_s,
            "recover_seconds_each": recoveries,
            "raw_read_seconds_each": raw_reads,
            "notes": "; ".join(notes),
            "machine": machine_info(),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [(k, v) for k, v in result.items() if k != "machine"]
    print_table(f"shadow: {num_blocks:,} Llama-3-8B-shaped blocks ({total / 1e9:.2f} GB) "
                f"in {work.parent}", rows)
    return result
