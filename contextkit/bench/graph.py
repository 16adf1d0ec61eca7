"""Memory graph benchmark: hybrid query, reservation and ingest on a synthetic corpus.

The corpus is generated from templates with a fixed seed, so the same ``--nodes``
always gives the same texts and edges. Its embeddings are computed once and
cached under ``~/.cache/contextkit/bench-graph/`` keyed by corpus hash and model.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from contextkit.bench._common import positive_int

HELP = "memory graph: hybrid_query latency, reservation/warm latency, ingest rate"

__all__ = [
    "HELP",
    "SyntheticCorpus",
    "add_arguments",
    "cached_embeddings",
    "run",
    "synthetic_corpus",
]

CACHE_DIR = Path(os.path.expanduser("~/.cache/contextkit/bench-graph"))
EMBED_BATCH = 256

_FIRST = ["Ada", "Bruno", "Chen", "Dara", "Elif", "Farid", "Greta", "Hiro", "Ines", "Jonas",
          "Kemal", "Lena", "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tala",
          "Umar", "Vera", "Wen", "Ximena", "Yusuf", "Zoe", "Anton", "Bea", "Cyril", "Dina",
          "Emil", "Fatou", "Gus", "Hana", "Ivo", "Jia", "Kofi", "Lior", "Mira", "Nils"]
_LAST = ["Abara", "Berg", "Costa", "Dubois", "Eriksen", "Fischer", "Garcia", "Haddad", "Ito",
         "Jensen", "Kowalski", "Laine", "Moreau", "Novak", "Okafor", "Petrov", "Quist", "Rossi",
         "Sato", "Tanaka", "Ueda", "Varga", "Weber", "Xu", "Yilmaz", "Zhang", "Alves", "Brandt",
         "Chopra", "Diallo", "Esposito", "Falk", "Gomez", "Horvat", "Iqbal", "Juarez", "Kim",
         "Lund", "Mensah", "Nakamura"]
_CITIES = ["Paris", "Lagos", "Osaka", "Lima", "Oslo", "Cairo", "Quito", "Hanoi", "Dublin",
           "Nairobi", "Seoul", "Porto", "Austin", "Krakow", "Bogota", "Perth", "Riga", "Tunis",
           "Lyon", "Accra", "Manila", "Zurich", "Denver", "Sapporo", "Valencia", "Tbilisi"]
_ROLES = ["data engineer", "nurse", "violin teacher", "product manager", "geologist", "chef",
          "pilot", "architect", "marine biologist", "tax advisor", "bike mechanic",
          "translator", "pharmacist", "game designer", "beekeeper", "librarian"]
_VERBS = ["reviewed", "repaired", "presented", "cancelled", "booked", "rewrote", "tested",
          "shipped", "discussed", "postponed", "measured", "painted", "audited", "planned"]
_OBJECTS = ["the quarterly budget", "a flight to the coast", "the garden irrigation",
            "the database migration", "a birthday dinner", "the solar panels",
            "the onboarding guide", "a dentist appointment", "the wedding playlist",
            "the sensor firmware", "a hiking trip", "the rental contract", "the grant proposal",
            "the kitchen renovation", "a chess tournament", "the vaccine schedule"]
_LIKES = ["green tea", "early mornings", "jazz records", "long emails", "spicy food",
          "quiet offices", "mountain trails", "board games", "handwritten notes",
          "electric cars", "old maps", "strong espresso", "rainy days", "sci-fi novels"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_PROJECTS = ["Aurora", "Basalt", "Cobalt", "Delta", "Ember", "Fjord", "Granite", "Harbor",
             "Iris", "Juniper", "Kestrel", "Lumen", "Meridian", "Nimbus", "Orchid", "Prism"]


@dataclass(frozen=True, slots=True)
class SyntheticCorpus:
    """Texts, kinds and typed edges ``(src_idx, dst_idx, type, weight)``."""

    texts: list[str]
    kinds: list[str]
    edges: list[tuple[int, int, str, float]]

    def digest(self) -> str:
        h = hashlib.sha256()
        for text in self.texts:
            h.update(text.encode())
            h.update(b"\n")
        return h.hexdigest()


def synthetic_corpus(num_nodes: int, seed: int = 0) -> SyntheticCorpus:
    """A deterministic corpus of ``num_nodes`` nodes grouped into ~25-node topics.

    Each topic has one entity node (a person); the others are episodic events and
    semantic facts about that person, linked to the entity ("mentions"), to the
    previous event of the topic ("follows") and now and then to another topic
    ("related_to").
    """
    rng = random.Random(seed)
    texts: list[str] = []
    kinds: list[str] = []
    edges: list[tuple[int, int, str, float]] = []
    entity_of_topic: list[int] = []
    last_event: dict[int, int] = {}
    num_topics = max(1, num_nodes // 25)
    topic_facts: list[tuple[str, str, str, str]] = []
    for _ in range(num_topics):
        name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
        topic_facts.append((name, rng.choice(_CITIES), rng.choice(_ROLES),
                            rng.choice(_PROJECTS)))
    for idx in range(num_nodes):
        if idx < num_topics:
            name, city, role, project = topic_facts[idx]
            texts.append(f"{name} is a {role} based in {city} who leads project {project}.")
            kinds.append("entity")
            entity_of_topic.append(idx)
            continue
        topic = rng.randrange(num_topics)
        name, city, _, project = topic_facts[topic]
        if rng.random() < 0.7:
            texts.append(f"On {rng.choice(_DAYS)} {name} {rng.choice(_VERBS)} "
                         f"{rng.choice(_OBJECTS)} for {project} in {rng.choice(_CITIES)}.")
            kinds.append("episodic")
            prev = last_event.get(topic)
            if prev is not None:
                edges.append((prev, idx, "follows", 0.5))
            last_event[topic] = idx
        else:
            texts.append(f"{name} likes {rng.choice(_LIKES)} and dislikes "
                         f"{rng.choice(_LIKES)}; home is {city}.")
            kinds.append("semantic")
        edges.append((idx, entity_of_topic[topic], "mentions", 0.8))
        if rng.random() < 0.1:
            edges.append((idx, rng.randrange(num_topics), "related_to", 0.3))
    return SyntheticCorpus(texts, kinds, edges)


def cached_embeddings(corpus: SyntheticCorpus, embedder: Any, *,
                      cache_dir: Path = CACHE_DIR, progress: bool = True) -> np.ndarray:
    """Embeddings of ``corpus`` (float32 ``[N, dim]``), computed once and cached on disk."""
    from contextkit.config import require

    tqdm = require("tqdm", "bench").tqdm

    key = f"{embedder.model_id}-{embedder.dim}-{corpus.digest()[:20]}-{len(corpus.texts)}"
    path = cache_dir / f"{key}.npy"
    if path.is_file():
        vecs = np.load(path)
        if vecs.shape == (len(corpus.texts), embedder.dim):
            return vecs
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = np.empty((len(corpus.texts), embedder.dim), dtype=np.float32)
    bar = tqdm(total=len(corpus.texts), desc="embedding corpus", unit="sent",
               disable=not progress)
    with bar:
        for start in range(0, len(corpus.texts), EMBED_BATCH):
            batch = corpus.texts[start: start + EMBED_BATCH]
            out[start: start + len(batch)] = embedder.encode(batch)
            bar.update(len(batch))
    tmp = path.with_suffix(f".tmp{os.getpid()}.npy")
    np.save(tmp, out)
    os.replace(tmp, path)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=positive_int, default=100_000,
                        help="corpus size (default 100000; the first run embeds it, minutes)")
    parser.add_argument("--queries", type=positive_int, default=200,
                        help="timed hybrid queries (k=10, hops=2, query embedding included)")
    parser.add_argument("--ingest-nodes", type=positive_int, default=2_000,
                        help="fresh nodes embedded and added to measure ingest")
    parser.add_argument("--store", default=None,
                        help="SQLAlchemy URL or SQLite path (default: a temporary SQLite file)")
    parser.add_argument("--query-threads", type=positive_int, default=1,
                        help="torch threads while timing queries (one query is too small to "
                             "gain from more; extra threads only add contention)")
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR,
                        help="where corpus embeddings are cached")


def _queries(num: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    forms = [
        lambda: f"What did {rng.choice(_FIRST)} {rng.choice(_LAST)} do for project "
                f"{rng.choice(_PROJECTS)}?",
        lambda: f"Who likes {rng.choice(_LIKES)} and lives in {rng.choice(_CITIES)}?",
        lambda: f"When was {rng.choice(_OBJECTS)} {rng.choice(_VERBS)}?",
        lambda: f"Which {rng.choice(_ROLES)} works in {rng.choice(_CITIES)}?",
    ]
    return [rng.choice(forms)() for _ in range(num)]


def _build_graph(graph: Any, corpus: SyntheticCorpus, vecs: np.ndarray, tenant: str,
                 prefix: str, progress: bool) -> list[str]:
    from contextkit.config import require

    tqdm = require("tqdm", "bench").tqdm

    ids = [f"{prefix}{i}" for i in range(len(corpus.texts))]
    chunk = 10_000
    with tqdm(total=len(ids), desc="building graph", unit="node", disable=not progress) as bar:
        for start in range(0, len(ids), chunk):
            stop = start + chunk
            graph.add_nodes(corpus.texts[start:stop], tenant=tenant,
                            kinds=corpus.kinds[start:stop], node_ids=ids[start:stop],
                            embeddings=vecs[start:stop])
            bar.update(len(ids[start:stop]))
    edges = [(ids[a], ids[b], t, w) for a, b, t, w in corpus.edges]
    for start in range(0, len(edges), 5_000):
        graph.add_edges(edges[start: start + 5_000])
    return ids


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the graph, then time queries, reservations, warms and ingest."""
    import tempfile

    from contextkit.bench._common import machine_info, print_table
    from contextkit.engine.models import load_tokenizer
    from gpu_cache import CacheConfig, CacheIdentity, Tier, TQGPUCache
    from memory_graph import GraphBlockReserver, MemoryGraph, SentenceTransformerEmbedder

    tenant = "bench"
    embedder = SentenceTransformerEmbedder(batch_size=EMBED_BATCH)
    corpus = synthetic_corpus(args.nodes)
    vecs = cached_embeddings(corpus, embedder, cache_dir=args.cache_dir)

    with tempfile.TemporaryDirectory(prefix="ck-bench-graph-") as tmp:
        store = args.store or str(Path(tmp) / "graph.sqlite")
        graph = MemoryGraph(store, embedder=embedder)
        _build_graph(graph, corpus, vecs, tenant, "n", progress=True)

        # -- hybrid query latency (query embedding included)
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(args.query_threads)
        queries = _queries(args.queries)
        for q in queries[:10]:
            graph.hybrid_query(q, k=10, hops=2, tenant=tenant)
        query_ms, hits_per_query = [], []
        for q in queries:
            t0 = time.perf_counter()
            hits = graph.hybrid_query(q, k=10, hops=2, tenant=tenant)
            query_ms.append((time.perf_counter() - t0) * 1e3)
            hits_per_query.append(len(hits))
        torch.set_num_threads(threads)

        # -- how close the index's top-10 is to exact brute force
        index = graph.vector_index(tenant)
        assert index is not None
        qvecs = embedder.encode(queries[:50])
        exact = np.argsort(-(index.matrix @ qvecs.T), axis=0)[:10].T
        found = 0
        for qv, ex in zip(qvecs, exact, strict=True):
            got, _ = index.search(qv, 10)
            found += len(set(got) & {index.ids[i] for i in ex.tolist()})
        recall = found / (10 * len(qvecs))

        # -- reservation and warm latency with the real tokenizer and a SmolLM2-shaped cache
        tokenizer = load_tokenizer()
        identity = CacheIdentity(model_id="SmolLM2-135M-Instruct", num_layers=30,
                                 num_kv_heads=3, head_dim=64, block_size=16)
        cache = TQGPUCache(identity, CacheConfig(num_device_blocks=2048,
                                                 num_host_blocks=4096))
        reserver = GraphBlockReserver(
            cache, lambda t: len(tokenizer.encode(t, add_special_tokens=False)), graph=graph)
        hit_lists = [graph.hybrid_query(q, k=10, hops=2, tenant=tenant, limit=32)
                     for q in queries[:100]]
        reserve_ms, warm_ms, blocks = [], [], []
        for hits in hit_lists:
            t0 = time.perf_counter()
            res = reserver.reserve(hits, tenant=tenant)
            t1 = time.perf_counter()
            reserver.warm_reservation(res.reservation_id)
            t2 = time.perf_counter()
            reserver.release(res.reservation_id)
            reserve_ms.append((t1 - t0) * 1e3)
            warm_ms.append((t2 - t1) * 1e3)
            blocks.append(len(res.block_ids))
        stats = reserver.stats()
        reserver.close()
        assert cache.num_free(Tier.HOST) == cache.capacity(Tier.HOST)

        # -- ingest: fresh nodes embedded and added through the public API
        fresh = synthetic_corpus(args.ingest_nodes, seed=7)
        t0 = time.perf_counter()
        _ingest(graph, fresh, tenant)
        ingest_s = time.perf_counter() - t0
        graph.close()

    result: dict[str, Any] = {
        "nodes": args.nodes,
        "edges": len(corpus.edges),
        "queries": len(queries),
        "query_p50_ms": round(_pct(query_ms, 0.5), 3),
        "query_p95_ms": round(_pct(query_ms, 0.95), 3),
        "query_torch_threads": args.query_threads,
        "hits_per_query_p50": statistics.median(hits_per_query),
        "vector_recall_at_10": round(recall, 4),
        "reserve_p50_ms": round(_pct(reserve_ms, 0.5), 3),
        "warm_p50_ms": round(_pct(warm_ms, 0.5), 3),
        "blocks_per_reservation_p50": statistics.median(blocks),
        "reservation_hit_rate": stats.hit_rate,
        "ingest_nodes": args.ingest_nodes,
        "ingest_nodes_per_s": round(args.ingest_nodes / ingest_s, 1),
        "store": "sqlite (temporary file)" if args.store is None else "user store",
        "machine": machine_info(),
    }
    print_table(f"memory graph bench ({args.nodes:,} nodes)",
                [(k, v) for k, v in result.items() if k != "machine"])
    return result


def _ingest(graph: Any, corpus: SyntheticCorpus, tenant: str) -> None:
    """Add ``corpus`` in embedding-sized batches with its edges (ids prefixed ``f``)."""
    ids = [f"f{i}" for i in range(len(corpus.texts))]
    for start in range(0, len(ids), EMBED_BATCH):
        stop = start + EMBED_BATCH
        graph.add_nodes(corpus.texts[start:stop], tenant=tenant,
                        kinds=corpus.kinds[start:stop], node_ids=ids[start:stop])
        graph.add_edges([(ids[a], ids[b], t, w) for a, b, t, w in corpus.edges
                         if start <= max(a, b) < stop])


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
