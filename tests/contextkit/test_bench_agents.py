"""``contextkit bench agents``: the figures from raw rows, the engine's per-tier reuse
(``GenerationResult.warmed_tokens``) and a tiny real run of the three policies."""

from __future__ import annotations

from collections.abc import Callable

from contextkit.engine import Engine
from gpu_cache import Tier


def _prompt(engine: Engine, words: int, seed: int) -> list[int]:
    text = " ".join(f"w{seed}x{i}" for i in range(words))
    return engine.encode(text)


def test_warmed_tokens_count_reuse_brought_up_from_the_host_tier(
        fresh: Callable[..., Engine]) -> None:
    eng = fresh(device=64, host=64)
    ids = _prompt(eng, 120, 1)
    first = eng.generate(ids, max_new_tokens=1)
    assert first.reused_tokens == 0 and first.warmed_tokens == 0
    again = eng.generate(ids, max_new_tokens=1)  # every full block still on the device
    assert again.reused_tokens > 0 and again.warmed_tokens == 0
    cache = eng.cache
    on_device = [m.block_id for m in cache.metadata.all() if m.tier is Tier.DEVICE
                 and m.key is not None]
    assert cache.spill_blocks(on_device) == on_device
    warmed = eng.generate(ids, max_new_tokens=1)
    assert warmed.reused_tokens == again.reused_tokens
    # every reused token came up from the host tier in this request
    assert warmed.warmed_tokens == warmed.reused_tokens
    assert eng.generate(ids, max_new_tokens=1).warmed_tokens == 0
    assert eng.generate(ids, max_new_tokens=1, use_cache=False).warmed_tokens == 0
