"""``index.json``: the store's list of sessions, a discovery hint written after commits.

Read-modify-write under a per-store lock in this process; writers in other processes may
race, so discovery also lists manifests and a lost entry costs only a manifest read.
Signed with the shadow key like manifests (kind ``index``).
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from shadow._errors import BlobNotFoundError, ShadowError, UnauthenticatedShadowError
from shadow.auth import KEY_ENV, resolve_key, sign, verify
from shadow.manifest import INDEX_KEY, SessionInfo
from shadow.stores import ShadowStore

__all__ = ["listed_sessions", "read_index", "update_index"]

logger = logging.getLogger(__name__)

_index_locks: dict[str, threading.Lock] = {}
_index_locks_guard = threading.Lock()


def read_index(store: ShadowStore, *, key: bytes | str | None = None
               ) -> dict[str, dict[str, Any]]:
    """Sessions listed in ``index.json``; an unparsable index reads as empty (it is a hint).

    Raises:
        TamperedShadowError: a key is configured and the index's MAC is missing or wrong.
        UnauthenticatedShadowError: no key is configured but the index is signed.
    """
    try:
        doc = json.loads(store.get(INDEX_KEY))
        if not isinstance(doc, dict):
            raise TypeError("the index is not an object")
        verify(doc, resolve_key(key), "index", f"{store.url}/{INDEX_KEY}")
        sessions = doc["sessions"]
        if not isinstance(sessions, dict):
            raise TypeError("sessions is not an object")
        return {str(k): dict(v) for k, v in sessions.items()}
    except BlobNotFoundError:
        return {}
    except ShadowError:
        raise
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        logger.warning("ignoring unreadable %s/%s (%s); discovery lists manifests instead",
                       store.url, INDEX_KEY, exc)
        return {}


def listed_sessions(store: ShadowStore) -> set[str] | None:
    """The session names ``index.json`` lists, read without checking its MAC; ``None`` when
    it exists but cannot be parsed. Only ever used to keep data, never to trust it."""
    try:
        doc = json.loads(store.get(INDEX_KEY))
    except BlobNotFoundError:
        return set()
    except (ShadowError, ValueError, RecursionError):
        return None
    sessions = doc.get("sessions") if isinstance(doc, dict) else None
    return {str(k) for k in sessions} if isinstance(sessions, dict) else None


def update_index(store: ShadowStore, info: SessionInfo, *, key: bytes | None = None) -> None:
    """Record a session in ``index.json`` (read-modify-write, atomic put), signed with
    ``key`` when one is given (``None`` here means unsigned, not the environment).

    Writers in other processes may race; discovery therefore also lists manifests,
    so a lost index entry only costs a manifest read. An index that fails its MAC is
    rebuilt from this session alone (its other entries cannot be trusted).
    """
    with _index_locks_guard:
        lock = _index_locks.setdefault(store.url, threading.Lock())
    with lock:
        try:
            # b"" resolves to no key (not to the environment): the caller decided.
            sessions = read_index(store, key=key or b"")
        except UnauthenticatedShadowError:
            logger.warning("%s/%s is signed but this writer has no key; index not updated "
                           "(set %s)", store.url, INDEX_KEY, KEY_ENV)
            return
        except ShadowError as exc:
            logger.warning("%s; rewriting the index", exc)
            sessions = {}
        sessions[info.session_id] = {
            "generation": info.generation, "num_blocks": info.num_blocks,
            "num_bytes": info.num_bytes, "updated_at": info.updated_at,
            "identity": info.identity.to_dict() if info.identity else None,
        }
        doc: dict[str, Any] = {"format": "contextkit-shadow-index", "format_version": 1,
                               "sessions": sessions}
        if key:
            doc["mac"] = sign(doc, key, "index")
        store.put(INDEX_KEY, json.dumps(doc, separators=(",", ":"), sort_keys=True).encode())
