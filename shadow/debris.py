"""Debris of killed writers, and the leases that tell a live writer from a dead one.

What a killed writer leaves behind: blobs no manifest references (a segment written
before the manifest commit), unfinished temp files of a ``file://`` store
(``<key>.tmp-<pid>-<token>``), and incomplete multipart uploads on S3 (invisible, but
billed). :func:`sweep_debris` removes them for every session (``contextkit recover``
runs it); a writer also cleans its own session when it starts.

Liveness rule. A writer (:class:`shadow.CacheShadow`) holds ``{session}/writer.lease``:
JSON with its ``pid``, ``host``, ``heartbeat`` (Unix time) and ``ttl_s``. It writes
the lease when it opens the session, refreshes it at the start of every shadow (so a
shadow in progress always has a fresh one), and deletes it on ``close()``. A lease is
*live* while ``now - heartbeat < ttl_s``; on the sweeper's own host, a lease whose
process no longer exists is dead at once. The sweeper never touches a session with a
live lease: not its blobs, not its temp files, not its uploads. So a writer must
finish each shadow within its TTL (default: three shadow intervals, at least ten
minutes). A session without a live lease is swept, but only against a manifest that
loads, authenticates and is the newest generation the store records; a session whose
manifest cannot be trusted is left alone, and so is one whose manifest is missing while
``head.json`` or ``index.json`` records a commit: the sweep deletes only what it can
prove is debris, never what a commit record names.

A sweep never aborts: what it cannot delete (a read-only store, a denied delete) is
reported in :attr:`DebrisReport.not_deleted` with the reason, and recovery goes on.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from gpu_cache import CacheIdentityError
from shadow._errors import BlobNotFoundError, InvalidSessionIdError, ShadowError, ShadowStoreError
from shadow._local import LocalStore
from shadow.auth import resolve_key
from shadow.freshness import commit_record
from shadow.manifest import validate_session_id
from shadow.stores import ShadowStore

__all__ = [
    "DEFAULT_DEBRIS_AGE_S",
    "LEASE_NAME",
    "DebrisReport",
    "Lease",
    "abort_stale_uploads",
    "drop_lease",
    "read_lease",
    "sweep_debris",
    "write_lease",
]

logger = logging.getLogger(__name__)

LEASE_NAME = "writer.lease"
#: Debris younger than this is left alone (temp files, multipart uploads): one hour.
DEFAULT_DEBRIS_AGE_S = 3600.0


@dataclass(frozen=True, slots=True)
class Lease:
    """A writer's claim on a session (see the module docstring for the rule)."""

    pid: int
    host: str
    heartbeat: float
    ttl_s: float

    def live(self, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        if now - self.heartbeat >= self.ttl_s:
            return False
        if self.host == socket.gethostname():
            return _pid_alive(self.pid)
        return True


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    except OSError:
        return False
    return True


def _lease_key(session_id: str) -> str:
    return f"{validate_session_id(session_id)}/{LEASE_NAME}"


def write_lease(store: ShadowStore, session_id: str, ttl_s: float) -> Lease:
    """Take or refresh the lease of ``session_id`` for this process."""
    lease = Lease(pid=os.getpid(), host=socket.gethostname(), heartbeat=time.time(),
                  ttl_s=float(ttl_s))
    store.put(_lease_key(session_id), json.dumps(
        {"pid": lease.pid, "host": lease.host, "heartbeat": lease.heartbeat,
         "ttl_s": lease.ttl_s}).encode())
    return lease


def read_lease(store: ShadowStore, session_id: str) -> Lease | None:
    """The session's lease; ``None`` when there is none or it is unreadable (dead)."""
    try:
        doc = json.loads(store.get(_lease_key(session_id)))
        return Lease(pid=int(doc["pid"]), host=str(doc["host"]),
                     heartbeat=float(doc["heartbeat"]), ttl_s=float(doc["ttl_s"]))
    except BlobNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, RecursionError):
        logger.warning("unreadable lease of session %s: treated as dead", session_id)
        return None


