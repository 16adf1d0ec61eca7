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

import abc
import builtins
import ctypes
import errno
import io
import logging
import os
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar
from urllib.parse import unquote, urlparse

from shadow._errors import BlobNotFoundError, ShadowStoreError

__all__ = [
    "STORES",
    "BlobWriter",
    "LocalStore",
    "MeteredStore",
    "S3Store",
    "ShadowStore",
    "StoreConfig",
    "open_store",
]

logger = logging.getLogger(__name__)

#: S3 refuses multipart parts below 5 MiB (except the last one).
S3_MIN_PART_BYTES = 5 * 1024 * 1024
_TMP_MARK = ".tmp-"
_MAX_READ_FDS = 64
_PAGE = 4096  # O_DIRECT alignment of offsets, lengths and buffer addresses


def _aligned(view: memoryview, offset: int) -> bool:
    """Whether a read of ``view`` at ``offset`` meets O_DIRECT's alignment rules."""
    if offset % _PAGE or len(view) % _PAGE or view.readonly or not len(view):
        return False
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    return address % _PAGE == 0


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Options of the stores; each store reads the fields that concern it.

    Args:
        fsync: make local writes durable (file and directory fsync) before a
            write returns. Turn off only for throwaway data.
        endpoint_url: S3-compatible endpoint (MinIO, Ceph, moto); ``None`` uses
            boto3's default resolution (``AWS_ENDPOINT_URL`` and friends).
        region_name: S3 region; ``None`` uses boto3's default.
        multipart_threshold: S3 objects at least this large are uploaded in parts.
        multipart_chunksize: S3 part size (S3 requires >= 5 MiB).
        direct_io: local reads of page-aligned ranges into page-aligned buffers use
            ``O_DIRECT``: the disk writes straight into the caller's buffer, with no
            page-cache copy on the CPU (recovery needs that CPU for checksums and the
            tier import). Other reads, and filesystems without ``O_DIRECT``, read
            through the page cache.
    """

    fsync: bool = True
    endpoint_url: str | None = None
    region_name: str | None = None
    multipart_threshold: int = 64 * 1024 * 1024
    multipart_chunksize: int = 16 * 1024 * 1024
    direct_io: bool = True

    def __post_init__(self) -> None:
        if self.multipart_chunksize < S3_MIN_PART_BYTES:
            raise ValueError(f"multipart_chunksize must be >= {S3_MIN_PART_BYTES} (5 MiB, the "
                             f"S3 minimum part size), got {self.multipart_chunksize}")
        if self.multipart_threshold < 1:
            raise ValueError(f"multipart_threshold must be >= 1, got {self.multipart_threshold}")


class BlobWriter(abc.ABC):
    """Streams one object; it becomes visible only on :meth:`commit`.

    Use as a context manager: leaving the block without ``commit()`` (an exception)
    aborts the write.
    """

    key: str
    bytes_written: int

    @abc.abstractmethod
    def write(self, data: Any) -> None:
        """Append a bytes-like object (``bytes``, ``memoryview``, a numpy array)."""

    @abc.abstractmethod
    def commit(self) -> int:
        """Make the object durable and visible; returns its size in bytes."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Drop what was written; idempotent, never raises for a missing temp object."""

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.abort()


