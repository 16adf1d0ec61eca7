"""Shared helpers for benchmarks: timing, tables, machine description."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["machine_info", "median_seconds", "number_type", "print_table", "sync",
           "the_configs"]


def sync(device: torch.device | str | None = None) -> None:
    """Wait for queued device work so wall-clock timings are real."""
    dev = torch.device(device) if device is not None else None
    if torch.cuda.is_available() and (dev is None or dev.type == "cuda"):
        torch.cuda.synchronize()


def median_seconds(
    fn: Callable[[], Any],
    repeats: int = 5,
    warmup: int = 1,
    device: torch.device | str | None = None,
) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine_info() -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        info["device_name"] = torch.cuda.get_device_name(0)
    else:
        info["device_name"] = "cpu"
    return info


def write_result(path: str | os.PathLike[str], result: dict[str, Any]) -> None:
    """Write a benchmark's JSON result (``--out``), creating the folder."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")


def the_configs(given: str, known: Sequence[str]) -> list[str]:
    """A bench's ``--configs`` (comma-separated names), refused in one line when a name
    is not one of ``known``."""
    configs = [c.strip() for c in str(given).split(",") if c.strip()]
    unknown = sorted(set(configs) - set(known))
    if unknown:
        raise SystemExit(f"unknown --configs {', '.join(unknown)}; pick from "
                         f"{', '.join(known)}")
    return configs


def print_table(title: str, rows: Sequence[tuple[str, Any]]) -> None:
    """Print a two-column table to stdout (benchmarks are CLI output, not library code)."""
    width = max((len(k) for k, _ in rows), default=0)
    out = sys.stdout
    out.write(f"\n{title}\n{'-' * len(title)}\n")
    for key, value in rows:
        if isinstance(value, float):
            text = f"{value:,.4f}" if abs(value) < 100 else f"{value:,.1f}"
        else:
            text = str(value)
        out.write(f"{key.ljust(width)}  {text}\n")
    out.flush()


def number_type(kind: type, low: float, *, inclusive: bool = True,
            high: float | None = None) -> Callable[[str], Any]:
    """An argparse ``type`` that parses ``kind`` and refuses values out of range, so a
    bad count is one usage line (``argument --blocks: must be >= 1, got 0``)."""
    bound = f">= {low:g}" if inclusive else f"> {low:g}"
    if high is not None:
        bound = f"in {'[' if inclusive else '('}{low:g}, {high:g}]"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be {'an integer' if kind is int else 'a number'} {bound}, got "
                f"{text!r}") from None
        # written as 'not >=' so NaN is refused too
        if (not value >= low if inclusive else not value > low) or (
                high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


#: ``type=`` for counts that must be at least 1 (blocks, turns, repeats, ...).
positive_int = number_type(int, 1)
#: ``type=`` for counts that may be 0 (warm-up rounds, seeds).
non_negative_int = number_type(int, 0)
#: ``type=`` for durations that may be 0 (a think time).
non_negative_float = number_type(float, 0.0)
#: ``type=`` for durations and scales that must be > 0.
positive_float = number_type(float, 0.0, inclusive=False)
#: ``type=`` for fractions in (0, 1].
fraction = number_type(float, 0.0, inclusive=False, high=1.0)
#: ``type=`` for shares in [0, 1].
unit_float = number_type(float, 0.0, high=1.0)
