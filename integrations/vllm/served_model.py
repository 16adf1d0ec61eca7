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

vLLM's CPU backend repacks each linear layer's weight for its GEMM kernel and drops
the plain tensor; the loader keeps those tensors (:func:`loaded_weight`) until the
connector has taken what it needs (:func:`release_weights`), so that the connector can
run its projections in another dtype (``chunk_matmul_dtype``).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

__all__ = ["LOAD_FORMAT", "loaded_weight", "register", "release_weights", "served_model"]

#: ``--load-format`` value of contextkit's loader.
LOAD_FORMAT = "contextkit"

_served: weakref.ReferenceType[Any] | None = None
_registered = False
#: each linear module's weight as loaded, before vLLM repacked it (until released)
_weights: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def served_model() -> Any | None:
    """The model this process's vLLM worker loaded through contextkit's loader, or None."""
    return _served() if _served is not None else None


def loaded_weight(module: Any) -> Any:
    """A linear module's weight as loaded: the tensor kept before vLLM repacked it, or
    its ``weight`` where it still holds one; None when neither is at hand."""
    kept = _weights.get(module)
    if kept is not None:
        return kept
    weight = getattr(module, "weight", None)
    return weight if weight is not None and weight.numel() else None


def release_weights() -> None:
    """Drop the kept weights (the connector has copied what it needs, or needs none)."""
    _weights.clear()


def _publish(model: Any) -> None:
    global _served
    _served = weakref.ref(model)


def _keep_weights(model: Any) -> None:
    from vllm.model_executor.layers.linear import LinearBase

    for module in model.modules():
        if isinstance(module, LinearBase) and getattr(module, "weight", None) is not None:
            _weights[module] = module.weight.detach()


def register() -> None:
    """``vllm.general_plugins`` entry point: register the ``contextkit`` load format
    (idempotent; vLLM may call it more than once per process)."""
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    class ContextKitModelLoader(DefaultModelLoader):
        """vLLM's default loader (format ``auto``) that records the loaded model."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(dataclasses.replace(load_config, load_format="auto"))

        def load_weights(self, model: Any, model_config: Any) -> None:
            super().load_weights(model, model_config)
            _keep_weights(model)  # before vLLM repacks them

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
            model = super().load_model(vllm_config=vllm_config, model_config=model_config,
                                       prefix=prefix)
            _publish(model)
            return model

    global _registered
    if not _registered:
        register_model_loader(LOAD_FORMAT)(ContextKitModelLoader)
        _registered = True
