"""MemoryGraph: episodic, semantic and entity memories with typed edges and hybrid search.

Nodes and typed, weighted edges live in a ``networkx.MultiDiGraph`` (edge key =
edge type, node attribute ``data`` = the :class:`Node`), which also answers the
neighbourhood reads of query expansion; each tenant's embeddings live in one
contiguous unit-norm matrix (:class:`~memory_graph._index.VectorIndex`). Writes go
through to the SQL store at once; access statistics are buffered and written by
:meth:`MemoryGraph.flush` (and on close) so queries never wait on the database.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
from sqlalchemy import Engine

from memory_graph._embedding import Embedder, SentenceTransformerEmbedder, normalize_rows
from memory_graph._errors import UnknownNodeError
from memory_graph._index import IndexConfig, VectorIndex
from memory_graph._store import GraphStore

__all__ = [
    "DEFAULT_TENANT",
    "Edge",
    "GraphConfig",
    "MemoryGraph",
    "Node",
    "NodeKind",
    "QueryHit",
    "RerankWeights",
]

logger = logging.getLogger(__name__)

DEFAULT_TENANT = "default"


class NodeKind(str, enum.Enum):
    """What a memory node records."""

    EPISODIC = "episodic"  # something that happened
    SEMANTIC = "semantic"  # a fact or preference
    ENTITY = "entity"  # a person, place, project...


@dataclass(slots=True)
class Node:
    """A memory node (the embedding lives in the tenant's vector index)."""

    node_id: str
    tenant: str
    kind: NodeKind
    text: str
    created_at: float
    access_count: int = 0
    last_accessed: float | None = None


@dataclass(frozen=True, slots=True)
class Edge:
    """A typed, weighted edge ``src -> dst`` (expansion follows it both ways)."""

    src: str
    dst: str
    edge_type: str
    weight: float
    created_at: float


@dataclass(frozen=True, slots=True)
class RerankWeights:
    """How :meth:`MemoryGraph.hybrid_query` combines its signals.

    ``score = similarity * cos(query, node) + edge * path_weight + recency * 0.5 **
    (age / recency_half_life_s)``, where ``path_weight`` is the product of the edge
    weights on the path from the seed (1 for seeds) and ``age`` counts from the
    node's ``created_at``.
    """

    similarity: float = 1.0
    edge: float = 0.3
    recency: float = 0.1
    recency_half_life_s: float = 7 * 24 * 3600.0

    def __post_init__(self) -> None:
        if self.recency_half_life_s <= 0:
            raise ValueError(f"recency_half_life_s must be > 0, got {self.recency_half_life_s}")


@dataclass(frozen=True, slots=True)
class GraphConfig:
    """Settings of a :class:`MemoryGraph`.

    Args:
        weights: rerank weights.
        max_neighbors_per_node: heaviest edges followed from each node.
        max_expanded: bound on nodes brought in by expansion per query.
        index: vector index settings.
    """

    weights: RerankWeights = dataclasses.field(default_factory=RerankWeights)
    max_neighbors_per_node: int = 16
    max_expanded: int = 256
    index: IndexConfig = dataclasses.field(default_factory=IndexConfig)


@dataclass(frozen=True, slots=True)
class QueryHit:
    """One node returned by :meth:`MemoryGraph.hybrid_query`.

    ``path`` lists node ids from the seed (a vector hit) to this node, and
    ``edge_types`` the edges taken; a seed has ``path == (node_id,)``.
    """

    node: Node
    score: float
    similarity: float
    path_weight: float
    recency: float
    hops: int
    path: tuple[str, ...]
    edge_types: tuple[str, ...]

    @property
    def node_id(self) -> str:
        return self.node.node_id

    @property
    def text(self) -> str:
        return self.node.text


def _copy(node: Node) -> Node:
    return Node(node.node_id, node.tenant, node.kind, node.text, node.created_at,
                node.access_count, node.last_accessed)


def _kind(kind: NodeKind | str) -> NodeKind:
    try:
        return NodeKind(kind)
    except ValueError:
        raise ValueError(f"kind must be one of {[k.value for k in NodeKind]}, got {kind!r}") \
            from None


class MemoryGraph:
    """Graph memory with vector + graph hybrid retrieval, persisted through SQLAlchemy.

    Args:
        store: where to persist: a SQLite file path, an SQLAlchemy URL (e.g.
            ``postgresql+psycopg://...`` for shared deployments) or an ``Engine``;
            ``None`` keeps the graph in memory only. An existing store is loaded.
        embedder: text embedder; ``None`` loads the packaged all-MiniLM-L6-v2.
        config: retrieval settings.
        clock: wall clock (seconds) for ``created_at`` and recency; injectable for tests.

    Raises:
        GraphStoreError: ``store`` is not a readable database.
        IncompatibleGraphStoreError: ``store`` holds something else, another schema,
            or vectors of another embedding model.
    """

    def __init__(
        self,
        store: str | Path | Engine | None = None,
        *,
        embedder: Embedder | None = None,
        config: GraphConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.embedder: Embedder = embedder or SentenceTransformerEmbedder()
        self.config = config or GraphConfig()
        self.clock = clock
        self.dim = int(self.embedder.dim)
        self._graph: nx.MultiDiGraph = nx.MultiDiGraph()
        self._indexes: dict[str, VectorIndex] = {}
        self._dirty_access: set[str] = set()
        self._lock = threading.RLock()
        self._store: GraphStore | None = None
        if store is not None:
            self._store = GraphStore(store, model_id=self.embedder.model_id, dim=self.dim)
            self._load()

    # ------------------------------------------------------------------ lifecycle
    def _load(self) -> None:
        assert self._store is not None
        stored = self._store.load()
        by_tenant: dict[str, list[int]] = {}
        for i, row in enumerate(stored.nodes):
            node = Node(row.node_id, row.tenant, _kind(row.kind), row.text, row.created_at,
                        row.access_count, row.last_accessed)
            self._graph.add_node(row.node_id, data=node)
            by_tenant.setdefault(row.tenant, []).append(i)
        for tenant, rows in by_tenant.items():
            self._index_for(tenant).add([stored.nodes[i].node_id for i in rows],
                                        stored.embeddings[rows])
        for e in stored.edges:
            self._graph.add_edge(e.src, e.dst, key=e.edge_type, weight=e.weight,
                                 created_at=e.created_at)
        logger.info("loaded memory graph from %s: %d nodes, %d edges", self._store.where,
                    len(stored.nodes), len(stored.edges))

    def flush(self) -> None:
        """Write buffered access statistics to the store."""
        with self._lock:
            if self._store is None or not self._dirty_access:
                self._dirty_access.clear()
                return
            stats = []
            for nid in self._dirty_access:
                if nid in self._graph:
                    node = self._node(nid)
                    stats.append((nid, node.access_count, node.last_accessed))
            self._store.update_access(stats)
            self._dirty_access.clear()

    def close(self) -> None:
        """Flush access statistics and close the store (idempotent)."""
        with self._lock:
            if self._store is not None:
                self.flush()
                self._store.close()
                self._store = None

    def __enter__(self) -> MemoryGraph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ inspection
    @property
    def nx_graph(self) -> nx.MultiDiGraph:
        """The underlying graph (read it, do not mutate it): node attr ``data`` is a Node."""
        return self._graph

    def __len__(self) -> int:
        return self._graph.number_of_nodes()

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._graph

    def num_nodes(self, tenant: str | None = None) -> int:
        if tenant is None:
            return len(self)
        index = self._indexes.get(tenant)
        return 0 if index is None else len(index)

    def num_edges(self) -> int:
        return self._graph.number_of_edges()

    def tenants(self) -> list[str]:
        return sorted(t for t, idx in self._indexes.items() if len(idx))

    def _node(self, node_id: str) -> Node:
        try:
            return self._graph.nodes[node_id]["data"]
        except KeyError:
            raise UnknownNodeError(f"no node {node_id!r} in this memory graph; add it first") \
                from None

    def get_node(self, node_id: str, tenant: str | None = None) -> Node:
        """A copy of a node.

        Raises:
            UnknownNodeError: no such node, or it belongs to another tenant.
        """
        with self._lock:
            node = self._node(node_id)
            if tenant is not None and node.tenant != tenant:
                raise UnknownNodeError(f"no node {node_id!r} for tenant {tenant!r}")
            return _copy(node)

    def nodes(self, tenant: str = DEFAULT_TENANT) -> list[Node]:
        """Copies of a tenant's nodes in insertion order."""
        with self._lock:
            index = self._indexes.get(tenant)
            return [] if index is None else [_copy(self._node(n)) for n in index.ids]

    def embedding(self, node_id: str) -> np.ndarray:
        """The node's unit embedding ``[dim]`` (a copy)."""
        with self._lock:
            node = self._node(node_id)
            return self._indexes[node.tenant].vectors([node_id])[0]

    def edges(self, node_id: str | None = None) -> list[Edge]:
        """Edges touching ``node_id`` (both directions), or all edges."""
        with self._lock:
            if node_id is None:
                raw: Iterable[Any] = self._graph.edges(keys=True, data=True)
            else:
                self._node(node_id)
                raw = [*self._graph.out_edges(node_id, keys=True, data=True),
                       *self._graph.in_edges(node_id, keys=True, data=True)]
            return [Edge(u, v, k, d["weight"], d["created_at"]) for u, v, k, d in raw]

    def vector_index(self, tenant: str = DEFAULT_TENANT) -> VectorIndex | None:
        """The tenant's vector index (read it, do not mutate it), or ``None``."""
        return self._indexes.get(tenant)

    def _index_for(self, tenant: str) -> VectorIndex:
        index = self._indexes.get(tenant)
        if index is None:
            index = self._indexes[tenant] = VectorIndex(self.dim, self.config.index)
        return index

    # ------------------------------------------------------------------ writes
    def add_node(
        self,
        text: str,
        *,
        tenant: str = DEFAULT_TENANT,
        kind: NodeKind | str = NodeKind.EPISODIC,
        node_id: str | None = None,
        created_at: float | None = None,
    ) -> str:
        """Embed and add one node; returns its id (a new UUID unless given)."""
        return self.add_nodes([text], tenant=tenant, kinds=kind,
                              node_ids=None if node_id is None else [node_id],
                              created_at=created_at)[0]

    def add_nodes(
        self,
        texts: Sequence[str],
        *,
        tenant: str = DEFAULT_TENANT,
        kinds: NodeKind | str | Sequence[NodeKind | str] = NodeKind.EPISODIC,
        node_ids: Sequence[str] | None = None,
        created_at: float | Sequence[float] | None = None,
        embeddings: np.ndarray | None = None,
    ) -> list[str]:
        """Add many nodes in one embedding batch and one transaction.

        Args:
            texts: node texts.
            tenant: owner; queries of other tenants never see these nodes.
            kinds: one kind for all, or one per text.
            node_ids: ids to use (default: new UUIDs).
            created_at: one timestamp, one per text, or ``None`` for now.
            embeddings: precomputed ``[n, dim]`` vectors of ``texts`` from this graph's
                embedder (rows are normalised); ``None`` embeds the texts.

        Returns:
            The node ids, in order.

        Raises:
            ValueError: mismatched lengths, an empty text or an id already present.
        """
        num = len(texts)
        if not tenant:
            raise ValueError("tenant must be a non-empty string")
        if any(not t or not t.strip() for t in texts):
            raise ValueError("node texts must be non-empty")
        kind_list = ([_kind(kinds)] * num if isinstance(kinds, (str, NodeKind))
                     else [_kind(k) for k in kinds])
        ids = [uuid.uuid4().hex for _ in range(num)] if node_ids is None else list(node_ids)
        now = self.clock()
        if created_at is None:
            stamps = [now] * num
        elif isinstance(created_at, (int, float)):
            stamps = [float(created_at)] * num
        else:
            stamps = [float(c) for c in created_at]
        if not len(kind_list) == len(ids) == len(stamps) == num:
            raise ValueError(f"got {num} texts, {len(kind_list)} kinds, {len(ids)} ids and "
                             f"{len(stamps)} timestamps; pass one per text")
        if embeddings is None:
            vecs = self.embedder.encode(list(texts))
        else:
            vecs = normalize_rows(embeddings)
        if vecs.shape != (num, self.dim):
            raise ValueError(f"embeddings must be [{num}, {self.dim}], got {vecs.shape}")
        with self._lock:
            clash = [i for i in ids if i in self._graph]
            if clash or len(set(ids)) != num:
                raise ValueError(f"node ids already present: {clash[:5] or 'duplicates'}; "
                                 "use new ids")
            if self._store is not None:
                self._store.add_nodes([
                    {"node_id": nid, "tenant": tenant, "kind": k.value, "text": t,
                     "embedding": v.tobytes(), "created_at": c, "access_count": 0,
                     "last_accessed": None}
                    for nid, k, t, v, c in zip(ids, kind_list, texts, vecs, stamps, strict=True)
                ])
            self._index_for(tenant).add(ids, vecs)
            for nid, k, t, c in zip(ids, kind_list, texts, stamps, strict=True):
                self._graph.add_node(nid, data=Node(nid, tenant, k, t, c))
        return ids

    def add_edge(self, src: str, dst: str, edge_type: str, weight: float = 1.0) -> None:
        """Add (or reweight) a typed edge between two nodes of the same tenant."""
        self.add_edges([(src, dst, edge_type, weight)])

    def add_edges(self, edges: Iterable[tuple[str, str, str, float]]) -> None:
        """Add (or reweight) many ``(src, dst, edge_type, weight)`` edges in one transaction.

        Raises:
            UnknownNodeError: an endpoint is missing.
            ValueError: endpoints of different tenants, a weight outside (0, 1] or
                an empty edge type.
        """
        batch = list(edges)
        now = self.clock()
        with self._lock:
            rows: list[dict[str, Any]] = []
            for src, dst, edge_type, weight in batch:
                a, b = self._node(src), self._node(dst)
                if a.tenant != b.tenant:
                    raise ValueError(f"edge {src}->{dst} joins tenants {a.tenant!r} and "
                                     f"{b.tenant!r}; edges stay within one tenant")
                if not 0.0 < weight <= 1.0 or not edge_type:
                    raise ValueError(f"edge {src}->{dst}: weight must be in (0, 1] and the "
                                     f"type non-empty, got {weight!r} and {edge_type!r}")
                rows.append({"src": src, "dst": dst, "edge_type": edge_type,
                             "weight": float(weight), "tenant": a.tenant, "created_at": now})
            if self._store is not None:
                self._store.add_edges(rows)
            for r in rows:
                self._graph.add_edge(r["src"], r["dst"], key=r["edge_type"],
                                     weight=r["weight"], created_at=now)

    def remove_node(self, node_id: str) -> None:
        """Delete a node and its edges."""
        with self._lock:
            node = self._node(node_id)
            if self._store is not None:
                self._store.remove_node(node_id)
            self._indexes[node.tenant].remove(node_id)
            self._graph.remove_node(node_id)
            self._dirty_access.discard(node_id)

    # ------------------------------------------------------------------ retrieval
    def hybrid_query(
        self,
        query: str,
        k: int = 10,
        hops: int = 1,
        tenant: str = DEFAULT_TENANT,
        *,
        limit: int | None = None,
        edge_types: Iterable[str] | None = None,
        weights: RerankWeights | None = None,
    ) -> list[QueryHit]:
        """Vector top-k, then expansion over typed edges, then rerank.

        Args:
            query: text to search for.
            k: nearest nodes by cosine similarity (the seeds).
            hops: edge hops followed from the seeds (0 = vector search only);
                bounded by ``config.max_neighbors_per_node`` and ``config.max_expanded``.
            tenant: only this tenant's nodes are searched and returned.
            limit: return at most this many hits (default: all candidates).
            edge_types: follow only these edge types (default: all).
            weights: rerank weights for this call (default: ``config.weights``).

        Returns:
            Hits best first; each records its score parts and the path that
            brought it in. Returned nodes' access stats are updated.
        """
        if k < 0 or hops < 0:
            raise ValueError(f"k and hops must be >= 0, got {k} and {hops}")
        index = self._indexes.get(tenant)
        if index is None or not len(index) or k == 0:
            return []
        q = self.embedder.encode([query])[0]
        return self.query_by_vector(q, k, hops, tenant, limit=limit, edge_types=edge_types,
                                    weights=weights)

    def query_by_vector(
        self,
        query_vector: np.ndarray,
        k: int = 10,
        hops: int = 1,
        tenant: str = DEFAULT_TENANT,
        *,
        limit: int | None = None,
        edge_types: Iterable[str] | None = None,
        weights: RerankWeights | None = None,
    ) -> list[QueryHit]:
        """:meth:`hybrid_query` with an already embedded query (unit ``[dim]``)."""
        w = weights or self.config.weights
        allowed = None if edge_types is None else frozenset(edge_types)
        q = np.asarray(query_vector, dtype=np.float32).reshape(self.dim)
        with self._lock:
            index = self._indexes.get(tenant)
            if index is None or not len(index) or k == 0:
                return []
            seed_ids, _ = index.search(q, k)
            found = self._expand(seed_ids, hops, tenant, allowed)
            ids = list(found)
            sims = index.similarities(q, ids)
            now = self.clock()
            data = self._graph.nodes
            nodes = [data[n]["data"] for n in ids]
            created = np.fromiter((n.created_at for n in nodes), dtype=np.float64,
                                  count=len(ids))
            recency = np.power(0.5, np.maximum(now - created, 0.0) / w.recency_half_life_s)
            path_w = np.fromiter((found[n][2] for n in ids), dtype=np.float64, count=len(ids))
            scores = w.similarity * sims + w.edge * path_w + w.recency * recency
            order = np.argsort(-scores, kind="stable")
            if limit is not None:
                order = order[:limit]
            hits = []
            for i in order.tolist():
                nid = ids[i]
                node = nodes[i]
                node.access_count += 1
                node.last_accessed = now
                self._dirty_access.add(nid)
                path, etypes, pw = found[nid]
                hits.append(QueryHit(
                    node=_copy(node), score=float(scores[i]),
                    similarity=float(sims[i]), path_weight=float(pw),
                    recency=float(recency[i]), hops=len(etypes), path=path, edge_types=etypes,
                ))
            return hits

    def _neighbors(self, node_id: str) -> list[tuple[float, str, str]]:
        """``(weight, other, edge type)`` over edges in both directions, heaviest first."""
        graph = self._graph
        nbrs = [(w, dst, key) for _, dst, key, w in
                graph.out_edges(node_id, keys=True, data="weight")]
        nbrs += [(w, src, key) for src, _, key, w in
                 graph.in_edges(node_id, keys=True, data="weight")]
        nbrs.sort(key=lambda n: -n[0])
        return nbrs

    def _expand(
        self, seeds: list[str], hops: int, tenant: str, allowed: frozenset[str] | None,
    ) -> dict[str, tuple[tuple[str, ...], tuple[str, ...], float]]:
        """Breadth-first expansion: node -> (path, edge types, path weight).

        A node keeps its first (fewest hops) path; among paths of the same length
        the heaviest wins.
        """
        found: dict[str, tuple[tuple[str, ...], tuple[str, ...], float]] = {
            s: ((s,), (), 1.0) for s in seeds
        }
        budget = self.config.max_expanded
        per_node = self.config.max_neighbors_per_node
        frontier = list(seeds)
        for _ in range(hops):
            level: dict[str, tuple[tuple[str, ...], tuple[str, ...], float]] = {}
            for nid in frontier:
                path, etypes, pw = found[nid]
                nbrs = self._neighbors(nid)
                if allowed is not None:
                    nbrs = [n for n in nbrs if n[2] in allowed]
                nbrs = nbrs[:per_node]
                for weight, other, key in nbrs:
                    if other in found:
                        continue
                    cand = pw * weight
                    prev = level.get(other)
                    if prev is None or cand > prev[2]:
                        if prev is None and len(level) >= budget:
                            continue
                        level[other] = ((*path, other), (*etypes, key), cand)
            if not level:
                break
            # belt and braces: edges never join tenants (add_edges refuses it)
            level = {n: v for n, v in level.items() if self._node(n).tenant == tenant}
            found.update(level)
            budget -= len(level)
            frontier = list(level)
            if budget <= 0:
                break
        return found
