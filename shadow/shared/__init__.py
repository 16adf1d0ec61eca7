"""The live shared tier: KV chunks every replica of a model reads and writes while it
serves, authenticated, named by content, with retention by meaning per tenant.

- :mod:`.objects`: one object (a chunk of blocks) and its MAC;
- :mod:`.tier`: lookups, loads and write-behind uploads with deadlines;
- :mod:`.retention`: expiry, leases and per-tenant budgets.
"""

from shadow.shared.objects import (
    BlockEntry,
    PoolPart,
    SharedChunk,
    SharedObjectError,
    chunk_path,
    decode_chunk,
    encode_chunk,
)
from shadow.shared.retention import CollectReport, collect
from shadow.shared.tier import SharedTier, SharedTierConfig, SharedTierError, default_writer_id

__all__ = [
    "BlockEntry",
    "CollectReport",
    "PoolPart",
    "SharedChunk",
    "SharedObjectError",
    "SharedTier",
    "SharedTierConfig",
    "SharedTierError",
    "chunk_path",
    "collect",
    "decode_chunk",
    "default_writer_id",
    "encode_chunk",
]
