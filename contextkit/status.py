"""``contextkit status``: what the shadow store holds — sessions, tiers, pins, layers.

A running process's cache lives in its memory; what outlives it is the shadow. The
status command reads every session's manifest from the store (local directory or
S3) and reports its blocks by tier at shadow time, pinned blocks, blocks per source
layer and tenant, bytes, cache identity and age. Sessions whose manifest cannot be
read are listed with the reason. With ``--tier-status PATH`` it also shows the last
cycle of a tier manager, from the file that ``ContextTierManager.write_status`` writes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["add_status_arguments", "run_status"]


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", default=None, metavar="URL",
                        help="shadow store: file:///path or s3://bucket/prefix (default: "
                             "$CONTEXTKIT_SHADOW_URL or file://~/.cache/contextkit/shadow)")
    parser.add_argument("--endpoint-url", default=None, metavar="URL",
                        help="S3-compatible endpoint (MinIO, Ceph, moto); default: boto3's")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object as the last line of stdout")
    parser.add_argument("--tier-status", default=None, metavar="PATH",
                        help="also show the last tier-manager cycle from this file "
                             "(written by ContextTierManager.write_status)")


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def run_status(args: argparse.Namespace) -> dict[str, Any]:
    """Collect and print the store's sessions; returns the JSON-able summary."""
    from gpu_cache import CacheIdentityError
    from shadow import ShadowError, discover_sessions, load_manifest, open_store
    from shadow.cli import default_store_url
    from shadow.stores import StoreConfig

    url = args.store or default_store_url()
    store = open_store(url, StoreConfig(endpoint_url=getattr(args, "endpoint_url", None)))
    sessions: list[dict[str, Any]] = []
    now = time.time()
    try:
        for info in discover_sessions(store):
            entry: dict[str, Any] = {"session_id": info.session_id, "error": info.error}
            if info.error is None:
                try:
                    m = load_manifest(store, info.session_id)
                except (ShadowError, CacheIdentityError) as exc:
                    entry["error"] = str(exc)
                else:
                    entry.update({
                        "generation": m.generation,
                        "blocks": len(m.blocks),
                        "pinned_blocks": sum(1 for b in m.blocks if b.pinned),
                        "tokens": sum(b.num_tokens for b in m.blocks),
                        "bytes": m.num_bytes,
                        "stored_bytes": m.stored_bytes,
                        "by_layer": dict(Counter(b.source_layer for b in m.blocks)
                                         .most_common()),
                        "tenants": dict(Counter(b.tenant for b in m.blocks).most_common()),
                        "model": m.identity.model_id,
                        "codec": m.identity.codec,
                        "identity": m.identity.digest().hex()[:12],
                        "updated_at": m.updated_at,
                        "age_s": max(0.0, now - m.updated_at),
                    })
            sessions.append(entry)
    finally:
        store.close()
    out = sys.stdout
    out.write(f"shadow store {store.url}: {len(sessions)} session(s)\n")
    for s in sessions:
        if s.get("error"):
            out.write(f"\n  {s['session_id']}: unreadable - {s['error']}\n")
            continue
        layers = ", ".join(f"{k} {v}" for k, v in s["by_layer"].items())
        tenants = ", ".join(f"{k} {v}" for k, v in s["tenants"].items())
        out.write(
            f"\n  {s['session_id']}  (generation {s['generation']}, {_age(s['age_s'])})\n"
            f"    model      {s['model']} [{s['codec']}], identity {s['identity']}\n"
            f"    blocks     {s['blocks']:,} ({s['tokens']:,} tokens, "
            f"{s['bytes'] / 1e6:,.1f} MB; {s['stored_bytes'] / 1e6:,.1f} MB on disk)\n"
            f"    pinned     {s['pinned_blocks']:,} (restored to the device tier on recovery)\n"
            f"    layers     {layers}\n"
            f"    tenants    {tenants}\n")
    if not sessions:
        out.write("  nothing shadowed yet; run `contextkit demo` or attach a CacheShadow\n")
    result: dict[str, Any] = {"store": store.url, "sessions": sessions}
    tier_path = getattr(args, "tier_status", None)
    if tier_path is not None and Path(tier_path).exists():
        result["tier_manager"] = _tier_status(Path(tier_path), now)
    out.flush()
    return result


def _tier_status(path: Path, now: float) -> dict[str, Any]:
    """Print and return the last cycle recorded in a tier-manager status file."""
    out = sys.stdout
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        out.write(f"\ntier manager {path}: unreadable - {exc}\n")
        return {"path": str(path), "error": str(exc)}
    cycles = doc.get("cycles") or []
    last = cycles[-1] if cycles else None
    summary: dict[str, Any] = {
        "path": str(path),
        "written_at": doc.get("written_at"),
        "thresholds": doc.get("thresholds"),
        "items_by_tier": doc.get("items_by_tier"),
        "num_errors": doc.get("num_errors", 0),
        "last_cycle": last,
    }
    written = doc.get("written_at")
    age = f", written {_age(max(0.0, now - written))}" if isinstance(written, float) else ""
    out.write(f"\ntier manager {path}{age}\n")
    if last is None:
        out.write("  no cycle recorded yet\n")
        return summary
    th = last.get("thresholds_after", {})
    out.write(
        f"  cycle      {last['cycle']} ({last['duration_s'] * 1e3:.1f} ms), "
        f"{last['num_items']:,} items {last['items_by_tier']}\n"
        f"  actions    {last['actions'] or 'none'}; blocks {last['blocks_moved']}, "
        f"{last['bytes_moved'] / 1e6:,.1f} MB moved; skipped {last['blocks_skipped'] or 'none'}\n"
        f"  thresholds promote {th.get('promote')}, demote {th.get('demote')}, "
        f"archive {th.get('archive')}"
        f"{'; ' + last['threshold_reason'] if last.get('threshold_reason') else ''}\n")
    return summary
