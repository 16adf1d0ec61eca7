"""Background work between turns: the conversation's KV extended and the memory
neighborhoods the conversation is heading to reserved and prefilled, ahead of need.

Attach it to a pipeline whose engine is embedded::

    from contextkit import CacheAwareContextPipeline, Engine, MemoryReservations
    from memory_graph import GraphBlockReserver

    engine = Engine.from_pretrained()
    reserver = GraphBlockReserver(engine.cache, engine.count_tokens, graph=graph)
    reservations = MemoryReservations(engine, reserver, predict)  # predict(history)
    pipeline = CacheAwareContextPipeline(engine, reservations=reservations)

``predict(history)`` returns :class:`MemoryCandidate` objects, best first: memories
layers the next turn may use, built from the conversation so far and the agent's own
graph (:meth:`contextkit.replay.AgentReplay.memory_candidates` is the replay's). After
each reply the pipeline queues the work on a :class:`BackgroundPrefiller`; a request
arriving while it runs is served first (the job stops at the next layer boundary).
Before the next turn a matching reservation is consumed (its blocks are reused) and
the others expire. :class:`ReservationStats` counts what happened.

The names are defined in :mod:`contextkit._reservation` and :mod:`contextkit._background`.
"""

from __future__ import annotations

from contextkit._background import BackgroundPrefiller, PrefillOutcome, prefill_prefix
from contextkit._reservation import MemoryCandidate, MemoryReservations, ReservationStats

__all__ = [
    "BackgroundPrefiller",
    "MemoryCandidate",
    "MemoryReservations",
    "PrefillOutcome",
    "ReservationStats",
    "prefill_prefix",
]
