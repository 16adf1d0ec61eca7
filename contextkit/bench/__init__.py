"""Benchmarks shipped as product commands: ``contextkit bench <name> [--json]``.

Each benchmark is a module in this package exposing ``HELP`` (one line),
``add_arguments(parser)`` and ``run(args) -> dict``. ``run`` prints a human table
through :func:`contextkit.bench._common.print_table` and returns the JSON-able result;
the CLI prints that result as the last stdout line when ``--json`` is given.

The bench room sits on top of contextkit's others: it may import every room
(workloads included) and :mod:`memory_graph`, :mod:`shadow`, :mod:`gpu_cache`; only the
CLI imports it. Benchmarks that need vLLM start their drivers (in
:mod:`integrations.vllm.bench`) as subprocesses by module name, so contextkit never
imports integrations.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["BENCHMARKS", "load"]

#: benchmark name -> module path. Adding a benchmark is one line here.
BENCHMARKS: dict[str, str] = {
    "quant": "contextkit.bench.quant",
    "tiers": "contextkit.bench.tiers",
    "kernel": "contextkit.bench.kernel",
    "shadow": "contextkit.bench.shadow",
    "graph": "contextkit.bench.graph",
    "ttft": "contextkit.bench.ttft",
    "ooda": "contextkit.bench.ooda",
    "vllm": "contextkit.bench.vllm",
    "agent-vllm": "contextkit.bench.agent_vllm",
    "agents": "contextkit.bench.agents",
    "agents-vllm": "contextkit.bench.agents_vllm",
    "replicas": "contextkit.bench.replicas",
    "tool-pauses": "contextkit.bench.tool_pauses",
    "chunks-vllm": "contextkit.bench.chunks_vllm",
    "decode": "contextkit.bench.decode",
}


def load(name: str) -> ModuleType:
    """Import the module of benchmark ``name``.

    Raises:
        KeyError: for an unknown name (the message lists the known ones).
    """
    try:
        path = BENCHMARKS[name]
    except KeyError:
        known = ", ".join(sorted(BENCHMARKS))
        raise KeyError(f"unknown benchmark {name!r}; choose one of: {known}") from None
    return importlib.import_module(path)
