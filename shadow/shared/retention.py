"""Retention of the shared tier: expiry and a byte budget per tenant, by meaning.

:func:`collect` is the tier's only listing (lookups never list). It:

1. reads the writers' leases (``<model>/leases/<writer>``): the chunks each live
   writer holds in its DDR tier. A leased chunk is never deleted while its lease
   runs; expired leases are deleted.
2. deletes every unleased chunk older than the tier's expiry: ``max_age_s``, or
   ``pinned_max_age_s`` for a chunk holding a block of a pinned layer;
3. per tenant over ``tenant_budget_bytes``, deletes unleased chunks until the tenant
   fits, least valuable first: unpinned before pinned, then lower mean importance,
   then older. One tenant's volume never deletes another tenant's chunks.

Run it from one place at a time (any replica's connector on a timer, or
``contextkit shared gc``); two collectors at once only delete twice.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from shadow._errors import BlobNotFoundError, ShadowStoreError
from shadow._store_base import ShadowStore
from shadow.shared.objects import MAGIC, SharedObjectError, header_bytes_needed, read_header
from shadow.shared.tier import SharedTier, SharedTierConfig

__all__ = ["CollectReport", "collect", "collect_model", "collect_store"]

logger = logging.getLogger(__name__)
_HEAD_READ = 64 * 1024


@dataclass
class CollectReport:
    """What one collection found and deleted."""

    objects: int = 0
    bytes: int = 0
    leased: int = 0
    expired: int = 0
    over_budget: int = 0
    unreadable: int = 0
    leases_expired: int = 0
    bytes_deleted: int = 0
    tenants: dict[str, int] = field(default_factory=dict)  # tenant tag -> bytes kept

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass(slots=True)
class _Object:
    path: str
    size: int
    written_at: float
    pinned: bool
    importance: float


def _live_leases(store: ShadowStore, prefix: str, now: float, report: CollectReport
                 ) -> set[str]:
    live: set[str] = set()
    for key in store.list(prefix):
        try:
            doc = json.loads(store.get(key))
            expires, chunks = float(doc["expires_at"]), [str(c) for c in doc["chunks"]]
        except BlobNotFoundError:
            continue
        except (ValueError, KeyError, TypeError):
            logger.warning("shared tier lease %s is unreadable; deleting it", key)
            store.delete(key)
            continue
        if expires < now:
            store.delete(key)
            report.leases_expired += 1
            continue
        live.update(chunks)
    return live


def _read(store: ShadowStore, path: str, size: int) -> _Object | None:
    buf = bytearray(min(size, _HEAD_READ))
    n = store.read_into(path, 0, memoryview(buf))
    head = bytes(buf[:n])
    if head[:len(MAGIC)] != MAGIC:
        return None
    need = header_bytes_needed(head)
    if need > len(head):
        more = bytearray(need)
        store.read_into(path, 0, memoryview(more))
        head = bytes(more)
    doc = read_header(head)
    blocks = doc.get("blocks") or []
    importance = (sum(float(b.get("importance", 0.5)) for b in blocks) / len(blocks)
                  if blocks else 0.0)
    return _Object(path, size, float(doc.get("written_at", 0.0)),
                   any(bool(b.get("pinned")) for b in blocks), importance)


def collect(tier: SharedTier, now: float | None = None) -> CollectReport:
    """Apply the tier's expiry and per-tenant budget to its model's objects (see the
    module's docstring)."""
    return collect_model(tier.store, tier.tenants_prefix.split("/", 1)[0], tier.config, now)


def collect_store(store: ShadowStore, config: SharedTierConfig, now: float | None = None
                  ) -> dict[str, CollectReport]:
    """:func:`collect_model` for every model in the store (one listing to find them;
    ``contextkit shared gc``). Returns each model tag's report."""
    models = sorted({key.split("/", 1)[0] for key in store.list()
                     if key.count("/") >= 2 and key.split("/")[1] in ("t", "leases")})
    return {model: collect_model(store, model, config, now) for model in models}


def collect_model(store: ShadowStore, model: str, config: SharedTierConfig,
                  now: float | None = None) -> CollectReport:
    """Apply ``config``'s expiry and per-tenant budget to the objects of the model
    whose name prefix is ``model`` (:func:`~shadow.shared.objects.model_tag`).

    Objects that are not readable shared-tier objects are deleted as expired: no
    reader would serve them. Store errors end the collection (logged); what was
    deleted stays deleted.
    """
    now = time.time() if now is None else now
    report = CollectReport()
    tenants_prefix = f"{model}/t/"
    try:
        live = _live_leases(store, f"{model}/leases/", now, report)
        by_tenant: dict[str, list[_Object]] = {}
        for path, size in store.list_sizes(tenants_prefix):
            report.objects += 1
            report.bytes += size
            try:
                obj = _read(store, path, size)
            except (BlobNotFoundError, SharedObjectError):
                obj = None
            if obj is None:
                report.unreadable += 1
                store.delete(path)
                report.bytes_deleted += size
                continue
            if path in live:
                report.leased += 1
            else:
                max_age = config.pinned_max_age_s if obj.pinned else config.max_age_s
                if now - obj.written_at > max_age:
                    store.delete(path)
                    report.expired += 1
                    report.bytes_deleted += size
                    continue
            tenant = path[len(tenants_prefix):].split("/", 1)[0]
            by_tenant.setdefault(tenant, []).append(obj)
        for tenant, objs in by_tenant.items():
            held = sum(o.size for o in objs)
            victims = sorted((o for o in objs if o.path not in live),
                             key=lambda o: (o.pinned, o.importance, o.written_at))
            for obj in victims:
                if held <= config.tenant_budget_bytes:
                    break
                store.delete(obj.path)
                held -= obj.size
                report.over_budget += 1
                report.bytes_deleted += obj.size
            report.tenants[tenant] = held
    except ShadowStoreError as exc:
        logger.error("shared tier collection stopped: %s", exc)
    return report
