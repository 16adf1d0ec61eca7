"""Worker process of the crash test: a restarted service that shadows in a loop.

Generation ``g`` of the session holds exactly the blocks ``live_serials(g)``, whose
bytes and keys depend only on their serial number, so the parent can check that a
recovered snapshot is one complete generation. Manifests are signed (``KEY``).

Modes: ``incremental`` writes each generation's new blocks as a new segment
(compacting now and then); ``full`` compacts on any garbage, so every generation after
the first rewrites all its blocks into one fresh segment.
"""

from __future__ import annotations

import os

from shadow_testkit import KEY, MEDIUM, add_blocks, make_cache

from shadow import (
    BlobNotFoundError,
    CacheShadow,
    ShadowConfig,
    StoreConfig,
    load_manifest,
    open_store,
)

SESSION = "crash"
NEW_PER_GENERATION = 6
WINDOW = 30
COMPACT_AT = {"incremental": 0.4, "full": 1e-9}


def live_serials(generation: int) -> list[int]:
    hi = NEW_PER_GENERATION * generation
    return list(range(max(0, hi - WINDOW), hi))


def run(store_url: str, progress_path: str, endpoint_url: str | None = None,
        mode: str = "incremental", env: dict[str, str] | None = None) -> None:
    os.environ.update(env or {})
    store = open_store(store_url, StoreConfig(endpoint_url=endpoint_url))
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
        while True:
            generation += 1
            want = set(live_serials(generation))
            gone = [s for s in by_serial if s not in want]
            cache.remove_blocks([by_serial.pop(s) for s in gone])
            fresh = sorted(want - set(by_serial))
            by_serial.update(zip(fresh, add_blocks(cache, fresh), strict=True))
            result = shadow.shadow_now()
            assert result.generation == generation
            progress.write(f"committed {generation}\n")
            os.sched_yield()
