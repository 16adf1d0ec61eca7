"""vLLM integration: a ``KVConnectorBase_V1`` connector over contextkit's tiers and shadow.

Importing this package imports neither vLLM nor ``gpu_cache`` (whose numba import
must not precede vLLM's engine start in the same process: vLLM 0.32's CPU worker
scans every loaded module at start and trips over llvmlite's objects). The
connector class lives in :mod:`integrations.vllm.connector`, which vLLM loads by
path from ``--kv-transfer-config`` (see :func:`kv_transfer_config`, ``docs/vllm.md``).
"""

from __future__ import annotations

import importlib
from typing import Any

from integrations.vllm.config import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    ConnectorConfig,
    ConnectorConfigError,
    kv_transfer_config,
)

__all__ = [
    "CONNECTOR_CLASS",
    "CONNECTOR_MODULE",
    "BlockLabel",
    "ConnectorConfig",
    "ConnectorConfigError",
    "PrecisionError",
    "PrecisionPolicy",
    "RequestPlanner",
    "kv_transfer_config",
    "semantic_params",
]

_LAZY = {"BlockLabel": "integrations.vllm.precision",
         "PrecisionError": "integrations.vllm.precision",
         "PrecisionPolicy": "integrations.vllm.precision",
         "RequestPlanner": "integrations.vllm.planning",
         "semantic_params": "integrations.vllm.planning"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
