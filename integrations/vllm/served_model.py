"""The model vLLM serves, handed to the connector in its worker: a model-loader plugin.

Chunk reuse on vLLM computes a few tokens of a request itself (the changed spans and
each moved chunk's seam, :mod:`integrations.vllm.chunk_forward`), with the server's own
weights. vLLM gives a KV connector its paged cache but not the model, so contextkit
registers a model loader through vLLM's plugin mechanism (the ``vllm.general_plugins``
entry point this package declares, which vLLM runs in every process it starts): launch
with ``--load-format contextkit`` and the loader loads the model exactly as vLLM's
default loader does (``auto``: safetensors, else PyTorch bins), then records it for the
connector of the same worker process. No patch, no fork: without the flag the
connector serves prefix reuse and says why.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

__all__ = ["LOAD_FORMAT", "register", "served_model"]

#: ``--load-format`` value of contextkit's loader.
LOAD_FORMAT = "contextkit"

_served: weakref.ReferenceType[Any] | None = None
_registered = False


def served_model() -> Any | None:
    """The model this process's vLLM worker loaded through contextkit's loader, or None."""
    return _served() if _served is not None else None


def _publish(model: Any) -> None:
    global _served
    _served = weakref.ref(model)


def register() -> None:
    """``vllm.general_plugins`` entry point: register the ``contextkit`` load format
    (idempotent; vLLM may call it more than once per process)."""
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    class ContextKitModelLoader(DefaultModelLoader):
        """vLLM's default loader (format ``auto``) that records the loaded model."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(dataclasses.replace(load_config, load_format="auto"))

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
            model = super().load_model(vllm_config=vllm_config, model_config=model_config,
                                       prefix=prefix)
            _publish(model)
            return model

    global _registered
    if not _registered:
        register_model_loader(LOAD_FORMAT)(ContextKitModelLoader)
        _registered = True
