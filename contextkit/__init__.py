"""contextkit: context middleware that gives agents semantic control of the KV cache.

The rooms, lowest first (each imports only the ones before it; see docs/map.md):

- :mod:`contextkit.config`: one configuration for every component, shared errors;
- :mod:`contextkit.metrics`: Prometheus metrics of the pipeline and the engine;
- :mod:`contextkit.prompt`: layers, structured prompts and markup, layer order;
- :mod:`contextkit.engine`: the embedded engine over the block cache;
- :mod:`contextkit.pipeline`: one agent call, embedded or on a served model;
- :mod:`contextkit.loop`: the work between turns (tier manager, reservations);
- :mod:`contextkit.workloads`: deterministic agent workloads;
- :mod:`contextkit.bench` and :mod:`contextkit.cli`: the benchmarks and the command.

The cache itself is :mod:`gpu_cache`. Public names are imported lazily, so ``import
contextkit`` stays cheap (torch and transformers load on first use). The module paths
of earlier releases (``contextkit.layers``, ``contextkit.tiers``, ``contextkit.remote``
...) still import, as the modules that now hold them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "contextkit.engine.engine",
    "GenerationResult": "contextkit.engine.engine",
    "CacheFullError": "contextkit.engine.engine",
    "TokenIdError": "contextkit.engine.engine",
    "TokenSpan": "contextkit.engine.engine",
    "CacheAwareContextPipeline": "contextkit.pipeline.pipeline",
    "CallReport": "contextkit.pipeline.pipeline",
    "PipelineResult": "contextkit.pipeline.pipeline",
    "TurnPlan": "contextkit.pipeline.pipeline",
    "MultiAgentWorkload": "contextkit.workloads.agents",
    "MemoryReservations": "contextkit.loop.reservations",
    "MemoryCandidate": "contextkit.loop.reservations",
    "ReservationStats": "contextkit.loop.reservations",
    "BackgroundPrefiller": "contextkit.engine.background",
    "PrefillOutcome": "contextkit.engine.background",
    "cache_aware": "contextkit.pipeline.pipeline",
    "MemoryChunks": "contextkit.pipeline.memory_chunks",
    "MemoryChunkStats": "contextkit.pipeline.memory_chunks",
    "LayerConfig": "contextkit.prompt.layers",
    "LayerSpec": "contextkit.prompt.layers",
    "DEFAULT_LAYERS": "contextkit.prompt.layers",
    "PromptLine": "contextkit.prompt.markup",
    "PromptSection": "contextkit.prompt.markup",
    "StructuredPrompt": "contextkit.prompt.markup",
    "PromptFormatError": "contextkit.prompt.markup",
    "SpilloverQueue": "contextkit.prompt.markup",
    "synthesize_for_budget": "contextkit.prompt.markup",
    "AgentReplay": "contextkit.workloads.replay",
    "ContextTierManager": "contextkit.loop.tiers",
    "TierCacheBridge": "contextkit.loop.tiers",
    "TierManagerConfig": "contextkit.loop.tiers",
    "Thresholds": "contextkit.loop.tiers",
    "ThresholdPolicy": "contextkit.loop.tiers",
    "ContextTier": "contextkit.loop.tiers",
    "CycleMetrics": "contextkit.loop.tiers",
    "ServedModel": "contextkit.pipeline.served.model",
    "RenderedPrompt": "contextkit.pipeline.served.model",
    "LabelRangeError": "contextkit.pipeline.served.model",
}

__all__ = ["__version__", *sorted(_EXPORTS)]

#: Module paths of earlier releases -> where the module lives now. ``import
#: contextkit.layers`` gives the very module object ``contextkit.prompt.layers``.
_MOVED = {
    "contextkit.agents": "contextkit.workloads.agents",
    "contextkit.demo": "contextkit.cli.demo",
    "contextkit.layers": "contextkit.prompt.layers",
    "contextkit.models": "contextkit.engine.models",
    "contextkit.remote": "contextkit.pipeline.served.model",
    "contextkit.replay": "contextkit.workloads.replay",
    "contextkit.reservations": "contextkit.loop.reservations",
    "contextkit.status": "contextkit.cli.status",
    "contextkit.tiers": "contextkit.loop.tiers",
}

_OWN_SPECS: dict[str, Any] = {}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves a module path of :data:`_MOVED` to the module that now holds it."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> ModuleType:
        module = importlib.import_module(_MOVED[spec.name])
        _OWN_SPECS[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # Nothing to run (it was imported under its own name), but the import system
        # gave it the old path's spec: give it back its own.
        module.__spec__ = _OWN_SPECS[module.__name__]


if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())


def lazy_face(
    package: str, exports: Mapping[str, str],
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``__getattr__``, ``__dir__`` and ``__all__`` of a face whose names load on use.

    ``exports`` maps each public name to the module that defines it; the module is
    imported when the name is first read (PEP 562), so importing the face stays cheap.
    """
    names = sorted(exports)

    def getattr_(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    def dir_() -> list[str]:
        return list(names)

    return getattr_, dir_, names


__getattr__ = lazy_face(__name__, _EXPORTS)[0]


def __dir__() -> list[str]:
    return __all__
