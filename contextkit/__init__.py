"""contextkit: context middleware that gives agents semantic control of the KV cache.

The layered prompt builder, cache-aware pipeline, engine and tier manager live
here; the cache itself is :mod:`gpu_cache`. Public names are imported lazily, so
``import contextkit`` stays cheap (torch and transformers load on first use).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "contextkit.engine",
    "GenerationResult": "contextkit.engine",
    "CacheFullError": "contextkit.engine",
    "TokenIdError": "contextkit.engine",
    "TokenSpan": "contextkit.engine",
    "CacheAwareContextPipeline": "contextkit.pipeline",
    "CallReport": "contextkit.pipeline",
    "PipelineResult": "contextkit.pipeline",
    "TurnPlan": "contextkit.pipeline",
    "MultiAgentWorkload": "contextkit.agents",
    "MemoryReservations": "contextkit.reservations",
    "MemoryCandidate": "contextkit.reservations",
    "ReservationStats": "contextkit.reservations",
    "BackgroundPrefiller": "contextkit.reservations",
    "PrefillOutcome": "contextkit.reservations",
    "cache_aware": "contextkit.pipeline",
    "LayerConfig": "contextkit.layers",
    "LayerSpec": "contextkit.layers",
    "DEFAULT_LAYERS": "contextkit.layers",
    "PromptLine": "contextkit.prompt",
    "PromptSection": "contextkit.prompt",
    "StructuredPrompt": "contextkit.prompt",
    "PromptFormatError": "contextkit.prompt",
    "SpilloverQueue": "contextkit.prompt",
    "synthesize_for_budget": "contextkit.prompt",
    "AgentReplay": "contextkit.replay",
    "ContextTierManager": "contextkit.tiers",
    "TierCacheBridge": "contextkit.tiers",
    "TierManagerConfig": "contextkit.tiers",
    "Thresholds": "contextkit.tiers",
    "ThresholdPolicy": "contextkit.tiers",
    "ContextTier": "contextkit.tiers",
    "CycleMetrics": "contextkit.tiers",
    "ServedModel": "contextkit.remote",
    "RenderedPrompt": "contextkit.remote",
    "LabelRangeError": "contextkit.remote",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'contextkit' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
