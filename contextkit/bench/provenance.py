"""Where and how a bench JSON was produced, recorded by code rather than by hand.

Every ``contextkit bench NAME --json`` result carries a ``provenance`` object: the
commit and whether the tree had uncommitted changes, the CPU model and its SIMD flags,
the GPU if any, the load average before and after the run, the UTC start and end, and
the exact command. ``contextkit.bench.figures`` reads it to say where each published
figure was measured, so a number is never separated from its machine.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Provenance", "cpu_info", "git_state", "gpu_name", "load_average"]

#: The CPU flags that change what the kernels can do; the full list is ~150 words.
_SIMD_FLAG = re.compile(r"^(avx|amx|fma|f16c|sse4|vnni|avx512|bf16)")
_REPO = Path(__file__).resolve().parents[2]


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, or None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def cpu_info(cpuinfo: str | None = None) -> dict[str, Any]:
    """CPU model, logical core count and SIMD flags (from /proc/cpuinfo on Linux).

    ``cpuinfo``: the text to parse instead of reading the file (for tests)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model: str | None = None
    flags: list[str] = []
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = sorted(f for f in value.split() if _SIMD_FLAG.match(f))
    return {"cpu_model": model or platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "cpu_flags": flags}


def git_state(repo: Path = _REPO) -> dict[str, Any]:
    """The checkout's commit and whether tracked files differ from it.

    Outside a git checkout (an installed wheel) both are None."""
    def git(*cmd: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(repo), *cmd], capture_output=True,
                                  text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def gpu_name() -> str | None:
    """The first CUDA device's name, or None on a CPU-only machine."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class Provenance:
    """The part of a run's provenance known at its start; :meth:`finish` adds the end.

    Attributes:
        command: the command line as typed (``contextkit bench ttft --json``).
        started: UTC start, ISO 8601.
        load_before: load averages at the start.
        code: :func:`git_state` at the start.
    """

    command: str
    started: str
    load_before: list[float] | None
    code: dict[str, Any]

    @classmethod
    def start(cls, argv: Sequence[str]) -> Provenance:
        """Record the start of a run of ``argv`` (the full command, program first).

        The commit is read here: the code that runs is the code at the start, whatever
        is committed while a long bench runs."""
        return cls(command=shlex.join(argv), started=_now(), load_before=load_average(),
                   code=git_state())

    def finish(self) -> dict[str, Any]:
        """The whole record, taken at the end of the run."""
        return {"command": self.command, "started": self.started, "finished": _now(),
                "load_before": self.load_before, "load_after": load_average(),
                **self.code, **cpu_info(), "gpu": gpu_name()}
