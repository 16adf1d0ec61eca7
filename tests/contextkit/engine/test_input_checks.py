"""Bad arguments are refused at the engine's and the pipeline's entry, in one line,
before any block is referenced (issue 33, item 8)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from contextkit.engine.engine import Engine
from contextkit.pipeline.pipeline import CacheAwareContextPipeline

SYSTEM = "[AXIOMS]\nBe exact.\n[/AXIOMS]\n[IDENTITY]\nA careful assistant.\n[/IDENTITY]"


def _referenced(eng: Engine) -> int:
    return sum(1 for m in eng.cache.metadata.all() if m.ref_count > 0)


@pytest.mark.parametrize("bad", [1.5, "5", None, True, math.nan, 0, -3])
def test_max_new_tokens_is_checked_before_any_block_is_referenced(
        fresh: Callable[..., Engine], bad: object) -> None:
    eng = fresh("tq4")
    ids = eng.encode("What is the capital of France?")
    eng.generate(ids, max_new_tokens=2)  # cache the prompt's blocks
    before = _referenced(eng)
    with pytest.raises((TypeError, ValueError)) as info:
        eng.generate(ids, max_new_tokens=bad)  # type: ignore[arg-type]
    message = str(info.value)
    assert "max_new_tokens" in message and "\n" not in message
    assert _referenced(eng) == before  # nothing left held
    assert len(eng.generate(ids, max_new_tokens=2).token_ids) >= 1  # and it still serves


@pytest.mark.parametrize("bad", [None, 5, math.nan, b"bytes", "lone \ud800 surrogate"])
def test_prompt_text_is_checked_at_the_entry(fresh: Callable[..., Engine], bad: object) -> None:
    eng = fresh("tq4")
    with pytest.raises((TypeError, ValueError)) as info:
        eng.encode(bad)  # type: ignore[arg-type]
    assert "text" in str(info.value) and "\n" not in str(info.value)
    if bad is None:
        return  # pipeline.generate(None) is a turn without a user message
    pipeline = CacheAwareContextPipeline(eng)
    pipeline.wrap(lambda: SYSTEM)()
    before = _referenced(eng)
    with pytest.raises((TypeError, ValueError)) as info:
        pipeline.generate(bad, max_new_tokens=2)  # type: ignore[arg-type]
    assert "user_message" in str(info.value) and "\n" not in str(info.value)
    assert _referenced(eng) == before
