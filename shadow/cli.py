"""``contextkit recover``: restore shadowed sessions (the startup job before serving).

The CLI module wires :func:`add_recover_arguments` and :func:`run_recover` into its
``recover`` sub-command. Without a cache, one is built per cache identity found in
the manifests, sized to hold the sessions (a verification run; services pass their
own cache).

Before recovering, the store's debris is swept (:func:`shadow.debris.sweep_debris`:
unreferenced blobs and temp files of sessions without a live writer, incomplete
multipart uploads older than ``--debris-age``); what it cannot delete (a read-only
store) is reported and recovery goes on. Manifests and blocks are checked with the key
in ``$CONTEXTKIT_SHADOW_KEY``; without one, an ``s3://`` store is refused unless
``--allow-unauthenticated`` is given, and the output says ``unauthenticated``. A session
whose manifest is older than the newest generation the store records is refused as a
rollback unless ``--accept-rollback`` is given. A verification cache that would not fit
in memory is refused for its sessions before anything is allocated.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from gpu_cache import CacheConfig, CacheIdentity, CacheIdentityError, TQGPUCache
from gpu_cache.config import NO_PIN_QUOTA
from shadow._errors import ShadowError, ShadowStoreError
from shadow.auth import describe_auth, resolve_key
from shadow.debris import DEFAULT_DEBRIS_AGE_S, DebrisReport, sweep_debris
from shadow.manifest import Manifest
from shadow.recovery import RecoveryReport, discover_sessions, load_manifest, recover_session
from shadow.stores import StoreConfig, open_store

__all__ = ["DEFAULT_STORE_ENV", "add_recover_arguments", "check_store_option",
           "default_store_url", "run_recover"]

DEFAULT_STORE_ENV = "CONTEXTKIT_SHADOW_URL"


def default_store_url() -> str:
    """``$CONTEXTKIT_SHADOW_URL``, else ``file://~/.cache/contextkit/shadow``."""
    env = os.environ.get(DEFAULT_STORE_ENV)
    if env:
        return env
    return f"file://{Path('~/.cache/contextkit/shadow').expanduser()}"


def check_store_option(store: str | None) -> str | None:
    """``--store`` as given; ``None`` means the default store.

    Raises:
        ShadowStoreError: an empty or blank value (never read as "the default").
    """
    if store is not None and not store.strip():
        raise ShadowStoreError("--store is empty; give a store URL (file:///path or "
                               "s3://bucket/prefix), or leave --store out for "
                               f"${DEFAULT_STORE_ENV} or the default store")
    return store


def add_recover_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``contextkit recover``."""
    parser.add_argument("--store", default=None, metavar="URL",
                        help="shadow store: file:///path or s3://bucket/prefix "
                             f"(default: ${DEFAULT_STORE_ENV} or "
                             "file://~/.cache/contextkit/shadow)")
    parser.add_argument("--session", action="append", default=None, metavar="ID",
                        help="session to recover (repeatable; default: every session found)")
    parser.add_argument("--endpoint-url", default=None, metavar="URL",
                        help="S3-compatible endpoint (MinIO, Ceph); default: boto3's")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--allow-unauthenticated", action="store_true",
                        help="recover unsigned sessions from an s3:// store (refused by "
                             "default; set CONTEXTKIT_SHADOW_KEY to sign and check them)")
    parser.add_argument("--debris-age", type=float, default=DEFAULT_DEBRIS_AGE_S,
                        metavar="SECONDS",
                        help="sweep temp files and incomplete S3 uploads older than this "
                             f"(default {DEFAULT_DEBRIS_AGE_S:.0f}); writers holding a live "
                             "lease are never swept")
    parser.add_argument("--no-sweep", action="store_true",
                        help="leave debris (unreferenced blobs, temp files, uploads) alone")
    parser.add_argument("--accept-rollback", action="store_true",
                        help="recover a session whose manifest is older than the newest "
                             "generation the store records (a replayed or restored copy); "
                             "refused by default")


def available_memory(unknown: int = 1 << 62) -> int:
    """Bytes of memory available to a new allocation (``MemAvailable``); ``unknown``
    where the system does not say (default: do not refuse)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return unknown


def _cache_config(manifests: list[Manifest]) -> CacheConfig:
    """Tiers big enough for the sessions' blocks and pins."""
    num_blocks = sum(len(m.blocks) for m in manifests)
    num_pinned = sum(1 for m in manifests for b in m.blocks if b.pinned)
    return CacheConfig(pins=NO_PIN_QUOTA, num_device_blocks=max(16, num_pinned + 16),
                       num_host_blocks=max(16, num_blocks))