class ShadowStore(abc.ABC):
    """A flat key -> bytes store.

    Subclasses implement the abstract methods; batched helpers have defaults.
    ``scheme`` is the URL scheme the store serves (see :data:`STORES`).
    """

    scheme: ClassVar[str] = ""
    url: str

    @abc.abstractmethod
    def put(self, key: str, data: Any) -> None:
        """Write a whole object, replacing any previous one atomically and durably."""

    @abc.abstractmethod
    def open_writer(self, key: str) -> BlobWriter:
        """Start streaming a (large) object; see :class:`BlobWriter`."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The whole object.

        Raises:
            BlobNotFoundError: no object under ``key``.
        """

    @abc.abstractmethod
    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        """Read up to ``len(buffer)`` bytes at ``offset`` into ``buffer``.

        Returns:
            Bytes read; fewer than asked when the object ends early (truncated).

        Raises:
            BlobNotFoundError: no object under ``key``.
        """

    @abc.abstractmethod
    def size(self, key: str) -> int | None:
        """Object size in bytes, or ``None`` when there is none."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove an object; a missing one is not an error."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Keys starting with ``prefix``, sorted; unfinished writes are not listed."""

    def exists(self, key: str) -> bool:
        return self.size(key) is not None

    def put_file(self, key: str, chunks: Iterable[Any]) -> int:
        """Stream ``chunks`` into one object (multipart on S3); returns its size."""
        with self.open_writer(key) as writer:
            for chunk in chunks:
                writer.write(chunk)
            return writer.commit()

    def delete_many(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.delete(key)

    def close(self) -> None:  # noqa: B027 - optional hook, most stores hold nothing
        """Release clients and handles; idempotent."""

    def __enter__(self) -> ShadowStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


# ---------------------------------------------------------------------- local
def _check_key(key: str) -> None:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts) \
            or "\\" in key or "\x00" in key:
        raise ShadowStoreError(f"store key {key!r} is not a relative '/'-separated name")


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename or new entry in it is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _LocalWriter(BlobWriter):
    """Writes ``<key>.tmp-<pid>-<token>``, then fsyncs and renames it onto ``key``."""

    def __init__(self, store: LocalStore, key: str) -> None:
        self.key = key
        self.bytes_written = 0
        self._final = store._path(key)
        self._final.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self._final.with_name(
            f"{self._final.name}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
        self._fsync = store.config.fsync
        self._file: io.FileIO | None = open(self._tmp, "wb", buffering=0)  # noqa: SIM115

    def write(self, data: Any) -> None:
        assert self._file is not None, "write after commit/abort"
        view = memoryview(data).cast("B")
        while view:  # raw files may write short
            n = self._file.write(view)
            assert n is not None
            view = view[n:]
            self.bytes_written += n

    def commit(self) -> int:
        assert self._file is not None, "commit after commit/abort"
        f, self._file = self._file, None
        try:
            if self._fsync:
                os.fsync(f.fileno())
        finally:
            f.close()
        os.replace(self._tmp, self._final)
        if self._fsync:
            fsync_dir(self._final.parent)
        return self.bytes_written

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._tmp.unlink(missing_ok=True)


class LocalStore(ShadowStore):
    """A directory; writes go through temp files, fsync and ``os.replace``.

    Args:
        url: ``file:///absolute/path`` (or a plain path).
        config: ``fsync`` decides durability; other fields are ignored.
    """

    scheme = "file"

    def __init__(self, url: str, config: StoreConfig | None = None) -> None:
        parsed = urlparse(url)
        if parsed.scheme not in ("", "file"):
            raise ShadowStoreError(f"LocalStore serves file:// URLs, got {url!r}")
        if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
            raise ShadowStoreError(
                f"file URL {url!r} names host {parsed.netloc!r}; use file:///absolute/path "
                "(three slashes)")
        raw = unquote(parsed.path) if parsed.scheme else url
        self.root = Path(raw).expanduser().resolve()
        self.url = f"file://{self.root}"
        self.config = config or StoreConfig()
        self.root.mkdir(parents=True, exist_ok=True)
        self._read_fds: OrderedDict[str, tuple[int, tuple[int, int]]] = OrderedDict()
        self._fd_lock = threading.Lock()
        self._direct_ok = self.config.direct_io and hasattr(os, "O_DIRECT")

    def _path(self, key: str) -> Path:
        _check_key(key)
        return self.root.joinpath(*key.split("/"))

    def put(self, key: str, data: Any) -> None:
        with self.open_writer(key) as writer:
            writer.write(data)
            writer.commit()

    def open_writer(self, key: str) -> BlobWriter:
        return _LocalWriter(self, key)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise BlobNotFoundError(f"{self.url}/{key} does not exist") from None

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        view = memoryview(buffer).cast("B")
        direct = self._direct_ok and _aligned(view, offset)
        fd = self._read_fd(key, direct)
        total = 0
        while total < len(view):
            try:
                n = os.preadv(fd, [view[total:]], offset + total)
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                # The filesystem takes O_DIRECT opens but not these reads: stop trying.
                self._direct_ok = False
                return total + self.read_into(key, offset + total, view[total:])
            if not n:
                break
            total += n
            if direct and n % _PAGE:
                break  # a short direct read ends at end of file
        return total

    def _read_fd(self, key: str, direct: bool = False) -> int:
        """A read descriptor for ``key``, kept open across calls.

        Recovery reads each blob in many chunks; reopening it per chunk would reset
        the kernel's readahead. A cached descriptor is reused only while the path
        still names the same file (blobs are immutable, but a key may be rewritten).
        """
        path = self._path(key)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise BlobNotFoundError(f"{self.url}/{key} does not exist") from None
        slot = f"{key}\0direct" if direct else key
        with self._fd_lock:
            cached = self._read_fds.get(slot)
            if cached is not None and cached[1] == (st.st_dev, st.st_ino):
                self._read_fds.move_to_end(slot)
                return cached[0]
            if cached is not None:
                os.close(cached[0])
                del self._read_fds[slot]
            try:
                fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            except FileNotFoundError:
                raise BlobNotFoundError(f"{self.url}/{key} does not exist") from None
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                self._direct_ok = False  # e.g. tmpfs: no O_DIRECT at all
                fd = os.open(path, os.O_RDONLY)
                slot = key
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            self._read_fds[slot] = (fd, (st.st_dev, st.st_ino))
            while len(self._read_fds) > _MAX_READ_FDS:
                os.close(self._read_fds.popitem(last=False)[1][0])
            return fd

    def close(self) -> None:
        with self._fd_lock:
            for fd, _ in self._read_fds.values():
                os.close(fd)
            self._read_fds.clear()

    def size(self, key: str) -> int | None:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            return None

    def delete(self, key: str) -> None:
        with self._fd_lock:
            for slot in (key, f"{key}\0direct"):
                cached = self._read_fds.pop(slot, None)
                if cached is not None:
                    os.close(cached[0])
        self._path(key).unlink(missing_ok=True)

    def list(self, prefix: str = "") -> list[str]:
        base = self.root
        keys = []
        for dirpath, _dirs, files in os.walk(base):
            rel = Path(dirpath).relative_to(base)
            for name in files:
                if _TMP_MARK in name:
                    continue
                key = name if rel == Path(".") else f"{rel.as_posix()}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def list_unfinished(self, prefix: str = "") -> builtins.list[str]:
        """Temp files of writes that never committed (a crash leaves them)."""
        return sorted(k for k in self._list_all() if k.startswith(prefix) and _TMP_MARK in k)

    def _list_all(self) -> builtins.list[str]:
        out = []
        for dirpath, _dirs, files in os.walk(self.root):
            rel = Path(dirpath).relative_to(self.root)
            out += [n if rel == Path(".") else f"{rel.as_posix()}/{n}" for n in files]
        return out

    def remove_unfinished(self, prefix: str = "") -> int:
        """Delete leftover temp files under ``prefix``; only safe with a single writer."""
        stale = self.list_unfinished(prefix)
        for key in stale:
            (self.root / key).unlink(missing_ok=True)
        return len(stale)


# ---------------------------------------------------------------------- S3
class _S3Writer(BlobWriter):
    """Buffers up to one part; small objects become one PUT, large ones a multipart upload."""

    def __init__(self, store: S3Store, key: str) -> None:
        self.key = key
        self.bytes_written = 0
        self._store = store
        self._object_key = store._object_key(key)
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []
        self._done = False

    def write(self, data: Any) -> None:
        assert not self._done, "write after commit/abort"
        view = memoryview(data).cast("B")
        self._buffer += view
        self.bytes_written += len(view)
        cfg = self._store.config
        if self._upload_id is None and len(self._buffer) >= cfg.multipart_threshold:
            resp = self._store.client.create_multipart_upload(
                Bucket=self._store.bucket, Key=self._object_key)
            self._upload_id = resp["UploadId"]
        if self._upload_id is not None:
            while len(self._buffer) >= cfg.multipart_chunksize:
                self._upload_part(cfg.multipart_chunksize)

    def _upload_part(self, nbytes: int) -> None:
        body = bytes(self._buffer[:nbytes])
        del self._buffer[:nbytes]
        number = len(self._parts) + 1
        resp = self._store.client.upload_part(
            Bucket=self._store.bucket, Key=self._object_key, UploadId=self._upload_id,
            PartNumber=number, Body=body)
        self._parts.append({"PartNumber": number, "ETag": resp["ETag"]})

    def commit(self) -> int:
        assert not self._done, "commit after commit/abort"
        client, bucket = self._store.client, self._store.bucket
        try:
            if self._upload_id is None:
                client.put_object(Bucket=bucket, Key=self._object_key, Body=bytes(self._buffer))
            else:
                if self._buffer or not self._parts:
                    self._upload_part(len(self._buffer))
                client.complete_multipart_upload(
                    Bucket=bucket, Key=self._object_key, UploadId=self._upload_id,
                    MultipartUpload={"Parts": self._parts})
        except BaseException:
            self.abort()
            raise
        self._done = True
        self._buffer = bytearray()
        return self.bytes_written

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self._buffer = bytearray()
        if self._upload_id is not None:
            try:
                self._store.client.abort_multipart_upload(
                    Bucket=self._store.bucket, Key=self._object_key, UploadId=self._upload_id)
            except Exception:  # the upload stays invisible either way; S3 lifecycle reaps it
                logger.warning("could not abort multipart upload of %s", self.key, exc_info=True)


class S3Store(ShadowStore):
    """An S3 bucket and key prefix, through boto3 (imported on first use).

    Args:
        url: ``s3://bucket/prefix``.
        config: endpoint, region and multipart sizes.
        client: a ready boto3 S3 client (tests, custom sessions); built from
            ``config`` when ``None``.
    """

    scheme = "s3"

    def __init__(self, url: str, config: StoreConfig | None = None, client: Any = None) -> None:
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ShadowStoreError(f"S3Store needs an s3://bucket/prefix URL, got {url!r}")
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        self.url = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self.config = config or StoreConfig()
        self._client = client
        self._client_lock = threading.Lock()

    @property
    def client(self) -> Any:
        with self._client_lock:
            if self._client is None:
                try:
                    import boto3
                except ImportError:
                    raise ShadowStoreError(
                        "s3:// shadow stores need boto3: pip install 'contextkit[shadow]'"
                    ) from None
                self._client = boto3.client("s3", endpoint_url=self.config.endpoint_url,
                                            region_name=self.config.region_name)
            return self._client

    def _object_key(self, key: str) -> str:
        _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    @staticmethod
    def _missing(exc: Exception) -> bool:
        code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
        return code in ("404", "NoSuchKey", "NotFound")

    def put(self, key: str, data: Any) -> None:
        # One PUT is atomic on S3: readers see the old object or the new one.
        self.client.put_object(Bucket=self.bucket, Key=self._object_key(key),
                               Body=bytes(memoryview(data).cast("B")))

    def open_writer(self, key: str) -> BlobWriter:
        return _S3Writer(self, key)

    def get(self, key: str) -> bytes:
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self._object_key(key))
        except Exception as exc:
            if self._missing(exc):
                raise BlobNotFoundError(f"{self.url}/{key} does not exist") from None
            raise
        body: bytes = resp["Body"].read()
        return body

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        view = memoryview(buffer).cast("B")
        if not len(view):
            return 0
        size = self.size(key)
        if size is None:
            raise BlobNotFoundError(f"{self.url}/{key} does not exist")
        end = min(size, offset + len(view))
        if end <= offset:
            return 0
        resp = self.client.get_object(Bucket=self.bucket, Key=self._object_key(key),
                                      Range=f"bytes={offset}-{end - 1}")
        stream = resp["Body"]
        total = 0
        while total < end - offset:
            chunk = stream.read(min(8 * 1024 * 1024, end - offset - total))
            if not chunk:
                break
            view[total:total + len(chunk)] = chunk
            total += len(chunk)
        return total

    def size(self, key: str) -> int | None:
        try:
            resp = self.client.head_object(Bucket=self.bucket, Key=self._object_key(key))
        except Exception as exc:
            if self._missing(exc):
                return None
            raise
        return int(resp["ContentLength"])

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._object_key(key))

    def list(self, prefix: str = "") -> list[str]:
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        keys = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full):
            keys += [obj["Key"][strip:] for obj in page.get("Contents", [])]
        return sorted(keys)

    def close(self) -> None:
        with self._client_lock:
            self._client = None


# ---------------------------------------------------------------------- wrappers
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

    def size(self, key: str) -> int | None:
        return self.inner.size(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)
        with self._lock:
            self.deleted.append(key)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def close(self) -> None:
        self.inner.close()


#: URL scheme -> store class. Adding a backend is one line here.
STORES: dict[str, type[ShadowStore]] = {
    "file": LocalStore,
    "s3": S3Store,
}


def open_store(url: str, config: StoreConfig | None = None) -> ShadowStore:
    """The store serving ``url`` (a plain path means ``file://``).

    Raises:
        ShadowStoreError: an unknown scheme (the message lists the known ones).
    """
    scheme = urlparse(url).scheme or "file"
    try:
        cls = STORES[scheme]
    except KeyError:
        known = ", ".join(f"{s}://" for s in sorted(STORES))
        raise ShadowStoreError(f"no shadow store for {url!r}; use one of: {known}") from None
    return cls(url, config)  # type: ignore[call-arg]
