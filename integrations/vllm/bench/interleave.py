"""Configurations side by side: every server up at once, each step sent to each in turn.

Run back to back, a slow minute on a shared machine decides a ratio between two
configurations; interleaved, drift hits all of them alike. This module holds what the
vLLM benches share for that: the rotating order, a wait for the machine to go quiet
between turns (one configuration's background saves or uploads are not timed against
the next one's request), and a check that the servers fit in memory before any starts.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["SERVER_GIB", "available_gib", "check_memory", "quiet", "rotation", "settle",
           "start_lanes"]

#: Memory one vLLM OpenAI server on the CPU build takes with the packaged SmolLM2 (API
#: process, engine core and worker; their libraries' pages are shared), before its KV
#: space and the connector's DDR tier, which callers add: five servers of
#: ``bench agents-vllm`` took about 20 GiB of a 24 GB machine, close to this estimate.
SERVER_GIB = 2.2


def rotation(names: Sequence[str], step: int) -> list[str]:
    """``names`` starting at ``step`` modulo their count: none always goes first."""
    if not names:
        return []
    shift = step % len(names)
    return [*names[shift:], *names[:shift]]


def _busy_idle() -> tuple[int, int]:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = [int(v) for v in fields]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values) - idle, idle


def settle(*, busy_below: float = 0.25, window_s: float = 0.2, timeout_s: float = 5.0
           ) -> float:
    """Wait until the machine's CPUs were busy less than ``busy_below`` of a
    ``window_s`` window, at most ``timeout_s``; returns the seconds waited. Without
    /proc/stat (not Linux) it returns at once."""
    start = time.perf_counter()
    try:
        before = _busy_idle()
    except OSError:
        return 0.0
    while True:
        time.sleep(window_s)
        after = _busy_idle()
        calm = quiet(before, after, busy_below)
        before = after
        waited = time.perf_counter() - start
        if calm or waited >= timeout_s:
            return round(waited, 3)


def quiet(before: tuple[int, int], after: tuple[int, int], busy_below: float) -> bool:
    """Whether the CPUs were busy less than ``busy_below`` of the time between two
    (busy, idle) samples of /proc/stat's jiffies (no time passed counts as quiet)."""
    busy, idle = after[0] - before[0], after[1] - before[1]
    return busy + idle <= 0 or busy / (busy + idle) < busy_below


def available_gib() -> float | None:
    """MemAvailable from /proc/meminfo in GiB; None where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


def check_memory(servers: int, extra_gib: float = 0.0) -> None:
    """Refuse, in one line that says what to do, to start ``servers`` servers that
    would not fit in the memory available now; ``extra_gib``: what they allocate beyond
    :data:`SERVER_GIB` each (vLLM's KV blocks, the connectors' DDR tiers)."""
    have = available_gib()
    need = servers * SERVER_GIB + extra_gib
    if have is not None and need > have:
        raise SystemExit(
            f"{servers} vLLM servers side by side need about {need:.0f} GiB and "
            f"{have:.0f} GiB are available: give fewer --configs (each run measures its "
            "own ceiling), or --sequential to run them one after another")


def start_lanes(names: Sequence[str], make: Callable[[str], Any], errors: dict[str, str],
                required: str | None = None) -> dict[str, Any]:
    """Each configuration's lane (``make(name)``, with ``start()`` and ``stop()``),
    started in turn; one that fails to start is stopped and reported in ``errors``,
    except ``required``, whose failure is raised (the run has no reference without it).
    The caller stops the lanes returned."""
    lanes: dict[str, Any] = {}
    for name in names:
        lane = make(name)
        try:
            lanes[name] = lane.start()
        except (Exception, SystemExit) as exc:
            lane.stop()
            if name == required:
                for started in lanes.values():
                    started.stop()
                raise
            errors[name] = f"{type(exc).__name__}: {str(exc)[:2000]}"
            print(f"{name}: did not start: {errors[name]}", file=sys.stderr, flush=True)
    return lanes