def _too_big(identity: CacheIdentity, config: CacheConfig) -> str | None:
    """Why a verification cache of ``config`` would not fit in memory, or ``None``."""
    need = (config.num_device_blocks + config.num_host_blocks) * identity.bytes_per_block
    have = available_memory()
    if need <= 0.8 * have:
        return None
    return (f"recovering it needs a verification cache of {need / 1e9:,.1f} GB, more than "
            f"the {have / 1e9:,.1f} GB of memory available; recover fewer sessions at a time "
            "(--session ID), or recover into the serving process's cache")


def run_recover(args: argparse.Namespace, cache: TQGPUCache | None = None) -> dict[str, Any]:
    """Recover sessions, show a progress bar and print a summary.

    Args:
        args: parsed :func:`add_recover_arguments` options.
        cache: the cache to recover into; ``None`` builds one per identity.

    Returns:
        The JSON-able summary: sessions, blocks, bytes, skipped, seconds, plus
        per-session errors and skipped blocks.
    """
    try:
        from tqdm import tqdm
    except ImportError:
        raise ShadowError("contextkit recover needs tqdm: "
                          "pip install 'contextkit[shadow]'") from None

    start = time.perf_counter()
    url = check_store_option(args.store) or default_store_url()
    key = resolve_key() or b""  # b"": decided here, no second look at the environment
    allow = bool(getattr(args, "allow_unauthenticated", False))
    accept_rollback = bool(getattr(args, "accept_rollback", False))
    store = open_store(url, StoreConfig(endpoint_url=getattr(args, "endpoint_url", None)),
                       create=False)
    report = RecoveryReport()
    debris = DebrisReport()
    try:
        if not getattr(args, "no_sweep", False):
            debris = sweep_debris(store, key=key,
                                  older_than_seconds=getattr(args, "debris_age",
                                                             DEFAULT_DEBRIS_AGE_S))
        wanted = args.session or [s.session_id for s in discover_sessions(store, key=key)]
        manifests: dict[str, Manifest] = {}
        for sid in wanted:
            try:
                manifests[sid] = load_manifest(store, sid, key=key,
                                               accept_rollback=accept_rollback)
            except (ShadowError, CacheIdentityError) as exc:
                report.errors[sid] = str(exc)
        caches: dict[CacheIdentity, TQGPUCache] = {}
        if cache is None:
            groups: dict[CacheIdentity, list[Manifest]] = {}
            for m in manifests.values():
                groups.setdefault(m.identity, []).append(m)
            for ident, ms in groups.items():
                config = _cache_config(ms)
                why = _too_big(ident, config)
                if why is None:
                    caches[ident] = TQGPUCache(ident, config,
                                               key_offsets=ms[0].key_offsets_tensor())
                    continue
                for m in ms:  # nothing was allocated for them
                    report.errors[m.session_id] = why
                    del manifests[m.session_id]
        total_blocks = sum(len(m.blocks) for m in manifests.values())
        with tqdm(total=total_blocks, unit="blk", desc="recover", file=sys.stderr,
                  disable=getattr(args, "no_progress", False)) as bar:
            for sid, m in manifests.items():
                target = cache if cache is not None else caches[m.identity]
                try:
                    report.merge(recover_session(store, sid, target, progress=bar.update,
                                                 key=key, allow_unauthenticated=allow,
                                                 accept_rollback=accept_rollback))
                except (ShadowError, CacheIdentityError) as exc:
                    report.errors[sid] = str(exc)
    finally:
        store.close()
    report.seconds = time.perf_counter() - start
    summary = report.to_dict()
    auth = describe_auth(key or None)
    summary.update(store=store.url, authenticated=bool(key), auth=auth,
                   debris=debris.to_dict())
    out = sys.stdout
    out.write(f"recovered {summary['sessions']} session(s) from {store.url}: "
              f"{summary['blocks']} blocks, {summary['bytes'] / 1e6:,.1f} MB, "
              f"{summary['skipped']} skipped, {summary['seconds']:.2f} s\n"
              f"  manifests: {auth}\n")
    if debris.deleted or debris.aborted_uploads:
        out.write(f"  swept {len(debris.deleted)} stale blobs/temp files and aborted "
                  f"{len(debris.aborted_uploads)} incomplete uploads\n")
    if debris.not_deleted:
        first = next(iter(debris.not_deleted.values()))
        out.write(f"  could not delete {len(debris.not_deleted)} stale object(s) ({first}); "
                  "recovery went on - make the store writable to clean up, or pass "
                  "--no-sweep to skip the sweep\n")
    for sid, why in report.rollbacks.items():
        out.write(f"  {sid}: ACCEPTED ROLLBACK - {why.split(';')[0]}\n")
    for sid, why in report.errors.items():
        out.write(f"  {sid}: {why}\n")
    out.flush()
    return summary
