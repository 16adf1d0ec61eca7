"""memory_graph: graph memory (networkx + sentence-transformers + SQLAlchemy) and
the GraphBlockReserver that reserves tiered-cache blocks for what a query found.

Imports gpu_cache; never contextkit.
"""

from memory_graph._embedding import (
    DEFAULT_EMBEDDING_MODEL_ID,
    Embedder,
    SentenceTransformerEmbedder,
    default_model_dir,
    normalize_rows,
)
from memory_graph._errors import (
    EmbeddingModelNotFoundError,
    GraphStoreError,
    IncompatibleGraphStoreError,
    MemoryGraphError,
    UnknownNodeError,
    UnknownReservationError,
)
from memory_graph._index import IndexConfig, VectorIndex
from memory_graph._store import STORE_SCHEMA_VERSION
from memory_graph.graph import (
    DEFAULT_TENANT,
    Edge,
    GraphConfig,
    MemoryGraph,
    Node,
    NodeKind,
    QueryHit,
    RerankWeights,
)
from memory_graph.layer import memories_layer_lines
from memory_graph.reserver import (
    GraphBlockReserver,
    NodeBlocks,
    PrefillFn,
    ReservationResult,
    ReservationState,
    ReserverConfig,
    ReserverStats,
)

__all__ = [
    "DEFAULT_EMBEDDING_MODEL_ID",
    "DEFAULT_TENANT",
    "STORE_SCHEMA_VERSION",
    "Edge",
    "Embedder",
    "EmbeddingModelNotFoundError",
    "GraphBlockReserver",
    "GraphConfig",
    "GraphStoreError",
    "IncompatibleGraphStoreError",
    "IndexConfig",
    "MemoryGraph",
    "MemoryGraphError",
    "Node",
    "NodeBlocks",
    "NodeKind",
    "PrefillFn",
    "QueryHit",
    "RerankWeights",
    "ReservationResult",
    "ReservationState",
    "ReserverConfig",
    "ReserverStats",
    "SentenceTransformerEmbedder",
    "UnknownNodeError",
    "UnknownReservationError",
    "VectorIndex",
    "default_model_dir",
    "memories_layer_lines",
    "normalize_rows",
]
