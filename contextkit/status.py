"""``contextkit status``: what the shadow store holds — sessions, tiers, pins, layers.

A running process's cache lives in its memory; what outlives it is the shadow. The
status command reads every session's manifest from the store (local directory or
S3) and reports its blocks by tier at shadow time, pinned blocks, blocks per source
layer and tenant, bytes, cache identity and age. Sessions whose manifest cannot be
read are listed with the reason.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
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
    out.flush()
    return {"store": store.url, "sessions": sessions}
