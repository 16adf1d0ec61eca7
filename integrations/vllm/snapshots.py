"""The connector's sessions as stored: the local snapshot and the shadow, read-only.

Every pool of the connector's store (see :mod:`.pools`) has one session in the shadow
store (``session_id``, ``session_id@<format>[.<digest8>]``) and one in the local
snapshot that ``contextkit recover --for-vllm`` writes (``vllm-recovered``,
``vllm-recovered@<format>[.<digest8>]``). These functions read them without a store.
"""

from __future__ import annotations

import logging

from gpu_cache import CacheIdentity, CacheIdentityError
from integrations.vllm.config import ConnectorConfig
from integrations.vllm.identity import same_model
from integrations.vllm.pools import server_sessions
from shadow import Manifest, ShadowError, StoreConfig, load_manifest, open_store

__all__ = ["LOCAL_SESSION", "local_session_keys", "shadow_manifest", "shadow_manifests"]

logger = logging.getLogger(__name__)

#: Session name of the verified snapshot ``contextkit recover --for-vllm`` writes
#: (the key identity's pool; the other pools append ``@<format>...``).
LOCAL_SESSION = "vllm-recovered"


def local_session_keys(local_store: str, identity: CacheIdentity) -> list[bytes]:
    """Keys of every snapshot session in ``local_store`` of ``identity``'s model (any
    format; empty if absent or for another model). The scheduler seeds its index with
    them."""
    if not local_store:
        return []
    store = open_store(local_store)
    keys: list[bytes] = []
    try:
        for sid in server_sessions(store, LOCAL_SESSION):
            try:
                manifest = load_manifest(store, sid)
            except (ShadowError, CacheIdentityError) as exc:
                logger.warning("snapshot %s in %s unreadable (%s); not seeded", sid,
                               local_store, exc)
                continue
            if same_model(identity, manifest.identity):
                continue  # the worker refuses it too (and says why)
            keys.extend(bytes.fromhex(b.key) for b in manifest.blocks if b.key is not None)
    except ShadowError as exc:
        logger.warning("local store %s unreadable (%s); starting cold", local_store, exc)
        return []
    finally:
        store.close()
    return keys


def shadow_manifests(config: ConnectorConfig) -> list[Manifest]:
    """The committed manifests of every shadow session of this server (its
    ``session_id`` and the ``session_id@<format>...`` sessions of its other pools),
    read-only, the plain session first; empty without a shadow or before the first
    commit.

    Raises:
        shadow.ShadowError, gpu_cache.CacheIdentityError: a manifest exists but cannot
            be read or trusted (e.g. a format this contextkit does not know).
    """
    from shadow import BlobNotFoundError, ShadowStoreError

    if not config.shadow_url:
        return []
    try:
        store = open_store(config.shadow_url, StoreConfig(endpoint_url=config.endpoint_url),
                           create=False)
    except ShadowStoreError:
        return []  # a file:// shadow not created yet
    out = []
    try:
        for sid in server_sessions(store, config.session_id):
            try:
                out.append(load_manifest(store, sid))
            except BlobNotFoundError:
                continue  # removed since listed
    finally:
        store.close()
    return out


def shadow_manifest(config: ConnectorConfig) -> Manifest | None:
    """The connector's last committed shadow of its store, read-only (another process
    may be serving): one record per stored block with its key, source layer,
    importance, tenant and pin flag. None when the config has no shadow or nothing
    has been shadowed yet.

    With several pools (block formats) this is ONE merged manifest: the blocks of all
    of :func:`shadow_manifests`, with the identity, key offsets and segments of the
    plain session (or the first) and, as its generation, the sum of the sessions'
    generations (it grows with every commit of any of them, so a watcher sees each save
    land); read each session's own from :func:`shadow_manifests`. With a single
    session it is that session's manifest.

    With ``shadow_on_save`` (the default) the connector shadows after every save, so
    this is its store as of the last save: what an operator or a test can inspect
    while vLLM runs. Block keys are :func:`gpu_cache.hash_token_blocks` of the
    request's tokens, salted with its ``cache_salt``.

    Raises:
        shadow.ShadowError: a manifest exists but cannot be read or trusted.
    """
    manifests = shadow_manifests(config)
    if not manifests:
        return None
    first = manifests[0]
    if len(manifests) == 1:
        return first
    return Manifest(
        session_id=first.session_id, identity=first.identity,
        generation=sum(m.generation for m in manifests), segments=list(first.segments),
        blocks=[b for m in manifests for b in m.blocks], next_segment=first.next_segment,
        created_at=min(m.created_at for m in manifests),
        updated_at=max(m.updated_at for m in manifests), key_offsets=first.key_offsets,
        authenticated=all(m.authenticated for m in manifests))
