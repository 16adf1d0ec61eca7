"""``contextkit status``: what the shadow store holds — sessions, tiers, pins, layers.

A running process's cache lives in its memory; what outlives it is the shadow. The
status command reads every session's manifest from the store (local directory or
S3) and reports its blocks by tier at shadow time, pinned blocks, blocks per source
layer and tenant, bytes, cache identity and age, and whether manifests are
authenticated (``$CONTEXTKIT_SHADOW_KEY``). Sessions whose manifest cannot be read are
listed with the reason. With ``--tier-status PATH`` it also shows the last cycle of a
tier manager, from the file that ``ContextTierManager.write_status`` writes, and with
``--metrics URL`` the contextkit figures of a running process's Prometheus page (a vLLM
server's ``/metrics``, or a process with ``[metrics] port`` set).

A store the user named (``--store`` or ``$CONTEXTKIT_SHADOW_URL``) that is a local
directory which does not exist is an error, not an empty store: a typo must not read
as "nothing shadowed". The default store missing just means nothing was shadowed yet.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

__all__ = ["TierStatusError", "add_status_arguments", "local_store_path", "require_store",
           "run_status"]

#: Fields of a tier-manager cycle that status prints.
_CYCLE_FIELDS = ("cycle", "duration_s", "num_items", "items_by_tier", "actions",
                 "blocks_moved", "bytes_moved", "blocks_skipped")


class TierStatusError(ValueError):
    """A ``--tier-status`` file that is missing or not what ``write_status`` writes."""


def local_store_path(url: str) -> Path | None:
    """The directory of a ``file://`` URL or plain path; ``None`` for other stores."""
    parsed = urlparse(url)
    if parsed.scheme not in ("", "file") or parsed.netloc not in ("", "localhost"):
        return None  # S3, or a file URL the store itself refuses with its own message
    return Path(unquote(parsed.path) if parsed.scheme else url).expanduser()


def require_store(store_arg: str | None) -> bool:
    """Refuse a named local store directory that does not exist.

    Args:
        store_arg: the ``--store`` option (``None``: ``$CONTEXTKIT_SHADOW_URL`` if set,
            else the default store, which may legitimately not exist yet).

    Returns:
        Whether the user named the store (option or environment).

    Raises:
        ShadowStoreError: an empty ``--store``, or the named ``file://`` store (or plain
            path) is not an existing directory; the message names the path and the
            option to check.
    """
    from shadow import ShadowStoreError
    from shadow.cli import DEFAULT_STORE_ENV, check_store_option

    named = check_store_option(store_arg)
    if named:
        url, named_by = named, "--store"
    elif os.environ.get(DEFAULT_STORE_ENV):
        url, named_by = os.environ[DEFAULT_STORE_ENV], f"${DEFAULT_STORE_ENV}"
    else:
        return False
    path = local_store_path(url)
    if path is None:
        return True
    if not path.exists():
        raise ShadowStoreError(f"no shadow store at {path}; check {named_by} (a directory "
                               "written by `contextkit demo` or a CacheShadow)")
    if not path.is_dir():
        raise ShadowStoreError(f"shadow store {path} is not a directory; check {named_by}")
    return True


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", default=None, metavar="URL",
                        help="shadow store: file:///path or s3://bucket/prefix (default: "
                             "$CONTEXTKIT_SHADOW_URL or file://~/.cache/contextkit/shadow)")
    parser.add_argument("--endpoint-url", default=None, metavar="URL",
                        help="S3-compatible endpoint (MinIO, Ceph, moto); default: boto3's")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object as the last line of stdout")
    parser.add_argument("--tenant", default=None, metavar="NAME",
                        help="show only this tenant's blocks, pins and layers (default: "
                             "every tenant's)")
    parser.add_argument("--tier-status", default=None, metavar="PATH",
                        help="also show the last tier-manager cycle from this file "
                             "(written by ContextTierManager.write_status)")
    parser.add_argument("--metrics", default=None, metavar="URL",
                        help="also show the contextkit figures of a running process from its "
                             "Prometheus page: a vLLM server's http://HOST:PORT/metrics "
                             "(connector) or one started with [metrics] port (pipeline, "
                             "engine)")


