"""Test-session environment and shared fixtures.

The environment is set before any test module imports triton or transformers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from contextkit.engine.engine import Engine

if not torch.cuda.is_available():
    # Triton reads this when it is first imported: run kernels on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def engine() -> Engine:
    """The packaged SmolLM2 on a TQ4 cache (small tiers; tests use fresh siblings).

    Loaded once per test session, shared by the contextkit and integrations suites.
    """
    from contextkit.engine.engine import Engine

    return Engine.from_pretrained(num_device_blocks=128, num_host_blocks=128)


@pytest.fixture
def fresh(engine: Engine) -> Callable[..., Engine]:
    """Make an engine over the same weights with its own, empty cache."""

    def make(kv_format: str = "tq4", device: int = 128, host: int = 128, **kw: object) -> Engine:
        return engine.sibling(kv_format, num_device_blocks=device, num_host_blocks=host, **kw)

    return make