def drop_lease(store: ShadowStore, session_id: str) -> None:
    """Release the lease (a closing writer)."""
    store.delete(_lease_key(session_id))


@dataclass(slots=True)
class DebrisReport:
    """What a sweep removed, and what it left alone and why."""

    deleted: list[str] = field(default_factory=list)  # blobs and temp files
    aborted_uploads: list[str] = field(default_factory=list)  # keys of aborted uploads
    live_sessions: list[str] = field(default_factory=list)  # held by a live lease
    untrusted: list[str] = field(default_factory=list)  # manifest unreadable or refused
    #: no manifest, but head.json or index.json records a commit (or cannot rule one out)
    missing_manifest: list[str] = field(default_factory=list)
    not_deleted: dict[str, str] = field(default_factory=dict)  # debris left, and why

    def to_dict(self) -> dict[str, Any]:
        first = next(iter(self.not_deleted.values()), None)
        return {"deleted": len(self.deleted), "aborted_uploads": len(self.aborted_uploads),
                "live_sessions": list(self.live_sessions), "untrusted": list(self.untrusted),
                "missing_manifest": list(self.missing_manifest),
                "not_deleted": len(self.not_deleted), "not_deleted_reason": first}

    def _remove(self, key: str, remove: Any) -> bool:
        """Run ``remove()``; a failure is recorded, never raised (the sweep goes on)."""
        try:
            remove()
        except (ShadowStoreError, OSError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self.not_deleted[key] = reason
            return False
        return True


_WRITER_FILE = re.compile(r"(seg-[0-9]{6}(-[0-9a-f]{16})?\.)?[kv]_(packed|norms)\.bin|"
                          + re.escape(LEASE_NAME))


def _is_writer_file(session_id: str, key: str) -> bool:
    """``key`` is a blob or lease name a shadow writer writes directly under its session."""
    rest = key[len(session_id) + 1:]
    return key.startswith(f"{session_id}/") and _WRITER_FILE.fullmatch(rest) is not None


def _exists_unlisted(store: ShadowStore, key: str) -> bool:
    """Whether something a listing leaves out sits at ``key`` (a directory in a
    ``file://`` store); one that cannot be checked counts as there."""
    try:
        return store.size(key) is not None
    except ShadowStoreError:
        return True


def _session_of(key: str) -> str | None:
    return key.split("/", 1)[0] if "/" in key else None


def _live_sessions(store: ShadowStore, sessions: set[str], now: float) -> set[str]:
    live = set()
    for sid in sessions:
        try:
            lease = read_lease(store, sid)
        except InvalidSessionIdError:
            continue
        if lease is not None and lease.live(now):
            live.add(sid)
    return live


def abort_stale_uploads(store: ShadowStore, older_than_seconds: float = DEFAULT_DEBRIS_AGE_S,
                        *, own_session: str | None = None, now: float | None = None
                        ) -> list[str]:
    """Abort incomplete multipart uploads older than ``older_than_seconds``.

    Uploads of sessions with a live lease are kept, except ``own_session`` (a writer
    starting on its session: any upload there is from a dead predecessor). Returns the
    keys of the aborted uploads; stores without multipart uploads return ``[]``.
    """
    now = time.time() if now is None else now
    uploads = [u for u in store.list_uploads() if now - u[2] >= older_than_seconds]
    sessions = {s for s in (_session_of(k) for k, _, _ in uploads) if s and s != own_session}
    live = _live_sessions(store, sessions, now)
    aborted = []
    for key, upload_id, _ in uploads:
        if _session_of(key) in live:
            continue
        try:
            store.abort_upload(key, upload_id)
        except ShadowStoreError as exc:  # S3 lifecycle rules reap it; never fatal
            logger.warning("could not abort the incomplete upload of %s: %s", key, exc)
            continue
        aborted.append(key)
    if aborted:
        logger.info("%s: aborted %d incomplete multipart uploads", store.url, len(aborted))
    return aborted


def sweep_debris(store: ShadowStore, *, key: bytes | str | None = None,
                 older_than_seconds: float = DEFAULT_DEBRIS_AGE_S,
                 now: float | None = None) -> DebrisReport:
    """Remove the debris of every session whose writer is not alive.

    Per session without a live lease: blobs its (authenticated) manifest does not
    reference, a stale lease, temp files older than ``older_than_seconds``; a session
    with no manifest at all loses everything (a first shadow killed before its
    commit), but only when nothing records a commit of it (no ``head.json``, no
    ``index.json`` entry); one that a commit record names keeps every blob and is
    listed in ``missing_manifest``. Also temp files at the store root (the index's) and
    incomplete multipart uploads older than ``older_than_seconds``.

    Nothing it fails to delete stops it: those are listed in ``not_deleted`` with the
    reason (a read-only store: recover with ``--no-sweep``, or make it writable).

    Args:
        store: the store to sweep.
        key: the MAC key (default ``$CONTEXTKIT_SHADOW_KEY``); a session whose manifest
            fails to load, authenticate or prove fresh is left untouched and listed in
            ``untrusted``.
        older_than_seconds: minimum age of temp files and uploads to remove.
        now: the current time (tests).
    """
    from shadow.recovery import load_manifest, missing_manifest_reason

    now = time.time() if now is None else now
    mac_key = resolve_key(key) or b""
    report = DebrisReport()
    local = store if isinstance(store, LocalStore) else getattr(store, "inner", None)
    local = local if isinstance(local, LocalStore) else None
    keys = store.list()
    temps = local.list_unfinished() if local is not None else []
    by_session: dict[str, list[str]] = {}
    for k in keys:
        sid = _session_of(k)
        if sid is not None:
            by_session.setdefault(sid, []).append(k)
    for t in temps:
        sid = _session_of(t)
        if sid is not None:
            by_session.setdefault(sid, [])
    live = _live_sessions(store, set(by_session), now)
    report.live_sessions = sorted(live)
    for sid in sorted(by_session):
        if sid in live:
            continue
        try:
            validate_session_id(sid)
        except InvalidSessionIdError:
            continue  # not a session directory of ours
        manifest_path = f"{sid}/manifest.json"
        keep = set()
        if manifest_path in by_session[sid] or _exists_unlisted(store, manifest_path):
            try:
                manifest = load_manifest(store, sid, key=mac_key)
            except (ShadowError, CacheIdentityError) as exc:
                report.untrusted.append(sid)
                logger.info("not sweeping session %s: %s", sid, exc)
                continue
            keep = {manifest_path} | {f for s in manifest.segments for f in s.files.values()}
        else:
            # No manifest: debris of a first shadow killed before its commit, unless
            # anything records a commit (then the manifest was lost: keep everything).
            record = commit_record(store, sid)
            if record is not None:
                report.missing_manifest.append(sid)
                logger.warning("not sweeping session %s: %s", sid, missing_manifest_reason(
                    f"{store.url}/{manifest_path}", record))
                continue
        # Only names the writer itself produces, one level under the session: a
        # directory that merely looks like a session keeps every other file.
        stale = [k for k in by_session[sid] if k not in keep and _is_writer_file(sid, k)]
        for k in stale:
            if report._remove(k, lambda k=k: store.delete(k)) \
                    and not k.endswith(f"/{LEASE_NAME}"):
                report.deleted.append(k)
    if local is not None:
        for t in temps:
            sid = _session_of(t)
            if (sid is None or (sid not in live and sid not in report.untrusted
                                and sid not in report.missing_manifest)) \
                    and (local.age(t) or 0.0) >= older_than_seconds \
                    and report._remove(t, lambda t=t: local.remove_unfinished(t)):
                report.deleted.append(t)
    report.aborted_uploads = abort_stale_uploads(store, older_than_seconds, now=now)
    if report.not_deleted:
        logger.warning("%s: could not delete %d stale objects (first: %s); recovery goes on",
                       store.url, len(report.not_deleted),
                       next(iter(report.not_deleted.values())))
    if report.deleted or report.aborted_uploads:
        logger.info("%s: swept %d stale blobs and temp files, aborted %d uploads", store.url,
                    len(report.deleted), len(report.aborted_uploads))
    return report
