"""Every prompt layer maps to an explicit eviction priority, in the order of how long its
blocks stay useful."""

from __future__ import annotations


def test_every_default_layer_has_an_eviction_priority_and_volatile_ones_go_first() -> None:
    """The volatile layers (state, time, awareness) used to fall to the default priority
    (50), above memories (35) and neurons (40): semantic eviction kept blocks that change
    every call over the ones that are reused, and the connector's metrics filed them
    under "other"."""
    from contextkit.prompt.layers import DEFAULT_LAYERS
    from gpu_cache import DEFAULT_SOURCE_PRIORITY

    sources = {spec.source for spec in DEFAULT_LAYERS}
    assert sources <= set(DEFAULT_SOURCE_PRIORITY), sources - set(DEFAULT_SOURCE_PRIORITY)
    kept = min(DEFAULT_SOURCE_PRIORITY[s.source] for s in DEFAULT_LAYERS if not s.volatile)
    for spec in DEFAULT_LAYERS:
        if spec.volatile:
            assert DEFAULT_SOURCE_PRIORITY[spec.source] < kept, spec.name
            assert DEFAULT_SOURCE_PRIORITY[spec.source] < DEFAULT_SOURCE_PRIORITY["user_turn"]
