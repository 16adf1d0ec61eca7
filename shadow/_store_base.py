"""The store interface: :class:`StoreConfig`, :class:`BlobWriter`, :class:`ShadowStore`.

Backends live in :mod:`shadow._local` and :mod:`shadow._s3`; :mod:`shadow.stores`
re-exports everything and picks a backend by URL scheme (:func:`shadow.stores.open_store`).
"""

from __future__ import annotations

import abc
import builtins
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar

from shadow._errors import BlobNotFoundError, BlobTooLargeError, ShadowStoreError

__all__ = ["S3_MIN_PART_BYTES", "S3_RETRY_MODES", "BlobWriter", "ShadowStore", "StoreConfig",
           "check_key"]

#: S3 refuses multipart parts below 5 MiB (except the last one).
S3_MIN_PART_BYTES = 5 * 1024 * 1024
#: botocore's retry modes (``StoreConfig.retry_mode``).
S3_RETRY_MODES = ("standard", "adaptive", "legacy")


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
        retry_mode: botocore's retry mode of the S3 client: ``"standard"``,
            ``"adaptive"`` (client-side rate limiting too) or ``"legacy"``.
        max_attempts: S3 attempts per request, the first one included.
        connect_timeout_s: seconds to open a connection to the S3 endpoint.
        read_timeout_s: seconds to wait for data on an open S3 connection.
        max_pool_connections: the S3 client's connection pool size; at least the
            number of threads that share one store (the shared tier's ``io_threads``).
    """

    fsync: bool = True
    endpoint_url: str | None = None
    region_name: str | None = None
    multipart_threshold: int = 64 * 1024 * 1024
    multipart_chunksize: int = 16 * 1024 * 1024
    direct_io: bool = True
    retry_mode: str = "standard"
    max_attempts: int = 3
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    max_pool_connections: int = 10

    def __post_init__(self) -> None:
        if self.retry_mode not in S3_RETRY_MODES:
            raise ValueError(f"retry_mode must be one of {', '.join(S3_RETRY_MODES)}, got "
                             f"{self.retry_mode!r}")
        for name in ("max_attempts", "max_pool_connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("connect_timeout_s", "read_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
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

    def get_limited(self, key: str, limit: int) -> bytearray:
        """The whole object when it holds at most ``limit`` bytes; its size is checked
        before it is read, and no more than ``limit`` bytes are ever read.

        Raises:
            BlobNotFoundError: no object under ``key``.
            BlobTooLargeError: the object is larger than ``limit``.
        """
        size = self.size(key)
        if size is None:
            raise BlobNotFoundError(f"{self.url}/{key} does not exist")
        if size > limit:
            raise BlobTooLargeError(f"{self.url}/{key} holds {size} bytes, more than "
                                    f"{limit}", size)
        buf = bytearray(size)
        n = self.read_into(key, 0, memoryview(buf))
        del buf[n:]  # shorter now: replaced since its size was read
        return buf

    def list_sizes(self, prefix: str = "") -> builtins.list[tuple[str, int]]:
        """:meth:`list` with each object's size (S3 answers both in one listing)."""
        out = []
        for key in self.list(prefix):
            size = self.size(key)
            if size is not None:  # deleted since the listing
                out.append((key, size))
        return out

    def put_file(self, key: str, chunks: Iterable[Any]) -> int:
        """Stream ``chunks`` into one object (multipart on S3); returns its size."""
        with self.open_writer(key) as writer:
            for chunk in chunks:
                writer.write(chunk)
            return writer.commit()

    def delete_many(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.delete(key)

    def list_uploads(self, prefix: str = "") -> builtins.list[tuple[str, str, float]]:
        """Incomplete multipart uploads as ``(key, upload id, started at Unix time)``.

        Stores without multipart uploads have none.
        """
        return []

    def abort_upload(self, key: str, upload_id: str) -> None:  # noqa: B027 - optional
        """Abort an incomplete multipart upload (see :meth:`list_uploads`)."""

    def close(self) -> None:  # noqa: B027 - optional hook, most stores hold nothing
        """Release clients and handles; idempotent."""

    def __enter__(self) -> ShadowStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def check_key(key: str) -> None:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts) \
            or "\\" in key or "\x00" in key:
        raise ShadowStoreError(f"store key {key!r} is not a relative '/'-separated name")
