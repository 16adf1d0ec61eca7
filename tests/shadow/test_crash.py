"""Crash safety: SIGKILL a shadowing process at random points, then sweep and recover.

Every kill is followed by a debris sweep (the dead writer's lease is stale at once: same
host, process gone) and a recovery with the MAC key; a recovery is *corrupt* when it is
not exactly one complete generation (wrong blocks, wrong bytes, skips or errors).
Between kills the workers' manifest writes fail now and then, half of them after landing
(lost acknowledgements, see :mod:`crash_worker`).
``make test`` runs one short local loop; ``make test-heavy`` runs 160 kills across full
and incremental shadows on a local directory and on S3 (moto's server over HTTP).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import crash_worker
import pytest
import torch
from shadow_testkit import BUCKET, KEY, MEDIUM, block_tensors, make_cache

from gpu_cache import TENSOR_NAMES
from shadow import (
    BlobNotFoundError,
    StoreConfig,
    discover_sessions,
    load_manifest,
    open_store,
    recover_session,
)
from shadow.debris import sweep_debris

NUM_KILLS = 25
HEAVY_KILLS = 40  # per (store, mode): 160 in all


def _generations(progress: Path, *kinds: str) -> int:
    """Highest generation a worker reported as one of ``kinds`` ("ready g": g committed)."""
    if not progress.exists():
        return 0
    values = [int(line.split()[1]) for line in progress.read_text().splitlines()
              if line.startswith(tuple(f"{k} " for k in kinds))
              and line.endswith(tuple("0123456789"))]
    return max(values, default=0)


def _count(progress: Path, kind: str) -> int:
    return sum(line.startswith(f"{kind} ") for line in progress.read_text().splitlines())


def _wait_ready(progress: Path, count: int, proc, deadline: float) -> None:
    while time.monotonic() < deadline:
        lines = progress.read_text().splitlines() if progress.exists() else []
        if sum(line.startswith("ready") for line in lines) >= count:
            return
        if not proc.is_alive():
            pytest.fail(f"worker died on its own with exit code {proc.exitcode}; see stderr")
        time.sleep(0.005)
    pytest.fail("worker did not start in time")


def _recovered_is_one_generation(store, generation: int) -> str | None:
    """``None`` if the session recovers as exactly ``generation``; else what is wrong."""
    cache = make_cache(MEDIUM, device_blocks=8, host_blocks=4 * crash_worker.WINDOW)
    report = recover_session(store, crash_worker.SESSION, cache, key=KEY)
    if report.skipped or report.errors:
        return f"skipped {report.num_skipped}, errors {report.errors}"
    serials = crash_worker.live_serials(generation)
    if report.blocks != len(serials):
        return f"{report.blocks} blocks, want {len(serials)}"
    want = block_tensors(MEDIUM, serials)
    got = cache.export_blocks(report.block_ids[crash_worker.SESSION])
    bad = [n for n in TENSOR_NAMES if not torch.equal(got[n], want[n])]
    return f"bytes differ in {bad}" if bad else None


def _kill_loop(tmp_path, monkeypatch, store_url: str, kills: int, *, mode: str,
               endpoint_url: str | None = None) -> dict[str, Any]:
    # Children fork from a server that already imported torch and the worker: no 3-5 s
    # start-up per kill. The server finds the worker through PYTHONPATH (Python 3.11's
    # forkserver ignores the parent's sys.path when preloading).
    here = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (here, os.environ.get("PYTHONPATH", "")) if p))
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["crash_worker"])
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    progress = tmp_path / f"progress-{mode}.txt"
    rng = random.Random(1234)
    config = StoreConfig(endpoint_url=endpoint_url)
    seen_generations, corrupt, recoveries, swept = set(), [], 0, 0
    start = time.monotonic()
    for kill in range(kills):
        proc = ctx.Process(target=crash_worker.run,
                           args=(store_url, str(progress), endpoint_url, mode, env, kill))
        proc.start()
        _wait_ready(progress, kill + 1, proc, time.monotonic() + 60)
        time.sleep(rng.uniform(0.0, 0.25))
        proc.kill()  # SIGKILL: no cleanup, no atexit, no finally
        proc.join()
        assert proc.exitcode == -9

        committed = _generations(progress, "committed", "ready")
        attempted = _generations(progress, "attempt")
        store = open_store(store_url, config)
        try:
            generation = load_manifest(store, crash_worker.SESSION, key=KEY).generation
        except BlobNotFoundError:
            generation = 0
        # the manifest is the last complete shadow: the one reported, or one whose report
        # the kill cut off (never one that failed before reaching the store)
        assert committed <= generation <= max(committed, attempted)
        seen_generations.add(generation)
        debris = sweep_debris(store, key=KEY, older_than_seconds=0)
        assert not debris.live_sessions, "a SIGKILLed writer's lease must be dead at once"
        swept += len(debris.deleted) + len(debris.aborted_uploads)
        if generation == 0:
            continue
        recoveries += 1
        why = _recovered_is_one_generation(store, generation)
        if why is not None:
            corrupt.append((kill, generation, why))
        assert [i.session_id for i in discover_sessions(store, key=KEY)] == [crash_worker.SESSION]
        store.close()
    stats = {"store": store_url.split(":")[0], "mode": mode, "kills": kills,
             "recoveries": recoveries, "corrupt": len(corrupt), "swept": swept,
             "lost_acks": _count(progress, "lost-ack"), "failed_writes": _count(progress, "failed"),
             "generations": len(seen_generations),
             "seconds": round(time.monotonic() - start, 1)}
    sys.stdout.write(f"\ncrash loop: {stats}\n")
    assert not corrupt, corrupt
    assert len(seen_generations) > kills // 2, "kills did not land on distinct shadows"
    assert stats["lost_acks"] and stats["failed_writes"], "no fault was injected"
    return stats


def test_sigkill_at_random_points_never_exposes_a_partial_shadow(tmp_path, monkeypatch):
    stats = _kill_loop(tmp_path, monkeypatch, f"file://{tmp_path / 'store'}", NUM_KILLS,
                       mode="incremental")
    assert stats["recoveries"] >= NUM_KILLS // 2 and stats["corrupt"] == 0, stats


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["incremental", "full"])
def test_sigkill_heavy_local(mode, tmp_path, monkeypatch):
    _kill_loop(tmp_path, monkeypatch, f"file://{tmp_path / 'store'}", HEAVY_KILLS, mode=mode)


@pytest.mark.heavy
@pytest.mark.parametrize("mode", ["incremental", "full"])
def test_sigkill_heavy_s3(mode, s3_endpoint, tmp_path, monkeypatch):
    url = f"s3://{BUCKET}/crash-{mode}-{tmp_path.name}"
    _kill_loop(tmp_path, monkeypatch, url, HEAVY_KILLS, mode=mode, endpoint_url=s3_endpoint)
