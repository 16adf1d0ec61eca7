"""`max_positions`: how long a request may be, the model's trained context by default."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from contextkit.engine.engine import Engine


def test_default_is_the_trained_context_and_siblings_inherit(engine: Engine) -> None:
    assert engine.max_positions == engine.model.max_positions == 8192  # SmolLM2
    assert engine.sibling("native", num_device_blocks=8, num_host_blocks=8).max_positions == 8192


def test_a_shorter_limit_refuses_in_one_line(fresh: Callable[..., Engine]) -> None:
    short = fresh("native", device=8, host=8, max_positions=40)
    ids = short.encode("What is the capital of France? " * 8)[:36]
    assert len(ids) == 36
    with pytest.raises(ValueError, match=r"^prompt of 36 tokens plus 8 new tokens exceeds the "
                                         r"model's 40 positions; shorten the prompt"):
        short.generate(ids, max_new_tokens=8)
    assert short.generate(ids, max_new_tokens=4).token_ids  # 40 fit


def test_a_longer_limit_lets_a_request_pass_the_trained_context(
        fresh: Callable[..., Engine]) -> None:
    trained = fresh("native", device=8, host=8)
    long = fresh("native", device=8, host=8, max_positions=16_500)
    ids = [1] * 9000
    with pytest.raises(ValueError, match="exceeds the model's 8192 positions"):
        trained.check_prompt(ids, 48)
    long.check_prompt(ids, 48)  # accepted: RoPE runs on past 8192


def test_max_positions_must_be_positive(engine: Engine) -> None:
    with pytest.raises(ValueError,
                       match=r"^max_positions must be an integer >= 1 or None .*, got 0$"):
        Engine(engine.model.hf, engine.tokenizer, kv_format="native", max_positions=0,
               num_device_blocks=8, num_host_blocks=8)
