"""Content-addressed block keys: a SHA-256 chain over identity, tenant and tokens."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType

__all__ = ["BlockHash", "hash_block_tokens", "hash_token_blocks"]

BlockHash = NewType("BlockHash", bytes)

_ROOT_PARENT = b"\x00" * 32


def hash_block_tokens(
    identity_digest: bytes,
    tenant: str,
    parent: BlockHash | None,
    token_ids: Sequence[int],
) -> BlockHash:
    """Key of one block: ``sha256(identity | tenant | parent | token ids)``.

    The parent key chains blocks, so a key names the whole prefix up to and
    including this block. The tenant is length-prefixed so no concatenation of
    tenant and tokens can collide with another.
    """
    tenant_bytes = tenant.encode("utf-8")
    h = hashlib.sha256()
    h.update(identity_digest)
    h.update(struct.pack("<I", len(tenant_bytes)))
    h.update(tenant_bytes)
    h.update(parent if parent is not None else _ROOT_PARENT)
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return BlockHash(h.digest())


def hash_token_blocks(
    identity_digest: bytes,
    tenant: str,
    token_ids: Sequence[int],
    block_size: int,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Keys of every *full* block of ``token_ids``; a trailing partial block has none."""
    keys: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(identity_digest, tenant, parent,
                                   token_ids[start:start + block_size])
        keys.append(parent)
    return keys
