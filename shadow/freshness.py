"""Freshness: the newest generation of each session, so a replayed manifest is seen.

A manifest's generation is covered by its MAC and grows with every commit; a writer
never reuses one, not even one whose write failed (it may still land later). Besides
the manifest itself, two objects record a session's newest generation:

- ``{session}/head.json``, written by the writer right after each commit: the
  generation and the SHA-256 of the manifest file it committed, signed (kind ``head``)
  when a key is configured. It lags at most one commit behind (a crash between the
  manifest and the head), never runs ahead.
- ``index.json``: each session's generation as of its last index update (a hint that
  may lag, never run ahead).

A reader compares the manifest with the newer of the two (:func:`rollback_reason`): a
manifest older than either, or (signed) one that is not the manifest its generation's
head names, is a *rollback* (an older copy put back, or a restore from a backup).
Recovery refuses it (:class:`RollbackShadowError`, a :class:`shadow.TamperedShadowError`)
unless the operator accepts the older state, and a writer continues above the newest
generation it can see.

Not detected: a store rolled back as a whole (manifest, head and index together, such
as a restored snapshot of the bucket); that needs state outside the store.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shadow._errors import (
    BlobNotFoundError,
    CorruptShadowError,
    RollbackShadowError,
    ShadowError,
    ShadowStoreError,
)
from shadow._index import listed_sessions, read_index
from shadow.auth import sign, verify
from shadow.manifest import Manifest, validate_session_id
from shadow.stores import ShadowStore

__all__ = ["HEAD_NAME", "Head", "Newest", "RollbackShadowError", "commit_record", "newest_known",
           "read_head", "rollback_reason", "write_head"]

logger = logging.getLogger(__name__)

HEAD_NAME = "head.json"
_HEAD_FORMAT = "contextkit-shadow-head"
_SHA256 = re.compile("[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class Head:
    """A session's ``head.json``: the generation its writer last committed, and the
    SHA-256 of that manifest file."""

    session_id: str
    generation: int
    manifest_sha256: str


@dataclass(frozen=True, slots=True)
class Newest:
    """The newest generation recorded for a session outside its manifest (0: none), and
    where (``head.json``, ``index.json``)."""

    generation: int = 0
    source: str = ""
    head: Head | None = None


def head_key(session_id: str) -> str:
    return f"{validate_session_id(session_id)}/{HEAD_NAME}"


def write_head(store: ShadowStore, session_id: str, generation: int, manifest_raw: bytes,
               key: bytes | None) -> None:
    """Record that ``manifest_raw`` (generation ``generation``) is the session's newest."""
    doc: dict[str, Any] = {"format": _HEAD_FORMAT, "format_version": 1,
                           "session_id": session_id, "generation": generation,
                           "manifest_sha256": hashlib.sha256(manifest_raw).hexdigest()}
    if key:
        doc["mac"] = sign(doc, key, "head")
    store.put(head_key(session_id), json.dumps(doc, separators=(",", ":")).encode())


def read_head(store: ShadowStore, session_id: str, *, key: bytes | None) -> Head | None:
    """The session's head; ``None`` when it has none.

    Raises:
        TamperedShadowError: a key is configured and the head's MAC is missing or wrong.
        UnauthenticatedShadowError: no key is configured but the head is signed.
        CorruptShadowError: not a head object of this session.
    """
    where = f"{store.url}/{head_key(session_id)}"
    try:
        raw = store.get(head_key(session_id))
    except BlobNotFoundError:
        return None
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        doc = None
    if not isinstance(doc, dict):
        raise CorruptShadowError(f"{where} is not a head object; delete it (the next shadow "
                                 "writes a new one) or restore it from a backup")
    verify(doc, key, "head", where)
    generation, digest = doc.get("generation"), doc.get("manifest_sha256")
    if doc.get("format") != _HEAD_FORMAT or doc.get("session_id") != session_id \
            or type(generation) is not int or generation < 0 \
            or not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise CorruptShadowError(f"{where} is malformed or names another session; delete it "
                                 "or restore it from a backup")
    return Head(session_id, generation, digest)


def newest_known(store: ShadowStore, session_id: str, *, key: bytes | None,
                 index: Mapping[str, Mapping[str, Any]] | None = None) -> Newest:
    """The newest generation the store records for ``session_id`` besides its manifest.

    Args:
        store: where the session lives.
        session_id: the session.
        key: the MAC key (``None``: unsigned objects only).
        index: ``index.json``'s sessions when the caller read them already.

    Raises:
        ShadowError: the head cannot be read or trusted (an index that cannot be is
            left out: it is a hint, and the head is the session's own record).
    """
    head = read_head(store, session_id, key=key)
    newest = Newest(head.generation, "head.json", head) if head is not None else Newest()
    if index is None:
        try:
            index = read_index(store, key=key or b"")
        except ShadowError as exc:
            logger.info("freshness of %s: index left out (%s)", session_id, exc)
            index = {}
    entry = index.get(session_id)
    listed = entry.get("generation") if isinstance(entry, Mapping) else None
    if type(listed) is int and listed > newest.generation:
        newest = Newest(listed, "index.json", head)
    return newest


def commit_record(store: ShadowStore, session_id: str) -> str | None:
    """What besides its manifest says ``session_id`` committed (a phrase naming it), or
    ``None`` when nothing does.

    Read without checking MACs on purpose: the answer only ever stops a deletion (a
    session whose manifest is missing keeps its blobs), it never makes data trusted.
    """
    try:
        if store.size(head_key(session_id)) is not None:
            return f"{HEAD_NAME} records a commit of it"
    except ShadowStoreError as exc:
        return f"its {HEAD_NAME} cannot be checked ({exc})"
    listed = listed_sessions(store)
    if listed is None:
        return "index.json cannot be read, so a commit cannot be ruled out"
    if session_id in listed:
        return "index.json lists it as committed"
    return None


def rollback_reason(manifest: Manifest, raw: bytes, newest: Newest, where: str) -> str | None:
    """Why ``manifest`` (the file ``raw``) is a rollback, or ``None`` when it is the newest
    state the store records."""
    accept = ("refused - to take the older state anyway, recover with --accept-rollback "
              "(accept_rollback=True; a writer: ShadowConfig(accept_rollback=True)), or put "
              "the newest manifest back")
    if manifest.generation < newest.generation:
        return (f"rollback: {where} holds generation {manifest.generation}, but "
                f"{newest.source} records generation {newest.generation} (an older copy of "
                f"the manifest was put back, or the store restored from a backup); {accept}")
    head = newest.head
    # Unsigned, a manifest edited in place is trusted (nothing tells an edit from a
    # replay there); signed, the head names the one manifest of its generation.
    if manifest.authenticated and head is not None and head.generation == manifest.generation \
            and head.manifest_sha256 != hashlib.sha256(raw).hexdigest():
        return (f"rollback: {where} holds generation {manifest.generation}, but it is not "
                f"the manifest head.json records for generation {head.generation} (another "
                f"copy was put in its place); {accept}")
    return None
