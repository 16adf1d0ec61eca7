"""Fixtures of the connector's unit tests (no vLLM needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

#: The tiny model's shape: layers, KV heads, head dim (the tests' tensors use the same).
TINY_LAYERS, TINY_HEADS, TINY_DIM = 2, 2, 64


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Hugging Face directory: Llama config.json and a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("models") / "tiny"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "num_hidden_layers": TINY_LAYERS, "num_attention_heads": 4,
        "num_key_value_heads": TINY_HEADS, "head_dim": TINY_DIM, "hidden_size": 256}))
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return path
