"""Fixtures for memory_graph tests: the real embedding model and tokenizer, loaded once."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from gpu_cache import CacheConfig, CacheIdentity, TQGPUCache
from memory_graph import SentenceTransformerEmbedder, normalize_rows


class HashEmbedder:
    """Deterministic bag-of-words embedder implementing the Embedder protocol.

    For tests of logic that does not depend on semantics (storage, index layout,
    identity checks). Texts sharing words get similar vectors.
    """

    def __init__(self, dim: int = 32) -> None:
        self._dim = dim

    @property
    def model_id(self) -> str:
        return f"hash-bow-{self._dim}"

    @property
    def dim(self) -> int:
        return self._dim

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self._dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for word in re.findall(r"\w+", text.lower()):
                digest = hashlib.sha256(word.encode()).digest()
                out[i, digest[0] % self._dim] += 1.0 if digest[1] % 2 else -1.0
            out[i, -1] += 1e-3  # never a zero row
        return normalize_rows(out)


class ManualClock:
    """A clock tests move by hand."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(scope="session")
def embedder() -> SentenceTransformerEmbedder:
    return SentenceTransformerEmbedder()


@pytest.fixture(scope="session")
def count_tokens() -> Callable[[str], int]:
    from contextkit.engine.models import load_tokenizer

    tokenizer = load_tokenizer()
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def hash_embedder() -> HashEmbedder:
    return HashEmbedder()


def make_cache(num_device_blocks: int = 64, num_host_blocks: int = 64) -> TQGPUCache:
    identity = CacheIdentity(model_id="test-model", num_layers=2, num_kv_heads=2, head_dim=64,
                             block_size=16)
    return TQGPUCache(identity, CacheConfig(num_device_blocks=num_device_blocks,
                                            num_host_blocks=num_host_blocks, device="cpu"))


@pytest.fixture
def cache() -> TQGPUCache:
    return make_cache()


@pytest.fixture
def cache_factory() -> Callable[..., TQGPUCache]:
    return make_cache


@pytest.fixture
def hash_embedder_cls() -> type[HashEmbedder]:
    return HashEmbedder
