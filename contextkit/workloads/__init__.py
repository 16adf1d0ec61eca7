"""The workloads room: deterministic agents to drive everything else with.

Owns the 10-layer agent replay (``replay``, its content and memories in
``replay_content`` and ``replay_memories``), the multi-agent workload with tenants,
bursts and returning agents (``agents``), and the prompt builders of the vLLM
benchmarks (``vllm_prompts``).

May import every room below it (prompt, engine, pipeline, loop) and
:mod:`memory_graph`; only the benchmarks and the CLI import it.
"""

from __future__ import annotations

from contextkit import lazy_face

_EXPORTS = {
    "AgentReplay": "contextkit.workloads.replay",
    "ReplayTurn": "contextkit.workloads.replay",
    "REPLAY_LAYERS": "contextkit.workloads.replay",
    "MultiAgentWorkload": "contextkit.workloads.agents",
    "AgentSpec": "contextkit.workloads.agents",
    "AgentStep": "contextkit.workloads.agents",
}

__getattr__, __dir__, __all__ = lazy_face(__name__, _EXPORTS)
