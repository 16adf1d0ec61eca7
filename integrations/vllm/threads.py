"""The connector's save thread leaves the cores to vLLM's forward.

On a CPU server the connector's saves (quantizing every new block) run on the cores
vLLM's forward has bound its OpenMP threads to; a forward thread that loses its core
holds up the whole step at the next barrier. The save thread's fused kernels
therefore run on ``save_threads`` threads (default one) instead of every core.

It keeps vLLM's priority: at a lower one (``nice`` 19, measured on the agents
bench) it starved behind the forward, its saves finished seconds late (blocks missed
by the next lookups were recomputed) and loads waited on the store's lock while it
held it.
"""

from __future__ import annotations

__all__ = ["background_thread"]


def background_thread(threads: int) -> None:
    """Initializer of the save thread: its fused CPU kernels run on at most
    ``threads`` threads (numba's setting is per thread; vLLM's keep theirs)."""
    from gpu_cache.kernels import cpu_fused  # lazily: numba after vLLM's engine start

    cpu_fused.limit_threads(threads)
