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

Only what the deployment's key authenticates counts: a lease's MAC, an object's
header MAC (read alone, at most :data:`~shadow.shared.objects.MAX_HEADER_BYTES`),
every header field checked. An object no reader would serve (not an object, a header
it cannot parse, a forged or moved one, a size its header does not describe) is
deleted as unreadable, and the pass goes on; so is a lease that is forged, unreadable
or whose time is not finite or runs further ahead than ``lease_s`` or
``max_age_s``. Should the key
authenticate nothing of a model while something fails its MAC (the collector holds
another deployment's key), nothing is deleted for a failed MAC (logged).

Run it from one place at a time (any replica's connector on a timer, or
``contextkit shared gc``); two collectors at once only delete twice.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from shadow._errors import BlobNotFoundError, ShadowStoreError
from shadow._store_base import ShadowStore
from shadow.shared.objects import (
    MAC_BYTES,
    PREFIX_BYTES,
    SharedObjectError,
    check_span_name,
    model_tag,
    object_bytes,
)
from shadow.shared.tier import (
    SharedTier,
    SharedTierConfig,
    lease_runs,
    read_lease,
    read_signed_header,
)

__all__ = ["CLOCK_SKEW_S", "CollectReport", "collect", "collect_model", "collect_store"]

logger = logging.getLogger(__name__)
_HEAD_READ = 64 * 1024
#: A header written further ahead of the collector's clock than this counts as oldest.
CLOCK_SKEW_S = 300.0


@dataclass
class CollectReport:
    """What one collection found and deleted.

    ``unreadable``: objects no reader would serve (deleted unless ``unverified``);
    ``refused``: the same by reason (corrupt, tampered, replayed, foreign);
    ``leases_refused``: leases forged, unreadable or of a time not to be trusted;
    ``unverified``: things that failed their MAC and were kept, because the key
    authenticated nothing of the model (another deployment's key?)."""

    objects: int = 0
    bytes: int = 0
    leased: int = 0
    expired: int = 0
    over_budget: int = 0
    unreadable: int = 0
    leases_expired: int = 0
    leases_refused: int = 0
    unverified: int = 0
    bytes_deleted: int = 0
    refused: dict[str, int] = field(default_factory=dict)
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


def _read(store: ShadowStore, path: str, size: int, mac_key: bytes, model: str,
          now: float) -> _Object:
    """The retention facts of one object, from its authenticated header only."""
    if size < PREFIX_BYTES + 2 * MAC_BYTES:
        raise SharedObjectError("corrupt", f"{size} bytes, too short")
    n, header = read_signed_header(store, path, mac_key, min(size, _HEAD_READ))
    parts = path.split("/")
    if header.path != path or header.tenant != parts[2]:
        raise SharedObjectError("replayed", f"written as {header.path!r}")
    check_span_name(path, header.span)
    if model_tag(header.identity) != model:
        raise SharedObjectError("foreign", f"written for {header.identity.model_id}")
    if object_bytes(n, header) != size:
        raise SharedObjectError("corrupt", f"{size} bytes, its header describes "
                                f"{object_bytes(n, header)}")
    blocks = header.blocks
    importance = sum(b.importance for b in blocks) / len(blocks) if blocks else 0.0
    written_at = header.written_at if header.written_at <= now + CLOCK_SKEW_S else 0.0
    return _Object(path, size, written_at, any(b.pinned for b in blocks), importance)


def collect(tier: SharedTier, now: float | None = None) -> CollectReport:
    """Apply the tier's expiry and per-tenant budget to its model's objects (see the
    module's docstring)."""
    return collect_model(tier.store, tier.tenants_prefix.split("/", 1)[0], tier.config,
                         now, mac_key=tier.mac_key)


def collect_store(store: ShadowStore, config: SharedTierConfig, now: float | None = None,
                  *, mac_key: bytes) -> dict[str, CollectReport]:
    """:func:`collect_model` for every model in the store (one listing to find them;
    ``contextkit shared gc``). Returns each model tag's report."""
    models = sorted({key.split("/", 1)[0] for key in store.list()
                     if key.count("/") >= 2 and key.split("/")[1] in ("t", "leases")})
    return {model: collect_model(store, model, config, now, mac_key=mac_key)
            for model in models}


def collect_model(store: ShadowStore, model: str, config: SharedTierConfig,
                  now: float | None = None, *, mac_key: bytes) -> CollectReport:
    """Apply ``config``'s expiry and per-tenant budget to the objects of the model
    whose name prefix is ``model`` (:func:`~shadow.shared.objects.model_tag`), trusting
    only what ``mac_key`` (the deployment's key) authenticates.

    Store errors end the collection (logged); what was deleted stays deleted.
    """
    now = time.time() if now is None else now
    report = CollectReport()
    tenants_prefix = f"{model}/t/"
    verified = 0
    forged: list[tuple[str, int]] = []  # failed their MAC: deleted once the key is shown right

    def drop(path: str, size: int) -> None:
        store.delete(path)
        report.bytes_deleted += size

    try:
        live: set[str] = set()
        for key in store.list(f"{model}/leases/"):
            try:
                lease = read_lease(store, key, mac_key)
            except BlobNotFoundError:
                continue
            except SharedObjectError as exc:
                logger.warning("shared tier lease %s refused (%s): %s", key, exc.reason, exc)
                report.leases_refused += 1
                if exc.reason == "tampered":
                    forged.append((key, 0))
                else:
                    store.delete(key)
                continue
            verified += 1
            if lease.expires_at < now:
                store.delete(key)
                report.leases_expired += 1
            elif lease_runs(lease, now, config):
                live.update(lease.chunks)
            else:  # runs further ahead than any expiry: not to be trusted
                store.delete(key)
                report.leases_refused += 1
        by_tenant: dict[str, list[_Object]] = {}
        for path, size in store.list_sizes(tenants_prefix):
            report.objects += 1
            report.bytes += size
            try:
                obj = _read(store, path, size, mac_key, model, now)
            except BlobNotFoundError:
                continue
            except SharedObjectError as exc:
                report.unreadable += 1
                report.refused[exc.reason] = report.refused.get(exc.reason, 0) + 1
                if exc.reason == "tampered":
                    forged.append((path, size))
                else:
                    drop(path, size)
                continue
            except ShadowStoreError:
                raise
            except Exception:  # no check foresaw it: skipped, counted, never fatal
                logger.exception("shared tier object %s skipped", path)
                report.unreadable += 1
                report.refused["error"] = report.refused.get("error", 0) + 1
                continue
            verified += 1
            if path in live:
                report.leased += 1
            else:
                max_age = config.pinned_max_age_s if obj.pinned else config.max_age_s
                if now - obj.written_at > max_age:
                    drop(path, size)
                    report.expired += 1
                    continue
            tenant = path[len(tenants_prefix):].split("/", 1)[0]
            by_tenant.setdefault(tenant, []).append(obj)
        if forged and not verified:
            logger.error("shared tier %s: %d objects or leases fail their MAC and none "
                         "verifies: is this the deployment's key? Nothing deleted for it",
                         model, len(forged))
            report.unverified = len(forged)
        else:
            for path, size in forged:
                drop(path, size)
        for tenant, objs in by_tenant.items():
            held = sum(o.size for o in objs)
            victims = sorted((o for o in objs if o.path not in live),
                             key=lambda o: (o.pinned, o.importance, o.written_at))
            for obj in victims:
                if held <= config.tenant_budget_bytes:
                    break
                drop(obj.path, obj.size)
                held -= obj.size
                report.over_budget += 1
            report.tenants[tenant] = held
    except ShadowStoreError as exc:
        logger.error("shared tier collection stopped: %s", exc)
    return report
