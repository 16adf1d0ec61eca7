"""Worker process of the crash test: a restarted service that shadows in a loop.

Generation ``g`` of the session holds exactly the blocks ``live_serials(g)``, whose
bytes and keys depend only on their serial number, so the parent can check that a
recovered snapshot is one complete generation. Manifests are signed (``KEY``).

Modes: ``incremental`` writes each generation's new blocks as a new segment
(compacting now and then); ``full`` compacts on any garbage, so every generation after
the first rewrites all its blocks into one fresh segment.

Between kills, manifest writes fail now and then (seeded, :data:`FAULT_RATE`): half of
them land and report a timeout (a lost acknowledgement: that generation is committed),
half fail before reaching the store (that generation is never used again). The worker
reports ``attempt g`` before each shadow, then ``committed g`` or ``failed g``.
"""

from __future__ import annotations

import os
import random

from shadow_testkit import KEY, MEDIUM, FaultyStore, add_blocks, make_cache

from shadow import (
    BlobNotFoundError,
    CacheShadow,
    ShadowConfig,
    ShadowStoreError,
    StoreConfig,
    load_manifest,
    open_store,
)

SESSION = "crash"
NEW_PER_GENERATION = 6
WINDOW = 30
COMPACT_AT = {"incremental": 0.4, "full": 1e-9}
#: Share of manifest writes that fail (half of them after landing).
FAULT_RATE = 0.2


def live_serials(generation: int) -> list[int]:
    hi = NEW_PER_GENERATION * generation
    return list(range(max(0, hi - WINDOW), hi))


def run(store_url: str, progress_path: str, endpoint_url: str | None = None,
        mode: str = "incremental", env: dict[str, str] | None = None, seed: int = 0) -> None:
    os.environ.update(env or {})
    store = FaultyStore(open_store(store_url, StoreConfig(endpoint_url=endpoint_url)))
    rng = random.Random(seed)
    cache = make_cache(MEDIUM, device_blocks=8, host_blocks=4 * WINDOW)
    try:
        generation = load_manifest(store, SESSION, key=KEY).generation
    except BlobNotFoundError:
        generation = 0
    shadow = CacheShadow(cache, store, SESSION,
                         config=ShadowConfig(autostart=False, auth_key=KEY,
                                             compact_garbage_fraction=COMPACT_AT[mode]))
    by_serial: dict[int, int] = {}
    if generation:
        report = shadow.recover_session()
        assert not report.skipped and report.blocks == len(live_serials(generation))
        by_serial = dict(zip(live_serials(generation), report.block_ids[SESSION], strict=True))
    with open(progress_path, "a", buffering=1) as progress:
        progress.write(f"ready {generation}\n")
        first = generation + 1
        while True:
            generation += 1
            want = set(live_serials(generation))
            gone = [s for s in by_serial if s not in want]
            cache.remove_blocks([by_serial.pop(s) for s in gone])
            fresh = sorted(want - set(by_serial))
            by_serial.update(zip(fresh, add_blocks(cache, fresh), strict=True))
            # the first shadow of every other worker is faulted, so every loop has both kinds
            draw = rng.random() if generation > first or seed % 2 == 0 else \
                (FAULT_RATE / 4 if seed % 4 == 1 else 3 * FAULT_RATE / 4)
            if draw < FAULT_RATE:
                store.faults.append("lost-ack" if draw < FAULT_RATE / 2 else "fail")
            progress.write(f"attempt {generation}\n")
            try:
                result = shadow.shadow_now()
            except ShadowStoreError:
                landed = draw < FAULT_RATE / 2
                progress.write(f"{'lost-ack' if landed else 'failed'} {generation}\n")
                if landed:
                    progress.write(f"committed {generation}\n")
                continue
            assert result.generation == generation
            progress.write(f"committed {generation}\n")
            os.sched_yield()