def _signature(authenticated: bool) -> str:
    if authenticated:
        return "signed, MAC checked (each block's MAC is checked on recovery)"
    return "unsigned (edits to it or its blocks would be recovered as they are)"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def run_status(args: argparse.Namespace) -> dict[str, Any]:
    """Collect and print the store's sessions; returns the JSON-able summary.

    Raises:
        ShadowStoreError: a named store directory that does not exist.
        TierStatusError: ``--tier-status`` names a missing or malformed file.
        MetricsScrapeError: ``--metrics`` names a page that cannot be read.
    """
    from contextkit.cli.scrape import format_metrics, scrape_metrics
    from gpu_cache.ids import validate_tenant
    from shadow.auth import KEY_ENV, describe_auth, resolve_key
    from shadow.cli import default_store_url

    now = time.time()
    # Inputs are checked before anything is printed: an error is the only output.
    tenant = getattr(args, "tenant", None)
    if tenant is not None:
        validate_tenant(tenant)
    tier_path = getattr(args, "tier_status", None)
    tier_doc = _read_tier_status(Path(tier_path)) if tier_path is not None else None
    metrics_url = getattr(args, "metrics", None)
    metrics_doc = scrape_metrics(metrics_url) if metrics_url is not None else None
    named = require_store(args.store)
    url = args.store or default_store_url()
    local = local_store_path(url)
    sessions: list[dict[str, Any]]
    if not named and local is not None and not local.is_dir():
        store_url, sessions = f"file://{local}", []  # the default store: nothing shadowed yet
    else:
        store_url, sessions = _read_sessions(url, getattr(args, "endpoint_url", None), now,
                                             tenant)
    key = resolve_key()
    auth = {"authenticated": key is not None, "description": describe_auth(key),
            "key_source": KEY_ENV if key is not None else None}
    out = sys.stdout
    whose = f"tenant {tenant}" if tenant is not None else "all tenants"
    out.write(f"shadow store {store_url}: {len(sessions)} session(s), {whose}\n")
    out.write(f"manifest auth: {auth['description']}"
              f"{f'; key from ${KEY_ENV}' if key is not None else ''}\n")
    for s in sessions:
        if s.get("error"):
            out.write(f"\n  {s['session_id']}: unreadable - {s['error']}\n")
            continue
        layers = ", ".join(f"{k} {v}" for k, v in s["by_layer"].items())
        tenants = ", ".join(f"{k} {v}" for k, v in s["tenants"].items())
        disk = (f"; {s['stored_bytes'] / 1e6:,.1f} MB on disk"
                if s["stored_bytes"] is not None else "")
        out.write(
            f"\n  {s['session_id']}  (generation {s['generation']}, {_age(s['age_s'])})\n"
            f"    model      {s['model']} [{s['codec']}], identity {s['identity']}\n"
            f"    manifest   {_signature(s['authenticated'])}\n"
            f"    blocks     {s['blocks']:,} ({s['tokens']:,} tokens, "
            f"{s['bytes'] / 1e6:,.1f} MB{disk})\n"
            f"    pinned     {s['pinned_blocks']:,} (restored to the device tier on recovery)\n"
            f"    layers     {layers}\n"
            f"    tenants    {tenants}\n")
    if not sessions:
        out.write("  nothing shadowed yet; run `contextkit demo` or attach a CacheShadow\n")
    result: dict[str, Any] = {"store": store_url, "tenant": tenant, "auth": auth,
                              "sessions": sessions}
    if metrics_doc is not None:
        out.write(format_metrics(metrics_doc))
        result["metrics"] = metrics_doc
    if tier_doc is not None:
        result["tier_manager"] = _tier_status(Path(str(tier_path)), tier_doc, now)
    out.flush()
    return result


