"""shadow: crash-safe cold-tier shadow of the TQ4 block cache to NVMe (file://) or S3.

Stores are picked by URL scheme; sessions are described by an atomically replaced
manifest over immutable segment blobs, never rewritten under a name; recovery checks
that the manifest is the newest generation the store records (:mod:`shadow.freshness`),
verifies every block (a keyed MAC with ``CONTEXTKIT_SHADOW_KEY`` set, CRC-32 without)
and restores blocks into the host tier, re-pinning stable prefixes.
"""

from shadow._errors import (
    BlobNotFoundError,
    BlobTooLargeError,
    CorruptShadowError,
    InvalidKeyError,
    InvalidSessionIdError,
    RollbackShadowError,
    ShadowError,
    ShadowStoreError,
    TamperedShadowError,
    UnauthenticatedShadowError,
)
from shadow.auth import KEY_ENV, describe_auth, resolve_key
from shadow.manifest import Manifest, SessionInfo, validate_session_id
from shadow.records import BlockRecord, SegmentRecord
from shadow.recovery import (
    RecoveryReport,
    SkippedBlock,
    discover_sessions,
    load_manifest,
    recover_session,
    recover_sessions,
)
from shadow.stores import (
    STORES,
    BlobWriter,
    LocalStore,
    MeteredStore,
    S3Store,
    ShadowStore,
    StoreConfig,
    open_store,
)
from shadow.writer import CacheShadow, ShadowConfig, ShadowResult

__all__ = [
    "KEY_ENV",
    "STORES",
    "BlobNotFoundError",
    "BlobTooLargeError",
    "BlobWriter",
    "BlockRecord",
    "CacheShadow",
    "CorruptShadowError",
    "InvalidKeyError",
    "InvalidSessionIdError",
    "LocalStore",
    "Manifest",
    "MeteredStore",
    "RecoveryReport",
    "RollbackShadowError",
    "S3Store",
    "SegmentRecord",
    "SessionInfo",
    "ShadowConfig",
    "ShadowError",
    "ShadowResult",
    "ShadowStore",
    "ShadowStoreError",
    "SkippedBlock",
    "StoreConfig",
    "TamperedShadowError",
    "UnauthenticatedShadowError",
    "describe_auth",
    "discover_sessions",
    "load_manifest",
    "open_store",
    "recover_session",
    "recover_sessions",
    "resolve_key",
    "validate_session_id",
]
