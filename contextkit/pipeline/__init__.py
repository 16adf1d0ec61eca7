"""The pipeline room: one agent call from a layered prompt to the cache and back.

Owns :class:`CacheAwareContextPipeline` (``pipeline``), a facade over parts it owns
and delegates to: budgets and layer order applied to ``build_system_message`` and a
turn's token layout (``building``), tenants and per-tenant views (``tenancy``), and the
path to a served model (``served``: the model as a vLLM server renders it, the request
fields that label token ranges for the connector, and the wire format they use,
``served.wire``); with the cache lookup and generation on an embedded engine, the
calls' reports (``reports``), stable-prefix pins (``pins``) and memory lines computed
when they enter the memory graph (``memory_chunks``).

The loop above is reached through Protocols declared here and implemented there: the
blocks of a call registered with a tier manager (``registration``:
:class:`~contextkit.pipeline.registration.SegmentRegistry`), and the work around a turn
(``hooks``: :class:`TurnHooks`, which the pipeline's ``reservations=`` implements, and
:class:`TurnPipeline`, what those hooks may use of the pipeline).

May import: :mod:`contextkit.prompt`, :mod:`contextkit.engine`, config and metrics,
:mod:`gpu_cache`. It never imports the loop.
"""

from __future__ import annotations

from contextkit import lazy_face

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
    "TurnHooks": "contextkit.pipeline.hooks",
    "TurnPipeline": "contextkit.pipeline.hooks",
    "MemoryChunks": "contextkit.pipeline.memory_chunks",
    "MemoryChunkStats": "contextkit.pipeline.memory_chunks",
}

__getattr__, __dir__, __all__ = lazy_face(__name__, _EXPORTS)
