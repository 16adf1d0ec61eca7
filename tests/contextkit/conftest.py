"""Shared fixtures: one real SmolLM2 engine per test session (weights loaded once)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from contextkit.engine import Engine


@pytest.fixture(scope="session")
def engine() -> Engine:
    """The packaged SmolLM2 on a TQ4 cache (small tiers; tests use fresh siblings)."""
    return Engine.from_pretrained(num_device_blocks=128, num_host_blocks=128)


@pytest.fixture
def fresh(engine: Engine) -> Callable[..., Engine]:
    """Make an engine over the same weights with its own, empty cache."""

    def make(kv_format: str = "tq4", device: int = 128, host: int = 128, **kw: object) -> Engine:
        return engine.sibling(kv_format, num_device_blocks=device, num_host_blocks=host, **kw)

    return make