def _read_sessions(url: str, endpoint_url: str | None, now: float,
                   tenant: str | None = None) -> tuple[str, list[dict[str, Any]]]:
    """The store's URL and one summary per session (``error`` set when unreadable).

    With ``tenant``, only that tenant's blocks are counted and sessions holding none
    of them are left out (unreadable sessions are still listed).
    """
    from gpu_cache import CacheIdentityError
    from shadow import ShadowError, discover_sessions, load_manifest, open_store
    from shadow.stores import StoreConfig

    store = open_store(url, StoreConfig(endpoint_url=endpoint_url), create=False)
    sessions: list[dict[str, Any]] = []
    try:
        for info in discover_sessions(store):
            entry: dict[str, Any] = {"session_id": info.session_id, "error": info.error}
            if info.error is None:
                try:
                    m = load_manifest(store, info.session_id)
                except (ShadowError, CacheIdentityError) as exc:
                    entry["error"] = str(exc)
                else:
                    blocks = [b for b in m.blocks if tenant is None or b.tenant == tenant]
                    if not blocks and tenant is not None:
                        continue
                    entry.update({
                        "generation": m.generation,
                        "blocks": len(blocks),
                        "pinned_blocks": sum(1 for b in blocks if b.pinned),
                        "tokens": sum(b.num_tokens for b in blocks),
                        "bytes": len(blocks) * m.bytes_per_block,
                        # the session's files are shared by its tenants: whole only
                        "stored_bytes": m.stored_bytes if tenant is None else None,
                        "by_layer": dict(Counter(b.source_layer for b in blocks)
                                         .most_common()),
                        "tenants": dict(Counter(b.tenant for b in blocks).most_common()),
                        "model": m.identity.model_id,
                        "codec": m.identity.codec,
                        "identity": m.identity.digest().hex()[:12],
                        "authenticated": m.authenticated,
                        "updated_at": m.updated_at,
                        "age_s": max(0.0, now - m.updated_at),
                    })
            sessions.append(entry)
    finally:
        store.close()
    return store.url, sessions


def _read_tier_status(path: Path) -> dict[str, Any]:
    """The parsed tier-status file, its shape checked as far as status reads it.

    Raises:
        TierStatusError: missing, unreadable, not JSON, or not a tier-status document.
    """
    rewrite = "check --tier-status (ContextTierManager.write_status writes the file)"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise TierStatusError(f"no tier-status file at {path}; {rewrite}") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise TierStatusError(f"cannot read tier-status file {path} ({reason}); "
                              f"{rewrite}") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise TierStatusError(f"tier-status file {path} is not valid JSON ({exc}); "
                              f"{rewrite}") from None
    if not isinstance(doc, dict):
        raise TierStatusError(f"{path} is not a tier-status file (a JSON "
                              f"{type(doc).__name__}, expected an object); {rewrite}")
    cycles = doc.get("cycles") or []
    if not isinstance(cycles, list):
        raise TierStatusError(f"tier-status file {path}: cycles must be a list, got "
                              f"{type(cycles).__name__}; {rewrite}")
    if cycles:
        last = cycles[-1]
        if not isinstance(last, dict):
            raise TierStatusError(f"tier-status file {path}: the last cycle is a "
                                  f"{type(last).__name__}, expected an object; {rewrite}")
        missing = [f for f in _CYCLE_FIELDS if f not in last]
        if missing:
            raise TierStatusError(f"tier-status file {path}: the last cycle misses "
                                  f"{', '.join(missing)}; {rewrite}")
        numbers = ("cycle", "duration_s", "num_items", "bytes_moved")
        bad = [f for f in numbers if isinstance(last[f], bool)
               or not isinstance(last[f], (int, float))]
        if bad or not isinstance(last.get("thresholds_after", {}), dict):
            raise TierStatusError(f"tier-status file {path}: the last cycle has malformed "
                                  f"{', '.join(bad) or 'thresholds_after'}; {rewrite}")
    return doc


def _tier_status(path: Path, doc: dict[str, Any], now: float) -> dict[str, Any]:
    """Print and return the last cycle recorded in a (checked) tier-status document."""
    out = sys.stdout
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
