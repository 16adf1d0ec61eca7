"""The cache identity of a vLLM-served model, computed the same way by every party.

The connector's scheduler side, its worker side and ``contextkit recover --for-vllm``
each derive the identity from the model directory and the connector config; blocks
and shadows are exchanged only between equal identities (SPEC 1.3, 4).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from functools import lru_cache
from pathlib import Path
from typing import Any

from gpu_cache import CacheIdentity

__all__ = ["check_same_model", "model_fingerprint", "model_shape", "same_model",
           "vllm_cache_identity"]

#: Identity fields that only say how blocks are stored; blocks differing in them
#: still come from the same model (the connector keeps one pool per combination).
FORMAT_FIELDS = ("codec", "key_offset_digest")

_SAMPLE_BYTES = 1 << 20


@lru_cache(maxsize=8)
def model_fingerprint(model_dir: str) -> str:
    """Digest of a Hugging Face model directory's config and weights.

    Hashes ``config.json`` plus, per ``*.safetensors`` file, its size, its header
    (tensor names, dtypes, shapes, offsets) and 1 MiB of tensor bytes from its
    middle: cheap (no full read of the weights) and different for another model or
    fine-tune of the same architecture.
    """
    root = Path(model_dir)
    h = hashlib.sha256()
    config = root / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    files = sorted(root.glob("*.safetensors"))
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}:{size}\n".encode())
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            h.update(f.read(min(header_len, 1 << 26)))
            data_start = 8 + header_len
            f.seek(data_start + max(0, (size - data_start - _SAMPLE_BYTES) // 2))
            h.update(f.read(_SAMPLE_BYTES))
    if not files and not config.is_file():
        raise FileNotFoundError(f"{model_dir} has neither config.json nor *.safetensors; "
                                "pass a Hugging Face model directory")
    return h.hexdigest()[:16]


def model_shape(model_dir: str) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` from ``config.json``."""
    cfg: dict[str, Any] = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    num_layers = int(cfg["num_hidden_layers"])
    num_heads = int(cfg["num_attention_heads"])
    num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads)
    return num_layers, num_kv_heads, head_dim


@lru_cache(maxsize=8)
def _tokenizer_id(tokenizer_dir: str) -> str:
    from contextkit.config.errors import require
    from contextkit.engine.engine import tokenizer_fingerprint

    transformers = require("transformers", "model")
    return tokenizer_fingerprint(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))


def vllm_cache_identity(
    model_dir: str,
    block_size: int,
    codec: str = "tq4",
    *,
    model_id: str = "",
    tokenizer_dir: str | None = None,
) -> CacheIdentity:
    """The identity of blocks the connector stores for ``model_dir``.

    Args:
        model_dir: the Hugging Face directory vLLM serves.
        block_size: vLLM's block size (tokens per block).
        codec: a block format of :data:`gpu_cache.formats.FORMATS` (the key identity's
            codec; the connector's pools of other formats replace it).
        model_id: explicit model name; default ``sha256:<fingerprint>`` of the weights.
        tokenizer_dir: tokenizer directory when it is not ``model_dir``.

    The key identity has no key offsets: block keys are salted with its digest, so a
    key names the same tokens in every pool of the store. The store's ``tq4`` and
    ``int8`` pools replace ``codec`` and ``key_offset_digest`` (they quantize
    ``k - mu`` and add ``mu`` back on load: vLLM attends over the keys themselves).
    """
    num_layers, num_kv_heads, head_dim = model_shape(model_dir)
    return CacheIdentity(
        model_id=model_id or f"sha256:{model_fingerprint(str(Path(model_dir).resolve()))}",
        num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, codec=codec,
        tokenizer_id=_tokenizer_id(str(Path(tokenizer_dir or model_dir).resolve())),
    )


def same_model(base: CacheIdentity, other: CacheIdentity) -> list[str]:
    """Fields other than the block format (codec, key offsets) where ``other`` differs
    from ``base``; empty when blocks of ``other`` come from the same model, tokenizer,
    block size and schema, so the connector can serve them from a pool of their own."""
    return [f.name for f in dataclasses.fields(base) if f.name not in FORMAT_FIELDS
            and getattr(base, f.name) != getattr(other, f.name)]


def check_same_model(base: CacheIdentity, other: CacheIdentity, what: str = "data") -> None:
    """Raise :class:`gpu_cache.CacheIdentityError` (one line naming every differing field
    and both values) when ``other`` is not of ``base``'s model (see :func:`same_model`)."""
    if same_model(base, other):
        base.check_compatible(dataclasses.replace(
            other, codec=base.codec, key_offset_digest=base.key_offset_digest), what=what)
