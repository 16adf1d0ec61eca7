"""Checked durations, sizes and JSON input: one check each, shared by the library
constructors, the configuration loaders and the CLI flags (as argparse types).

A NaN compares false everywhere and an infinity overflows a deadline, so a duration
must be a finite number; a size must be a whole number (1.5 MB of blocks is a typo).
JSON given on a command line or in a variable is bounded in size and nesting. Every
refusal is one line naming the setting, the bad value and what to give instead.
"""

from __future__ import annotations

import argparse
import json
import math
import numbers
import os
from collections.abc import Callable
from typing import Any

__all__ = ["MAX_JSON_BYTES", "MAX_JSON_DEPTH", "json_object", "read_bounded", "seconds",
           "seconds_arg", "size", "size_arg"]

#: JSON configuration text read at most (a connector config is a few hundred bytes).
MAX_JSON_BYTES = 1 << 20
#: Nesting of JSON configuration at most (the connector's deepest key nests 4 levels).
MAX_JSON_DEPTH = 32


def _named(name: str, rest: str) -> str:
    return f"{name} {rest}" if name else rest


def seconds(value: object, name: str, *, zero: bool = False,
            error: type[ValueError] = ValueError) -> float:
    """``value`` as float seconds: a finite number > 0 (``zero``: >= 0).

    Raises:
        error: anything else (NaN, infinity, text, a bool), in one line.
    """
    try:
        number = (float(value) if isinstance(value, numbers.Real)
                  and not isinstance(value, bool) else math.nan)
    except OverflowError:  # an int too big for a float
        number = math.inf
    if not math.isfinite(number) or not (number >= 0 if zero else number > 0):
        bound = ">= 0" if zero else "> 0"
        raise error(_named(name, f"must be a finite number of seconds {bound} (e.g. 1.5), "
                                 f"got {value!r:.40}"))
    return number


def size(value: object, name: str, *, minimum: int = 0,
         error: type[ValueError] = ValueError) -> int:
    """``value`` as an int >= ``minimum`` (a count of blocks, threads, MB...).

    Raises:
        error: a fraction, a float, text, a bool or a value below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
            or int(value) < minimum:
        raise error(_named(name, f"must be a whole number >= {minimum}, got {value!r:.40}"))
    return int(value)


def _arg_type(check: Callable[[object, str], Any], parse: type, what: str
              ) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            value: object = parse(text)
        except ValueError:
            value = text
        try:
            return check(value, "")
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = what  # argparse names the type in its messages
    return convert


def seconds_arg(*, zero: bool = False) -> Callable[[str], float]:
    """An argparse ``type`` for a duration, refusing what :func:`seconds` refuses."""
    return _arg_type(lambda v, n: seconds(v, n, zero=zero), float, "seconds")


def size_arg(*, minimum: int = 0) -> Callable[[str], int]:
    """An argparse ``type`` for a size or count, refusing what :func:`size` refuses."""
    return _arg_type(lambda v, n: size(v, n, minimum=minimum), int, "size")


def _depth(doc: object) -> int:
    """Nesting of a parsed JSON value, without recursion."""
    deepest, todo = 0, [(doc, 1)]
    while todo:
        value, level = todo.pop()
        if isinstance(value, dict | list):
            deepest = max(deepest, level)
            if level <= MAX_JSON_DEPTH:
                todo += [(v, level + 1) for v in
                         (value.values() if isinstance(value, dict) else value)]
    return deepest


def json_object(text: str | bytes, what: str, *,
                error: type[ValueError] = ValueError) -> dict[str, Any]:
    """Parse ``text`` as a JSON object of bounded size and nesting.

    Raises:
        error: over :data:`MAX_JSON_BYTES`, nested deeper than :data:`MAX_JSON_DEPTH`,
            not JSON, or not an object; one line naming ``what``.
    """
    if len(text) > MAX_JSON_BYTES:
        raise error(f"{what} is over 1 MiB; give the JSON object of settings itself")
    nested = f"{what} nests deeper than {MAX_JSON_DEPTH} levels; give a flat JSON object"
    try:
        doc = json.loads(text)
    except RecursionError:
        raise error(nested) from None
    except ValueError as exc:
        raise error(f"{what} is not JSON: {exc}") from None
    if _depth(doc) > MAX_JSON_DEPTH:
        raise error(nested)
    if not isinstance(doc, dict):
        raise error(f"{what} must be a JSON object")
    return doc


def read_bounded(path: str | os.PathLike[str], what: str, *,
                 limit: int = MAX_JSON_BYTES) -> str:
    """The UTF-8 text of a small file, reading at most ``limit`` + 1 bytes (so
    ``/dev/zero`` or a huge file is refused, never read whole).

    Raises:
        OSError: the file cannot be opened or read (the caller says what to pass).
        ValueError: over ``limit`` bytes, or not UTF-8 text.
    """
    with open(path, "rb") as f:
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise ValueError(f"{what} {path} is over {limit >> 20} MiB; give the JSON object "
                         "of settings itself")
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path} is not UTF-8 text; give a JSON file") from None
