"""Checks of what callers hand the engine, and the fixed calibration text."""

from __future__ import annotations

import operator
from collections.abc import Sequence

from contextkit.engine.types import TokenIdError

__all__ = ["CALIBRATION_TEXT", "check_max_new_tokens", "check_text", "check_token_ids"]

#: Text the key offsets are calibrated on (fixed, so the identity is reproducible).
CALIBRATION_TEXT = (
    "You are a careful assistant for a platform engineering team. Check the facts before "
    "acting, prefer reversible changes, and say what you do not know.\n"
    "The deploy pipeline builds a container image, runs the integration suite, rolls the "
    "new version out to one region, watches error rates and latency for ten minutes, and "
    "then continues region by region. A failed health check stops the rollout.\n"
    "User: the checkout service p95 latency doubled after the 14:05 deploy. What changed?\n"
    "Assistant: The 14:05 deploy of checkout-api v2.31 enabled the new pricing client. "
    "Its connection pool is 8, down from 32, and the pool wait time rose from 2 ms to 180 ms. "
    "I suggest raising the pool size back to 32 or rolling back to v2.30; both are safe.\n"
    "def retry(fn, attempts=3, backoff=0.5):\n    for i in range(attempts):\n        try:\n"
    "            return fn()\n        except TimeoutError:\n"
    "            time.sleep(backoff * 2 ** i)\n"
    "    raise RuntimeError('gave up')\n"
    "Memory 2026-03-02: the user prefers short answers with the exact command to run.\n"
    "State: 14 services healthy, 1 degraded (search-indexer, replica lag 41 s), queue depth 312.\n"
)


def check_token_ids(token_ids: Sequence[int], vocab_size: int, what: str = "token_ids",
                    ) -> list[int]:
    """``token_ids`` as ints, each checked against the vocabulary ``[0, vocab_size)``.

    Raises:
        TokenIdError: a non-integer id, or one outside the vocabulary (a ValueError,
            raised before anything is allocated).
    """
    ids: list[int] = []
    for pos, tok in enumerate(token_ids):
        try:
            value = operator.index(tok)
        except TypeError:
            raise TokenIdError(
                f"{what}[{pos}] is {tok!r}; token ids must be integers in [0, {vocab_size}) "
                "(encode text with Engine.encode or the model's tokenizer)") from None
        if not 0 <= value < vocab_size:
            raise TokenIdError(
                f"{what}[{pos}] is {value} (position {pos}), outside the model's vocabulary "
                f"[0, {vocab_size}); encode text with this model's tokenizer (Engine.encode)")
        ids.append(value)
    return ids


def check_max_new_tokens(value: object, what: str = "max_new_tokens") -> int:
    """``value`` as a reply length: an integer >= 1 (not a bool, a float or a string).

    Raises:
        TypeError: not an integer.
        ValueError: an integer below 1.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an integer >= 1, got {value!r} "
                        f"({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{what} must be >= 1, got {value}")
    return value


def check_text(text: object, what: str = "text") -> str:
    """``text`` as prompt text: a ``str`` that encodes as UTF-8 (no lone surrogates).

    Raises:
        TypeError: not a ``str`` (``None``, a number, bytes: decode bytes first).
        ValueError: a lone surrogate, which no tokenizer can encode.
    """
    if not isinstance(text, str):
        raise TypeError(f"{what} must be text (str), got {type(text).__name__} "
                        f"{text!r:.40}; decode bytes first")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} holds a lone surrogate {text[exc.start]!r} at character "
                         f"{exc.start}, which cannot be encoded; fix the text's decoding "
                         "(e.g. errors='replace')") from None
    return text
