"""Crash safety: SIGKILL a shadowing process at random points, then recover."""

from __future__ import annotations

import multiprocessing
import os
import random
import time
from pathlib import Path

import crash_worker
import pytest
import torch
from shadow_testkit import MEDIUM, block_tensors, make_cache

from gpu_cache import TENSOR_NAMES
from shadow import discover_sessions, load_manifest, open_store, recover_session

NUM_KILLS = 25


def _last_known_generation(progress: Path) -> int:
    """Highest generation a worker reported committed ("ready g" means g was committed)."""
    if not progress.exists():
        return 0
    values = [int(line.split()[1]) for line in progress.read_text().splitlines()
              if line.startswith(("committed ", "ready ")) and line.endswith(tuple("0123456789"))]
    return max(values, default=0)


def _wait_ready(progress: Path, count: int, proc, deadline: float) -> None:
    while time.monotonic() < deadline:
        lines = progress.read_text().splitlines() if progress.exists() else []
        if sum(line.startswith("ready") for line in lines) >= count:
            return
        if not proc.is_alive():
            pytest.fail(f"worker died on its own with exit code {proc.exitcode}; see stderr")
        time.sleep(0.005)
    pytest.fail("worker did not start in time")


def test_sigkill_at_random_points_never_exposes_a_partial_shadow(tmp_path, monkeypatch):
    # Children fork from a server that already imported torch and the worker: no 3-5 s
    # start-up per kill. The server finds the worker through PYTHONPATH (Python 3.11's
    # forkserver ignores the parent's sys.path when preloading).
    here = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (here, os.environ.get("PYTHONPATH", "")) if p))
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["crash_worker"])
    store_url = f"file://{tmp_path / 'store'}"
    progress = tmp_path / "progress.txt"
    rng = random.Random(1234)
    seen_generations = set()
    start = time.monotonic()
    for kill in range(NUM_KILLS):
        proc = ctx.Process(target=crash_worker.run, args=(store_url, str(progress)))
        proc.start()
        _wait_ready(progress, kill + 1, proc, time.monotonic() + 60)
        time.sleep(rng.uniform(0.0, 0.25))
        proc.kill()  # SIGKILL: no cleanup, no atexit, no finally
        proc.join()
        assert proc.exitcode == -9

        committed = _last_known_generation(progress)
        store = open_store(store_url)
        try:
            generation = load_manifest(store, crash_worker.SESSION).generation
        except FileNotFoundError:
            generation = 0
        # the manifest is the last complete shadow: the one reported, or one whose report
        # the kill cut off
        assert committed <= generation <= committed + 1
        seen_generations.add(generation)
        if generation == 0:
            continue
        cache = make_cache(MEDIUM, device_blocks=8, host_blocks=4 * crash_worker.WINDOW)
        report = recover_session(store, crash_worker.SESSION, cache)
        assert not report.skipped and not report.errors
        serials = crash_worker.live_serials(generation)
        assert report.blocks == len(serials)
        want = block_tensors(MEDIUM, serials)
        got = cache.export_blocks(report.block_ids[crash_worker.SESSION])
        for name in TENSOR_NAMES:
            assert torch.equal(got[name], want[name]), (kill, generation, name)
        assert [i.session_id for i in discover_sessions(store)] == [crash_worker.SESSION]
    assert len(seen_generations) > NUM_KILLS // 2, "kills did not land on distinct shadows"
    assert time.monotonic() - start < 120
