"""The live shared tier: chunks of KV blocks in one object store that every replica of
a model reads and writes while it serves (S3 through boto3: AWS, MinIO, Ceph, moto;
or ``file://`` on a shared filesystem).

A replica that stores a block makes it findable by the others once its chunk's PUT
lands (the *lag*); a replica that misses locally asks for the chunks of the prompt by
name (:func:`~shadow.shared.objects.chunk_path`, the key of the chunk's last block: a
HEAD to find, a GET to load), in
parallel, and gives up past a deadline (the request then recomputes). Objects are
authenticated (:mod:`shadow.shared.objects`); retention is :mod:`shadow.shared.retention`.

Chunks are aligned on the prompt: chunk ``j`` holds blocks ``j*C .. j*C+C-1`` (``C``:
``chunk_blocks``) and is written only once all ``C`` are held; its name (the last
block's key) chains every token up to its end, so a name never holds two different
contents (any two writers of a name write the same blocks).
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import hmac
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gpu_cache import CacheIdentity
from shadow._errors import BlobNotFoundError, BlobTooLargeError, ShadowError, ShadowStoreError
from shadow._fields import check_seconds
from shadow._store_base import ShadowStore, StoreConfig
from shadow.auth import KEY_STEP, resolve_key
from shadow.shared.objects import (
    MAC_BYTES,
    MAX_LEASE_BYTES,
    MAX_SPAN_BLOCKS,
    PREFIX_BYTES,
    Lease,
    ObjectHeader,
    SharedChunk,
    SharedObjectError,
    SpanRecord,
    check_reader,
    chunk_path,
    decode_chunk,
    decode_lease,
    encode_chunk,
    encode_lease,
    header_length,
    max_object_bytes,
    model_tag,
    parse_header,
    read_header,
    span_path,
    tenant_tag,
)
from shadow.stores import open_store

__all__ = ["FoundSpan", "SharedTier", "SharedTierConfig", "SharedTierError",
           "default_writer_id", "lease_runs", "read_lease", "read_signed_header"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: HEADs in a probe's first batch (each next batch doubles): a cross-replica turn
#: typically finds a chunk or two past the DDR hit, and every request costs a few
#: milliseconds of CPU on each side however small its answer.
PROBE_FIRST_BATCH = 4


class SharedTierError(ShadowError, ValueError):
    """The shared tier is misconfigured (named, with what to do)."""


def default_writer_id() -> str:
    """This process's name as a writer of the tier: host and pid."""
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True, slots=True)
class SharedTierConfig:
    """Options of :class:`SharedTier`.

    Args:
        url: ``s3://bucket/prefix`` or ``file:///shared/path``.
        endpoint_url: S3-compatible endpoint (MinIO, Ceph, moto); None: boto3's default.
        chunk_blocks: blocks per object. Fewer: more requests per prompt; more: a
            prompt's last ``chunk_blocks - 1`` blocks are shared less often.
        deadline_s: a lookup or a load that takes longer gives up (the request
            recomputes what it did not get).
        max_age_s: objects not referenced by a live writer are collected after this
            long.
        pinned_max_age_s: the same for chunks holding a pinned block.
        tenant_budget_bytes: collection deletes a tenant's least valuable objects
            beyond this many bytes (unpinned first, then by importance and age).
        lease_s: a writer's lease (the chunks it holds, which collection keeps) lasts
            this long unless renewed.
        io_threads: parallel requests of one lookup or load.
        max_pending_bytes: write-behind memory: uploads beyond it are dropped
            (counted), never queued without bound.
    """

    url: str
    endpoint_url: str | None = None
    chunk_blocks: int = 4
    deadline_s: float = 1.0
    max_age_s: float = 24 * 3600.0
    pinned_max_age_s: float = 7 * 24 * 3600.0
    tenant_budget_bytes: int = 4 << 30
    lease_s: float = 300.0
    io_threads: int = 8
    max_pending_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        if not self.url:
            raise SharedTierError("the shared tier needs a url: s3://bucket/prefix or "
                                  "file:///shared/path")
        for name in ("chunk_blocks", "io_threads", "tenant_budget_bytes",
                     "max_pending_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SharedTierError(f"shared tier {name} must be an int >= 1, got "
                                      f"{getattr(self, name)!r}")
        for name in ("deadline_s", "max_age_s", "pinned_max_age_s", "lease_s"):
            try:
                check_seconds(f"shared tier {name}", getattr(self, name), positive=True)
            except ValueError as exc:
                raise SharedTierError(str(exc)) from None


