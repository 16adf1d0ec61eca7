"""The loop room: the work between an agent's turns.

Owns the OODA tier manager (``tiers``, a facade over parts it owns: its vocabulary in
``tier_types``, its items in ``table``, its Observe, Orient and Decide computations in
``ooda``, its look-ahead ``lookahead``, its Prometheus export ``prometheus``) and the
bridge that moves KV blocks when an item's tier changes (``bridge``); and the memory
neighborhoods reserved and prefilled ahead of need (``reservations``), which ride on
the engine's background prefiller.

The pipeline below reaches this room only through Protocols it declares and this room
implements: :class:`~contextkit.pipeline.registration.SegmentRegistry`
(:class:`ContextTierManager`) and :class:`~contextkit.pipeline.hooks.TurnHooks`
(:class:`MemoryReservations`, which uses the pipeline as a
:class:`~contextkit.pipeline.hooks.TurnPipeline`).

May import: :mod:`contextkit.pipeline` (through its public methods and Protocols),
:mod:`contextkit.prompt`, :mod:`contextkit.engine`, config and metrics,
:mod:`gpu_cache`, :mod:`memory_graph`.
"""

from __future__ import annotations

from contextkit import lazy_face

_EXPORTS = {
    "ContextTierManager": "contextkit.loop.tiers",
    "TierCacheBridge": "contextkit.loop.tiers",
    "TierManagerConfig": "contextkit.loop.tiers",
    "Thresholds": "contextkit.loop.tiers",
    "ThresholdPolicy": "contextkit.loop.tiers",
    "ContextTier": "contextkit.loop.tiers",
    "CycleMetrics": "contextkit.loop.tiers",
    "CycleReport": "contextkit.loop.tiers",
    "SegmentInfo": "contextkit.loop.tiers",
    "PrefetchReport": "contextkit.loop.tiers",
    "TierItem": "contextkit.loop.tiers",
    "ItemKind": "contextkit.loop.tiers",
    "Decision": "contextkit.loop.tiers",
    "Action": "contextkit.loop.tiers",
    "ActReport": "contextkit.loop.tiers",
    "BlockSkip": "contextkit.loop.tiers",
    "ThresholdSuggestion": "contextkit.loop.tiers",
    "MemoryReservations": "contextkit.loop.reservations",
    "MemoryCandidate": "contextkit.loop.reservations",
    "ReservationStats": "contextkit.loop.reservations",
    "BackgroundPrefiller": "contextkit.engine.background",
    "PrefillOutcome": "contextkit.engine.background",
    "prefill_prefix": "contextkit.engine.background",
}

__getattr__, __dir__, __all__ = lazy_face(__name__, _EXPORTS)
