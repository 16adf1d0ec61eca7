"""Object stores behind one interface, chosen by URL scheme.

``file:///path`` (a local directory, e.g. on NVMe) and ``s3://bucket/prefix``
(boto3; ``endpoint_url`` for MinIO, Ceph or moto). Keys are relative, ``/``-separated
names such as ``"sess-1/manifest.json"``.

Every store keeps one promise the shadow protocol relies on: an object becomes
visible only complete. ``put`` replaces an object atomically; a :class:`BlobWriter`
streams a large object and makes it visible on :meth:`BlobWriter.commit` (a temp
file renamed into place locally, a multipart upload completed on S3). A writer that
is aborted, or a process killed mid-write, leaves no object under the key.
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

from shadow._errors import ShadowStoreError
from shadow._local import LocalStore, fsync_dir
from shadow._s3 import S3Store
from shadow._store_base import S3_MIN_PART_BYTES, BlobWriter, ShadowStore, StoreConfig

__all__ = [
    "S3_MIN_PART_BYTES",
    "STORES",
    "BlobWriter",
    "LocalStore",
    "MeteredStore",
    "S3Store",
    "ShadowStore",
    "StoreConfig",
    "fsync_dir",
    "open_store",
    "store_class",
]


class _MeteredWriter(BlobWriter):
    def __init__(self, inner: BlobWriter, on_commit: Callable[[str, int], None]) -> None:
        self._inner = inner
        self._on_commit = on_commit
        self.key = inner.key
        self.bytes_written = 0

    def write(self, data: Any) -> None:
        self._inner.write(data)
        self.bytes_written = self._inner.bytes_written

    def commit(self) -> int:
        n = self._inner.commit()
        self._on_commit(self.key, n)
        return n

    def abort(self) -> None:
        self._inner.abort()


class MeteredStore(ShadowStore):
    """Wraps a store and counts committed bytes and objects per key (metrics, tests)."""

    def __init__(self, inner: ShadowStore) -> None:
        self.inner = inner
        self.url = inner.url
        self.scheme = inner.scheme  # type: ignore[misc]  # a wrapper reports its inner scheme
        self._lock = threading.Lock()
        self.written: dict[str, int] = {}
        self.bytes_read = 0
        self.deleted: list[str] = []

    def _record(self, key: str, nbytes: int) -> None:
        with self._lock:
            self.written[key] = self.written.get(key, 0) + nbytes

    @property
    def bytes_written(self) -> int:
        with self._lock:
            return sum(self.written.values())

    def reset(self) -> None:
        with self._lock:
            self.written.clear()
            self.deleted.clear()
            self.bytes_read = 0

    def put(self, key: str, data: Any) -> None:
        self.inner.put(key, data)
        self._record(key, memoryview(data).nbytes)

    def open_writer(self, key: str) -> BlobWriter:
        return _MeteredWriter(self.inner.open_writer(key), self._record)

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        with self._lock:
            self.bytes_read += len(data)
        return data

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        n = self.inner.read_into(key, offset, buffer)
        with self._lock:
            self.bytes_read += n
        return n

    def get_limited(self, key: str, limit: int) -> bytearray:
        data = self.inner.get_limited(key, limit)
        with self._lock:
            self.bytes_read += len(data)
        return data

    def size(self, key: str) -> int | None:
        return self.inner.size(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)
        with self._lock:
            self.deleted.append(key)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def list_uploads(self, prefix: str = "") -> builtins.list[tuple[str, str, float]]:
        return self.inner.list_uploads(prefix)

    def abort_upload(self, key: str, upload_id: str) -> None:
        self.inner.abort_upload(key, upload_id)

    def close(self) -> None:
        self.inner.close()


#: URL scheme -> store class. Adding a backend is one line here.
STORES: dict[str, type[ShadowStore]] = {
    "file": LocalStore,
    "s3": S3Store,
}


def store_class(url: str) -> type[ShadowStore]:
    """The store class serving ``url``'s scheme (a plain path means ``file://``); opens
    nothing, so a configuration can be checked before anything starts.

    Raises:
        ShadowStoreError: an unknown scheme (the message lists the known ones).
    """
    scheme = urlparse(url).scheme or "file"
    try:
        return STORES[scheme]
    except KeyError:
        known = ", ".join(f"{s}://" for s in sorted(STORES))
        raise ShadowStoreError(f"no shadow store for {url!r}; use one of: {known}") from None


def open_store(url: str, config: StoreConfig | None = None, *,
               create: bool = True) -> ShadowStore:
    """The store serving ``url`` (a plain path means ``file://``).

    Args:
        url: ``file:///path``, a plain path, or ``s3://bucket/prefix``.
        config: store options.
        create: writers leave this on (a ``file://`` directory is created); readers
            (recover, status, discovery) pass ``False`` so a path that does not exist
            is an error instead of an empty store.

    Raises:
        ShadowStoreError: an unknown scheme (the message lists the known ones), or
            ``create=False`` and no ``file://`` directory at ``url``.
    """
    cls = store_class(url)
    if cls is LocalStore:
        return LocalStore(url, config, create=create)
    return cls(url, config)  # type: ignore[call-arg]
