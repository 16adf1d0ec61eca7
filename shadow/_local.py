"""``file://`` stores: a local directory (e.g. on NVMe), temp files, fsync, ``os.replace``."""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import errno
import io
import os
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from shadow._errors import BlobNotFoundError, ShadowStoreError
from shadow._store_base import BlobWriter, ShadowStore, StoreConfig, check_key

__all__ = ["LocalStore", "fsync_dir", "is_temp_name"]

_TMP_MARK = ".tmp-"
#: The exact name of a temp file :class:`_LocalWriter` writes: ``<name>.tmp-<pid>-<8 hex>``.
#: Matched against a file's own name only, never against the directories above it, so
#: a session id such as ``agent.tmp-1`` is an ordinary name.
_TMP_NAME = re.compile(r".+\.tmp-[0-9]+-[0-9a-f]{8}")


def is_temp_name(name: str) -> bool:
    """Whether a file name is one of :class:`_LocalWriter`'s unfinished temp files."""
    return _TMP_NAME.fullmatch(name) is not None
_MAX_READ_FDS = 64
_PAGE = 4096  # O_DIRECT alignment of offsets, lengths and buffer addresses


def _aligned(view: memoryview, offset: int) -> bool:
    """Whether a read of ``view`` at ``offset`` meets O_DIRECT's alignment rules."""
    if offset % _PAGE or len(view) % _PAGE or view.readonly or not len(view):
        return False
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    return address % _PAGE == 0


#: What to do about the OS errors a store directory raises.
_ADVICE = {
    errno.ENOSPC: "free space on that filesystem, or point the shadow at another store",
    errno.EDQUOT: "raise the disk quota, free space, or point the shadow at another store",
    errno.EROFS: "the filesystem is read-only: mount it read-write (contextkit recover "
                 "reads a read-only store; --no-sweep skips its cleanup)",
    errno.EACCES: "check the permissions of the store directory",
    errno.EPERM: "check the permissions of the store directory",
    errno.EIO: "the disk reported an I/O error: check it (dmesg, smartctl)",
}


@contextlib.contextmanager
def store_errors(url: str, what: str, key: str) -> Iterator[None]:
    """Turn an ``OSError`` of a store operation into a one-line :class:`ShadowStoreError`
    naming the store, the object, the operation and what to do."""
    try:
        yield
    except FileNotFoundError:
        raise
    except OSError as exc:
        reason = exc.strerror or str(exc)
        code = errno.errorcode.get(exc.errno or 0, "")
        advice = _ADVICE.get(exc.errno or 0, "check the store directory and its filesystem")
        raise ShadowStoreError(f"cannot {what} {url}/{key}: {reason}"
                               f"{f' ({code})' if code else ''}; {advice}") from None


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename or new entry in it is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: A durable writer starts the disk's writeback every this many bytes (see _LocalWriter).
_WRITEBACK_BYTES = 16 * 1024 * 1024


