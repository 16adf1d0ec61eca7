"""``s3://bucket/prefix`` stores through boto3 (imported on first use)."""

from __future__ import annotations

import builtins
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlparse

from shadow._errors import BlobNotFoundError, BlobTooLargeError, ShadowError, ShadowStoreError
from shadow._store_base import BlobWriter, ShadowStore, StoreConfig, check_key

__all__ = ["S3Store", "client_config"]

logger = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])
_DENIED = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403",
           "ExpiredToken", "InvalidToken")


def store_error(exc: BaseException, url: str, what: str) -> ShadowStoreError | None:
    """A one-line :class:`ShadowStoreError` saying what to set or fix, for the botocore
    failures a user causes (no credentials, unreachable endpoint, missing bucket, denied);
    ``None`` for anything else."""
    name = type(exc).__name__
    detail = " ".join(str(exc).split())[:160]
    if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
        return ShadowStoreError(
            f"no AWS credentials for {url}; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(or AWS_PROFILE, or an instance role)")
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                "ConnectionClosedError", "InvalidEndpointURL"):
        return ShadowStoreError(
            f"cannot reach the S3 endpoint of {url} ({detail}); check --endpoint-url "
            "(AWS_ENDPOINT_URL) and the network")
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
        if code == "NoSuchBucket":
            return ShadowStoreError(f"S3 bucket of {url} does not exist; create it or fix the "
                                    "URL")
        if code in _DENIED:
            return ShadowStoreError(f"S3 {what} of {url} was denied ({code}); check the "
                                    "credentials and the bucket policy")
        return ShadowStoreError(f"S3 {what} of {url} failed ({detail})")
    if type(exc).__module__.startswith(("botocore", "urllib3")):
        return ShadowStoreError(f"S3 {what} of {url} failed ({detail})")
    return None


def _s3_errors(what: str) -> Callable[[_F], _F]:
    """Turn botocore failures of an S3 call into one-line :class:`ShadowStoreError`."""
    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def inner(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except ShadowError:
                raise
            except Exception as exc:
                url = self.url if isinstance(self, S3Store) else self._store.url
                err = store_error(exc, url, what)
                if err is None:
                    raise
                raise err from None
        return inner  # type: ignore[return-value]
    return wrap


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

    @_s3_errors("write")
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

    @_s3_errors("commit")
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


def client_config(config: StoreConfig) -> Any:
    """The ``botocore.config.Config`` of a store's S3 client: retry mode and attempts,
    connect and read timeouts, connection pool size (needs boto3)."""
    from botocore.config import Config

    return Config(retries={"mode": config.retry_mode, "total_max_attempts": config.max_attempts},
                  connect_timeout=config.connect_timeout_s, read_timeout=config.read_timeout_s,
                  max_pool_connections=config.max_pool_connections)


class S3Store(ShadowStore):
    """An S3 bucket and key prefix, through boto3 (imported on first use).

    Args:
        url: ``s3://bucket/prefix``.
        config: endpoint, region, multipart sizes, retries, timeouts and pool size.
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
                                            region_name=self.config.region_name,
                                            config=client_config(self.config))
            return self._client

    def _object_key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    @staticmethod
    def _missing(exc: Exception) -> bool:
        code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
        return code in ("404", "NoSuchKey", "NotFound")

    @_s3_errors("put")
    def put(self, key: str, data: Any) -> None:
        # One PUT is atomic on S3: readers see the old object or the new one.
        self.client.put_object(Bucket=self.bucket, Key=self._object_key(key),
                               Body=bytes(memoryview(data).cast("B")))

    def open_writer(self, key: str) -> BlobWriter:
        return _S3Writer(self, key)

    @_s3_errors("get")
    def get(self, key: str) -> bytes:
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self._object_key(key))
        except Exception as exc:
            if self._missing(exc):
                raise BlobNotFoundError(f"{self.url}/{key} does not exist") from None
            raise
        body: bytes = resp["Body"].read()
        return body

    @_s3_errors("get")
    def get_limited(self, key: str, limit: int) -> bytearray:
        # one ranged GET: the answer's Content-Range gives the size, so an object
        # larger than the limit costs at most limit + 1 bytes
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=self._object_key(key),
                                          Range=f"bytes=0-{limit}")
        except Exception as exc:
            if self._missing(exc):
                raise BlobNotFoundError(f"{self.url}/{key} does not exist") from None
            code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
            if code in ("InvalidRange", "416"):  # an empty object has no byte 0
                return bytearray()
            raise
        total = resp.get("ContentRange", "").rpartition("/")[2]
        size = int(total) if total.isdigit() else int(resp.get("ContentLength", 0))
        if size > limit:
            resp["Body"].close()
            raise BlobTooLargeError(f"{self.url}/{key} holds {size} bytes, more than "
                                    f"{limit}", size)
        buf = bytearray(size)
        view, n = memoryview(buf), 0
        while n < size:
            chunk = resp["Body"].read(min(8 << 20, size - n))
            if not chunk:
                break
            view[n:n + len(chunk)] = chunk
            n += len(chunk)
        del view
        del buf[n:]
        return buf

    @_s3_errors("read")
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

    @_s3_errors("head")
    def size(self, key: str) -> int | None:
        try:
            resp = self.client.head_object(Bucket=self.bucket, Key=self._object_key(key))
        except Exception as exc:
            if self._missing(exc):
                return None
            raise
        return int(resp["ContentLength"])

    @_s3_errors("delete")
    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._object_key(key))

    def list(self, prefix: str = "") -> list[str]:
        return [key for key, _ in self.list_sizes(prefix)]

    @_s3_errors("listing")
    def list_sizes(self, prefix: str = "") -> builtins.list[tuple[str, int]]:
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full):
            out += [(obj["Key"][strip:], int(obj["Size"])) for obj in page.get("Contents", [])]
        return sorted(out)

    @_s3_errors("listing of multipart uploads")
    def list_uploads(self, prefix: str = "") -> builtins.list[tuple[str, str, float]]:
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        out = []
        for page in self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=full):
            for up in page.get("Uploads", []):
                out.append((up["Key"][strip:], up["UploadId"], up["Initiated"].timestamp()))
        return sorted(out)

    @_s3_errors("abort of a multipart upload")
    def abort_upload(self, key: str, upload_id: str) -> None:
        self.client.abort_multipart_upload(Bucket=self.bucket, Key=self._object_key(key),
                                           UploadId=upload_id)

    def close(self) -> None:
        with self._client_lock:
            self._client = None
