"""The exported names are what they should be, and dependencies point one way."""

from __future__ import annotations

import ast
from pathlib import Path

import gpu_cache

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_cache_exports_are_real_and_complete() -> None:
    for name in gpu_cache.__all__:
        assert getattr(gpu_cache, name) is not None, name
    for required in ("TQ4Codec", "TQGPUCache", "CacheConfig", "CacheIdentity",
                     "BlockMetadataTable", "PrefixPinManager", "Tier", "hash_block_tokens"):
        assert required in gpu_cache.__all__


def _imports(package: str) -> set[str]:
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


def test_dependencies_point_one_way() -> None:
    # integrations -> contextkit -> {memory_graph, shadow} -> gpu_cache
    assert not _imports("gpu_cache") & {"contextkit", "memory_graph", "shadow", "integrations"}
    assert not _imports("memory_graph") & {"contextkit", "shadow", "integrations"}
    assert not _imports("shadow") & {"contextkit", "memory_graph", "integrations"}
    assert "integrations" not in _imports("contextkit")


def test_contextkit_exports_resolve() -> None:
    import contextkit

    for name in contextkit.__all__:
        assert getattr(contextkit, name) is not None, name
    for required in ("Engine", "CacheAwareContextPipeline", "cache_aware", "LayerConfig",
                     "MemoryReservations", "MemoryCandidate"):
        assert required in contextkit.__all__