@dataclass
class Counters:
    """Requests and bytes since the last :meth:`SharedTier.take_counters`."""

    heads: int = 0
    gets: int = 0
    puts: int = 0
    lists: int = 0
    bytes_down: int = 0
    bytes_up: int = 0
    deduplicated: int = 0
    deadline_misses: int = 0
    errors: int = 0
    refused: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in vars(self).items() if k != "refused"}
        out.update({f"refused_{k}": v for k, v in self.refused.items()})
        return out


def read_lease(store: ShadowStore, path: str, mac_key: bytes) -> Lease:
    """The lease at ``path``, verified (:func:`~shadow.shared.objects.decode_lease`),
    read only when it is at most :data:`~shadow.shared.objects.MAX_LEASE_BYTES` long.

    Raises:
        BlobNotFoundError: none there.
        SharedObjectError: ``oversize``, ``corrupt`` or ``tampered``.
        ShadowStoreError: the store failed.
    """
    try:
        data = store.get_limited(path, MAX_LEASE_BYTES)
    except BlobTooLargeError as exc:
        raise SharedObjectError("oversize", str(exc)) from None
    return decode_lease(data, mac_key, path)


def read_signed_header(store: ShadowStore, path: str, mac_key: bytes,
                       first_read: int = 16384) -> tuple[int, ObjectHeader]:
    """The header of the object at ``path``, its MAC verified and every field checked,
    read without its body (a ranged read, a second one for a long header). Returns
    the header's length and the header.

    Raises:
        BlobNotFoundError: no object there.
        SharedObjectError: ``corrupt`` or ``tampered``.
        ShadowStoreError: the store failed.
    """
    buf = bytearray(first_read)
    head = memoryview(buf)[:store.read_into(path, 0, memoryview(buf))]
    n = header_length(head)  # bounded: at most MAX_HEADER_BYTES
    need = PREFIX_BYTES + n + MAC_BYTES
    if need > len(head):
        buf = bytearray(need)
        head = memoryview(buf)[:store.read_into(path, 0, memoryview(buf))]
    return n, parse_header(read_header(head, mac_key))


@dataclass(frozen=True, slots=True)
class FoundSpan:
    """A span object found in the tier (its header only): the span and the keys of
    the blocks holding it, as its writer stored them."""

    path: str
    span: SpanRecord
    block_keys: list[bytes]


def lease_runs(lease: Lease, now: float, config: SharedTierConfig) -> bool:
    """Whether ``lease`` holds at ``now``: not past, and not further ahead than
    ``lease_s`` or ``max_age_s``, whichever is longer (no one write keeps a chunk for
    ever)."""
    return now <= lease.expires_at <= now + max(config.lease_s, config.max_age_s)


