"""gpu_cache: TurboQuant TQ4 codec, kernels and a tiered, semantically evicted block cache.

Imports nothing from the other contextkit packages.
"""

from gpu_cache._errors import (
    BlockStateError,
    CacheIdentityError,
    CodecInputError,
    GPUCacheError,
    InvalidNameError,
    PinCapacityError,
    UnknownBlockError,
)
from gpu_cache.cache import TENSOR_NAMES, CacheConfig, LayerView, TQGPUCache
from gpu_cache.codebook import Codebook, lloyd_max_codebook
from gpu_cache.codec import TQ4Codec, TQ4Encoded, rotation_matrix
from gpu_cache.format_specs import FORMATS, PRECISION_RANK, bytes_per_token_head, check_format
from gpu_cache.hashing import BlockHash, hash_block_tokens, hash_token_blocks
from gpu_cache.identity import SCHEMA_VERSION, CacheIdentity
from gpu_cache.ids import validate_name, validate_tenant
from gpu_cache.metadata import (
    DEFAULT_SOURCE_PRIORITY,
    EVICTION_POLICIES,
    PINNABLE_SOURCES,
    PINNED_PRIORITY,
    BlockMeta,
    BlockMetadataTable,
    EvictionPolicy,
    LRUEvictionPolicy,
    SemanticEvictionPolicy,
    Tier,
)
from gpu_cache.pinning import PrefixPinManager
from gpu_cache.requests import BlockAnnotation, RequestBlockManager, RequestBlocks

__all__ = [
    "DEFAULT_SOURCE_PRIORITY",
    "EVICTION_POLICIES",
    "FORMATS",
    "PINNABLE_SOURCES",
    "PINNED_PRIORITY",
    "PRECISION_RANK",
    "SCHEMA_VERSION",
    "TENSOR_NAMES",
    "BlockAnnotation",
    "BlockHash",
    "BlockMeta",
    "BlockMetadataTable",
    "BlockStateError",
    "CacheConfig",
    "CacheIdentity",
    "CacheIdentityError",
    "Codebook",
    "CodecInputError",
    "EvictionPolicy",
    "GPUCacheError",
    "InvalidNameError",
    "LRUEvictionPolicy",
    "LayerView",
    "PinCapacityError",
    "PrefixPinManager",
    "RequestBlockManager",
    "RequestBlocks",
    "SemanticEvictionPolicy",
    "TQ4Codec",
    "TQ4Encoded",
    "TQGPUCache",
    "Tier",
    "UnknownBlockError",
    "bytes_per_token_head",
    "check_format",
    "hash_block_tokens",
    "hash_token_blocks",
    "lloyd_max_codebook",
    "rotation_matrix",
    "validate_name",
    "validate_tenant",
]
