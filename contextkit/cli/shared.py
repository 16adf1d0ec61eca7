"""``contextkit shared gc``: collect the live shared tier (expiry, leases, per-tenant
budgets) from anywhere that can reach the store; see docs/shared-tier.md."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from contextkit.config.limits import seconds_arg, size_arg

__all__ = ["add_shared"]


def add_shared(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    shared = sub.add_parser(
        "shared", help="the live shared tier of vLLM replicas (see `contextkit shared -h`)",
        description="Maintain the shared tier the vLLM connector's replicas read and write "
                    "(kv_connector_extra_config shared_url).", parents=parents)
    actions = shared.add_subparsers(dest="shared_action", metavar="ACTION", required=True)
    gc = actions.add_parser(
        "gc", help="delete expired chunks and trim tenants over budget", parents=parents,
        description="For every model in the store: delete chunks no live replica leases "
                    "that are older than --max-age-s (--pinned-max-age-s for chunks holding "
                    "a pinned block), then trim each tenant to --tenant-budget-mb, least "
                    "valuable first (unpinned, low importance, old). Lists the store once. "
                    "Needs the replicas' key in $CONTEXTKIT_SHADOW_KEY: only what it "
                    "authenticates is kept by its header or lease.")
    gc.add_argument("url", help="the shared tier: s3://bucket/prefix or file:///path")
    gc.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint (MinIO, Ceph)")
    gc.add_argument("--max-age-s", type=seconds_arg(), default=24 * 3600.0,
                    help="expiry of unleased chunks (default 86400)")
    gc.add_argument("--pinned-max-age-s", type=seconds_arg(), default=7 * 24 * 3600.0,
                    help="expiry of unleased chunks holding a pinned block (default 604800)")
    gc.add_argument("--tenant-budget-mb", type=size_arg(minimum=1), default=4096,
                    help="bytes each tenant keeps, in MB (default 4096)")
    gc.add_argument("--json", action="store_true",
                    help="print one JSON object as the last line of stdout")
    gc.set_defaults(func=_gc)


def _gc(args: argparse.Namespace) -> int:
    from shadow import StoreConfig, open_store
    from shadow.auth import KEY_STEP, resolve_key
    from shadow.shared.retention import collect_store
    from shadow.shared.tier import SharedTierConfig

    key = resolve_key()
    if key is None:  # without it no header or lease can be trusted (or kept)
        print(f"contextkit shared gc needs the replicas' key: {KEY_STEP} (the same value)",
              file=sys.stderr)
        return 2
    config = SharedTierConfig(url=args.url, endpoint_url=args.endpoint_url,
                              max_age_s=args.max_age_s, pinned_max_age_s=args.pinned_max_age_s,
                              tenant_budget_bytes=args.tenant_budget_mb << 20)
    store = open_store(args.url, StoreConfig(endpoint_url=args.endpoint_url), create=False)
    try:
        reports = collect_store(store, config, mac_key=key)
    finally:
        store.close()
    result = {model: report.as_dict() for model, report in reports.items()}
    for model, r in result.items():
        print(f"{model}: {r['objects']} objects ({r['bytes']} B), kept {r['leased']} leased; "
              f"deleted {r['expired']} expired, {r['over_budget']} over budget, "
              f"{r['unreadable']} unreadable ({r['bytes_deleted']} B); "
              f"{r['leases_expired']} leases expired")
    if not result:
        print(f"no shared-tier objects in {args.url}")
    if args.json:
        sys.stdout.write(json.dumps({"models": result}, sort_keys=True) + "\n")
    return 0
