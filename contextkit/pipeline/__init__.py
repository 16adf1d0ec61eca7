"""The pipeline room: one agent call from a layered prompt to the cache and back.

Owns :class:`CacheAwareContextPipeline` (``pipeline``): budgets and layer order
applied to ``build_system_message``, the cache lookup and generation on an embedded
engine, and the calls' reports (``reports``); tenants and per-tenant views
(``tenancy``); stable-prefix pins (``pins``); the blocks of a call registered with a
tier manager through a Protocol the loop implements (``registration``); and the path
to a served model (``served``: the model as a vLLM server renders it, the request
fields that label token ranges for the connector, and the wire format they use).

May import: :mod:`contextkit.prompt`, :mod:`contextkit.engine`, config and metrics,
:mod:`gpu_cache`. The loop above reaches it through its public methods; it never
imports the loop.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CacheAwareContextPipeline": "contextkit.pipeline.pipeline",
    "cache_aware": "contextkit.pipeline.pipeline",
    "PipelineResult": "contextkit.pipeline.pipeline",
    "CallReport": "contextkit.pipeline.pipeline",
    "TurnPlan": "contextkit.pipeline.pipeline",
    "BuiltPrompt": "contextkit.pipeline.pipeline",
    "ServedModel": "contextkit.pipeline.served.model",
    "RenderedPrompt": "contextkit.pipeline.served.model",
    "LabelRangeError": "contextkit.pipeline.served.model",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