class _LocalWriter(BlobWriter):
    """Writes ``<key>.tmp-<pid>-<token>``, then fsyncs and renames it onto ``key``.

    With ``fsync`` on, writeback of what was written is started every
    :data:`_WRITEBACK_BYTES` (``posix_fadvise(DONTNEED)`` starts it without waiting,
    and lets the pages go once clean: a shadow is not read back soon). Otherwise the
    kernel would hold gigabytes dirty until the final fsync, and the disk would sit idle
    while the shadow computes its checksums and MACs.
    """

    def __init__(self, store: LocalStore, key: str) -> None:
        self.key = key
        self.bytes_written = 0
        self._url = store.url
        self._final = store._path(key)
        self._tmp = self._final.with_name(
            f"{self._final.name}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
        self._fsync = store.config.fsync
        self._flushed = 0  # bytes whose writeback was started
        with store_errors(self._url, "write", key):
            self._final.parent.mkdir(parents=True, exist_ok=True)
            self._file: io.FileIO | None = open(self._tmp, "wb", buffering=0)  # noqa: SIM115

    def write(self, data: Any) -> None:
        assert self._file is not None, "write after commit/abort"
        view = memoryview(data).cast("B")
        with store_errors(self._url, "write", self.key):
            while view:  # raw files may write short
                n = self._file.write(view)
                assert n is not None
                view = view[n:]
                self.bytes_written += n
            if self._fsync and self.bytes_written - self._flushed >= _WRITEBACK_BYTES \
                    and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self._file.fileno(), self._flushed,
                                 self.bytes_written - self._flushed, os.POSIX_FADV_DONTNEED)
                self._flushed = self.bytes_written

    def commit(self) -> int:
        assert self._file is not None, "commit after commit/abort"
        f, self._file = self._file, None
        with store_errors(self._url, "write", self.key):
            try:
                if self._fsync:
                    os.fsync(f.fileno())
            finally:
                f.close()
            try:
                os.replace(self._tmp, self._final)
            except OSError:
                self._tmp.unlink(missing_ok=True)
                raise
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
        create: create the directory if it does not exist (writers). Readers pass
            ``False``: a mistyped path is then an error, not an empty store.

    Raises:
        ShadowStoreError: a URL naming a host, or (``create=False``) no such directory.
    """

    scheme = "file"

    def __init__(self, url: str, config: StoreConfig | None = None, *,
                 create: bool = True) -> None:
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
        if create:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ShadowStoreError(f"cannot create the shadow store {self.url} "
                                       f"({exc.strerror}); check the path and its "
                                       "permissions") from None
        elif not self.root.is_dir():
            raise ShadowStoreError(f"no shadow store at {self.url}; check the path (nothing "
                                   "has been shadowed there)")
        self._read_fds: OrderedDict[str, tuple[int, tuple[int, int]]] = OrderedDict()
        self._fd_lock = threading.Lock()
        self._direct_ok = self.config.direct_io and hasattr(os, "O_DIRECT")

    def _path(self, key: str) -> Path:
        check_key(key)
        return self.root.joinpath(*key.split("/"))

    def put(self, key: str, data: Any) -> None:
        with self.open_writer(key) as writer:
            writer.write(data)
            writer.commit()

    def open_writer(self, key: str) -> BlobWriter:
        return _LocalWriter(self, key)

    def get(self, key: str) -> bytes:
        try:
            with store_errors(self.url, "read", key):
                return self._path(key).read_bytes()
        except FileNotFoundError:
            raise BlobNotFoundError(f"{self.url}/{key} does not exist") from None

    def read_into(self, key: str, offset: int, buffer: memoryview) -> int:
        with store_errors(self.url, "read", key):
            return self._read_into(key, offset, buffer)

    def _read_into(self, key: str, offset: int, buffer: memoryview) -> int:
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
                return total + self._read_into(key, offset + total, view[total:])
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
            with store_errors(self.url, "stat", key):
                return self._path(key).stat().st_size
        except FileNotFoundError:
            return None

    def delete(self, key: str) -> None:
        with self._fd_lock:
            for slot in (key, f"{key}\0direct"):
                cached = self._read_fds.pop(slot, None)
                if cached is not None:
                    os.close(cached[0])
        with store_errors(self.url, "delete", key):
            self._path(key).unlink(missing_ok=True)

    def list(self, prefix: str = "") -> list[str]:
        base = self.root
        keys = []
        for dirpath, _dirs, files in os.walk(base):
            rel = Path(dirpath).relative_to(base)
            for name in files:
                if is_temp_name(name):
                    continue
                key = name if rel == Path(".") else f"{rel.as_posix()}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def list_unfinished(self, prefix: str = "") -> builtins.list[str]:
        """Temp files of writes that never committed (a crash leaves them)."""
        return sorted(k for k in self._list_all()
                      if k.startswith(prefix) and is_temp_name(k.rsplit("/", 1)[-1]))

    def age(self, key: str) -> float | None:
        """Seconds since ``key`` (a committed object or a temp file) was last written."""
        try:
            return max(0.0, time.time() - (self.root / key).stat().st_mtime)
        except FileNotFoundError:
            return None

    def _list_all(self) -> builtins.list[str]:
        out = []
        for dirpath, _dirs, files in os.walk(self.root):
            rel = Path(dirpath).relative_to(self.root)
            out += [n if rel == Path(".") else f"{rel.as_posix()}/{n}" for n in files]
        return out

    def remove_unfinished(self, prefix: str = "") -> int:
        """Delete leftover temp files under ``prefix``.

        Only for a prefix no live writer is writing under (a session's own writer at
        start, or :func:`shadow.debris.sweep_debris` for sessions without a live lease).
        """
        stale = self.list_unfinished(prefix)
        for key in stale:
            with store_errors(self.url, "delete", key):
                (self.root / key).unlink(missing_ok=True)
        return len(stale)