class SharedTier:
    """One replica's handle on the shared tier of one key identity.

    Args:
        identity: the key identity (the model, block size and key codec): objects of
            another are refused; every name starts with its digest.
        config: where and how.
        mac_key: the deployment's key; None reads ``$CONTEXTKIT_SHADOW_KEY``. Every
            replica must hold the same one. Required: the tier serves nothing
            unauthenticated.
        writer: this writer's name in its leases (default: host and pid).
        store: a ready store (tests); opened from ``config`` when None.

    Raises:
        SharedTierError: no key, or a store that cannot be opened.
    """

    def __init__(self, identity: CacheIdentity, config: SharedTierConfig, *,
                 mac_key: bytes | str | None = None, writer: str | None = None,
                 store: ShadowStore | None = None) -> None:
        key = resolve_key(mac_key)
        if key is None:
            raise SharedTierError(f"the shared tier needs a MAC key shared by every "
                                  f"replica: {KEY_STEP} on each of them")
        self.identity = identity
        self.config = config
        self.writer = writer or default_writer_id()
        self._key = key
        self._model = model_tag(identity)
        #: no object at a chunk's name is larger: bigger ones are refused unread
        self.max_object_bytes = max_object_bytes(identity, config.chunk_blocks)
        #: the same for span objects
        self.max_span_bytes = max_object_bytes(identity, MAX_SPAN_BLOCKS)
        self._tags: dict[str, str] = {}  # tenant -> its keyed tag
        try:
            self.store = store or open_store(
                config.url, StoreConfig(endpoint_url=config.endpoint_url, fsync=False))
        except ShadowStoreError as exc:
            raise SharedTierError(f"cannot open the shared tier {config.url}: {exc}") from None
        self._pool = cf.ThreadPoolExecutor(max_workers=config.io_threads,
                                           thread_name_prefix="contextkit-shared")
        self._lock = threading.Lock()
        self._counters = Counters()
        #: names known to be in the tier (found or written): no HEAD before a PUT
        self._known: OrderedDict[str, None] = OrderedDict()

    # ------------------------------------------------------------------ names
    def _tag(self, tenant: str) -> str:
        tag = self._tags.get(tenant)
        if tag is None:  # one HMAC per tenant, not per name
            tag = self._tags[tenant] = tenant_tag(self._key, tenant)
        return tag

    def path(self, tenant: str, last_key: bytes) -> str:
        """The name of the chunk whose last block has key ``last_key``."""
        return chunk_path(self._model, self._tag(tenant), last_key)

    def span_path(self, tenant: str, content: bytes) -> str:
        """The name of the span object whose content key is ``content``."""
        return span_path(self._model, self._tag(tenant), content)

    @property
    def lease_prefix(self) -> str:
        return f"{self._model}/leases/"

    @property
    def tenants_prefix(self) -> str:
        return f"{self._model}/t/"

    # ------------------------------------------------------------------ accounting
    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                setattr(self._counters, name, getattr(self._counters, name) + n)

    def _refuse(self, reason: str) -> None:
        with self._lock:
            self._counters.refused[reason] = self._counters.refused.get(reason, 0) + 1

    def take_counters(self) -> dict[str, Any]:
        """Requests, bytes, refusals and deadline misses since the last call."""
        with self._lock:
            out, self._counters = self._counters, Counters()
        return out.as_dict()

    def _remember(self, path: str) -> None:
        with self._lock:
            self._known[path] = None
            self._known.move_to_end(path)
            while len(self._known) > 65536:
                self._known.popitem(last=False)

    def _is_known(self, path: str) -> bool:
        with self._lock:
            return path in self._known

    def holds(self, path: str) -> bool:
        """Whether this replica found or wrote ``path`` (no request)."""
        return self._is_known(path)

    def _forget(self, path: str) -> None:
        with self._lock:
            self._known.pop(path, None)

    # ------------------------------------------------------------------ lookups
    def _head(self, path: str) -> bool:
        self._count(heads=1)
        try:
            found = self.store.size(path) is not None
        except ShadowStoreError as exc:
            self._count(errors=1)
            logger.warning("shared tier lookup of %s failed: %s", path, exc)
            return False
        if found:
            self._remember(path)
        return found

    def probe(self, tenant: str, last_keys: Sequence[bytes],
              deadline_s: float | None = None) -> int:
        """How many of the chunks named by their last block's key, in order, the tier
        holds: the length of the leading run found. HEADs go in parallel batches that
        double from :data:`PROBE_FIRST_BATCH`, stopping at the batch with a miss: the
        tail of a prompt no replica has seen (most of a new turn) costs one batch, not
        a request per chunk. Past the deadline, what was found by then counts and the
        rest is a miss (counted)."""
        end = time.monotonic() + (deadline_s or self.config.deadline_s)
        found, batch = 0, PROBE_FIRST_BATCH
        while found < len(last_keys):
            futures = [self._pool.submit(self._head, self.path(tenant, k))
                       for k in last_keys[found:found + batch]]
            done, pending = cf.wait(futures, timeout=max(0.0, end - time.monotonic()))
            if pending:
                self._count(deadline_misses=1)
            for f in futures:
                if f not in done or not f.result():
                    return found
                found += 1
            batch *= 2
        return found

    def _get(self, path: str, tenant: str, limit: int | None = None) -> SharedChunk | None:
        try:
            return self._load(path, tenant, limit or self.max_object_bytes)
        except Exception as exc:  # a bug or an object no check foresaw: never the forward's
            self._refuse("corrupt")
            logger.exception("shared tier object %s refused (%s); the request recomputes",
                             path, type(exc).__name__)
            return None

    def _load(self, path: str, tenant: str, limit: int) -> SharedChunk | None:
        self._count(gets=1)
        try:
            data = self.store.get_limited(path, limit)
        except BlobNotFoundError:
            self._forget(path)
            return None
        except BlobTooLargeError as exc:
            self._refuse("oversize")
            logger.error("shared tier object %s refused unread: %d bytes, at most %d for "
                         "this model; the request recomputes", path, exc.size, limit)
            return None
        except ShadowStoreError as exc:
            self._count(errors=1)
            logger.warning("shared tier load of %s failed: %s", path, exc)
            return None
        self._count(bytes_down=len(data))
        try:
            chunk = decode_chunk(data, self._key, path=path, identity=self.identity,
                                 tenant=tenant)
        except SharedObjectError as exc:
            self._refuse(exc.reason)
            logger.error("shared tier object refused (%s): %s; the request recomputes",
                         exc.reason, exc)
            return None
        self._remember(path)
        return chunk

    def fetch(self, tenant: str, last_keys: Sequence[bytes],
              deadline_s: float | None = None) -> list[SharedChunk]:
        """The verified chunks named by ``last_keys``: the leading run of them that
        was found, verified and read before the deadline (GETs in parallel). A
        refused object (tampered, replayed, foreign) ends the run there."""
        if not last_keys:
            return []
        paths = [self.path(tenant, k) for k in last_keys]
        futures = [self._pool.submit(self._get, p, tenant) for p in paths]
        done, pending = cf.wait(futures, timeout=deadline_s or self.config.deadline_s)
        if pending:
            self._count(deadline_misses=1)
        chunks: list[SharedChunk] = []
        for f in futures:
            chunk = f.result() if f in done else None
            if chunk is None:
                break
            chunks.append(chunk)
        return chunks

    # ------------------------------------------------------------------ spans
    def find_spans(self, tenant: str, contents: Sequence[bytes],
                   deadline_s: float | None = None) -> dict[bytes, FoundSpan]:
        """The span objects of ``tenant`` among these content keys, from their headers
        alone (read in parallel, the header MAC verified; the body is verified when a
        load fetches it). Past the deadline, what was read by then counts."""
        return self._gather(lambda c: self._span_header(tenant, c), contents, deadline_s)

    def fetch_spans(self, tenant: str, contents: Sequence[bytes],
                    deadline_s: float | None = None) -> dict[bytes, SharedChunk]:
        """The verified span objects of these content keys (their blocks and spans),
        read in parallel within one deadline; what is missing, refused or late is
        left out."""
        return self._gather(
            lambda c: self._get(self.span_path(tenant, c), tenant, self.max_span_bytes),
            contents, deadline_s)

    def _gather(self, read: Callable[[bytes], T | None], contents: Sequence[bytes],
                deadline_s: float | None) -> dict[bytes, T]:
        """``read`` of each content key in parallel, within the deadline (a miss past
        it counted once); what it found, by content key."""
        if not contents:
            return {}
        futures = {self._pool.submit(read, c): c for c in contents}
        done, pending = cf.wait(futures, timeout=deadline_s or self.config.deadline_s)
        if pending:
            self._count(deadline_misses=1)
        return {futures[f]: got for f in done if (got := f.result()) is not None}

    def _span_header(self, tenant: str, content: bytes) -> FoundSpan | None:
        path = self.span_path(tenant, content)
        self._count(gets=1)
        try:
            _, header = read_signed_header(self.store, path, self._key)
            check_reader(header, path, self._tag(tenant), self.identity)
        except BlobNotFoundError:
            return None
        except SharedObjectError as exc:
            self._refuse(exc.reason)
            logger.error("shared tier span refused (%s): %s", exc.reason, exc)
            return None
        except Exception as exc:  # a store error or a bug: a miss, never the scheduler's
            self._count(errors=1)
            logger.warning("shared tier span lookup of %s failed: %s", path, exc)
            return None
        assert header.span is not None  # check_reader: a span object at a span's name
        return FoundSpan(path, header.span, [b.key for b in header.blocks])

    # ------------------------------------------------------------------ writes
    def put(self, chunk: SharedChunk) -> bool:
        """Upload a chunk unless the tier holds its name already (deduplicated: one
        HEAD, none when this replica found or wrote it before). Returns whether it
        was uploaded."""
        if self._is_known(chunk.path) or self._head(chunk.path):
            self._count(deduplicated=1)
            return False
        chunk.writer = self.writer
        data = encode_chunk(chunk, self._key)
        try:
            self.store.put(chunk.path, data)
        except ShadowStoreError as exc:
            self._count(errors=1)
            logger.warning("shared tier upload of %s failed: %s", chunk.path, exc)
            return False
        self._count(puts=1, bytes_up=len(data))
        self._remember(chunk.path)
        return True

    def write_lease(self, chunks: Mapping[str, str], now: float | None = None) -> None:
        """Record the chunks this writer holds (name -> tenant), for ``lease_s`` seconds:
        collection keeps them (:func:`~shadow.shared.retention.collect`), and a replica
        that starts warms its DDR tier with them (:meth:`leased`). Tenants are sealed
        (AES-GCM under the deployment key): a lease never spells a tenant's salt. The
        lease carries a MAC: collection trusts no other."""
        now = time.time() if now is None else now
        path = self.lease_prefix + self.writer
        lease = Lease(self.writer, now + self.config.lease_s, sorted(chunks),
                      {name: self._seal(tenant) for name, tenant in chunks.items()})
        self._count(puts=1)
        try:
            self.store.put(path, encode_lease(lease, self._key, path))
        except ShadowStoreError as exc:
            self._count(errors=1)
            logger.warning("shared tier lease of %s failed: %s", self.writer, exc)

    def release_lease(self) -> None:
        """Delete this writer's lease (a clean stop: it holds nothing any more, so its
        chunks are collectable on age and no starting replica warms from them)."""
        try:
            self.store.delete(self.lease_prefix + self.writer)  # a missing one is no error
        except ShadowStoreError as exc:
            self._count(errors=1)
            logger.warning("shared tier: releasing the lease of %s failed: %s", self.writer,
                           exc)

    @property
    def mac_key(self) -> bytes:
        """The deployment's key (collection verifies headers and leases with it)."""
        return self._key

    def read_lease(self, path: str, now: float) -> Lease | None:
        """The lease at ``path`` if it is authentic and runs at ``now``; None otherwise."""
        self._count(gets=1)
        try:
            lease = read_lease(self.store, path, self._key)
        except (BlobNotFoundError, SharedObjectError):
            return None
        return lease if lease_runs(lease, now, self.config) else None

    def leased(self, now: float | None = None) -> list[tuple[str, str, bytes]]:
        """Every live writer's leased chunks as ``(name, tenant, last key)``, newest
        lease first (one listing of the leases; a lease that cannot be read, verified
        or unsealed is skipped)."""
        now = time.time() if now is None else now
        out: list[tuple[float, str, str, bytes]] = []
        try:
            keys = self.store.list(self.lease_prefix)
        except ShadowStoreError as exc:
            logger.warning("shared tier leases unreadable: %s", exc)
            return []
        self._count(lists=1)
        for key in keys:
            lease = self.read_lease(key, now)
            if lease is None:
                continue
            for path, box in lease.tenants.items():
                tenant = self._unseal(box)
                last = path.rsplit("/", 1)[-1]
                try:
                    last_key = bytes.fromhex(last)
                except ValueError:
                    continue
                if tenant is not None and self.path(tenant, last_key) == path:
                    out.append((lease.expires_at, path, tenant, last_key))
        out.sort(key=lambda x: -x[0])
        unique: dict[str, tuple[str, str, bytes]] = {}
        for _, path, tenant, last_key in out:
            unique.setdefault(path, (path, tenant, last_key))
        return list(unique.values())

    def _aead(self) -> Any:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        return AESGCM(hmac.new(self._key, b"contextkit shared-tier lease tenants",
                               hashlib.sha256).digest())

    def _seal(self, tenant: str) -> str:
        nonce = os.urandom(12)
        return (nonce + self._aead().encrypt(nonce, tenant.encode(), self._model.encode())).hex()

    def _unseal(self, box: str) -> str | None:
        try:
            raw = bytes.fromhex(box)
            return str(self._aead().decrypt(raw[:12], raw[12:], self._model.encode()).decode())
        except Exception:
            return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.store.close()
