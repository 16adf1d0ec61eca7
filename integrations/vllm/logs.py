"""contextkit's log lines inside vLLM's log, in vLLM's own format.

vLLM configures only its ``vllm`` logger; without this, contextkit's warnings reach the
process's stderr through Python's last-resort handler as bare text, with no level or
time, so an operator's ``WARNING``/``ERROR`` filter over vLLM's log misses them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

__all__ = ["CONTEXTKIT_LOGGERS", "adopt_vllm_logging"]

#: The top-level loggers of contextkit's packages that run inside vLLM.
CONTEXTKIT_LOGGERS = ("integrations", "contextkit", "shadow", "gpu_cache", "memory_graph")


def adopt_vllm_logging(names: Sequence[str] = CONTEXTKIT_LOGGERS, *,
                       source: str = "vllm") -> list[str]:
    """Give each logger in ``names`` that has no handler of its own the handlers and
    level of vLLM's ``source`` logger, and stop it propagating (so no line is printed
    twice). Nothing changes where vLLM has no handler or a logger is configured already.

    Returns:
        The loggers that now write through vLLM's handlers.
    """
    parent = logging.getLogger(source)
    if not parent.handlers:
        return []
    adopted = []
    for name in names:
        log = logging.getLogger(name)
        if log.handlers:
            continue
        for handler in parent.handlers:
            log.addHandler(handler)
        log.setLevel(parent.level or logging.INFO)
        log.propagate = False
        adopted.append(name)
    return adopted
