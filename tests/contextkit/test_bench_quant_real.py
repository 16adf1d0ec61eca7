"""The real-KV capture behind ``attn_cosine_real`` is faithful to SmolLM2 itself."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from contextkit.bench.quant import _attention, _pydoc_tokens, capture_real_qkv
from contextkit.models import load_model, load_tokenizer
from gpu_cache import TQ4Codec
from gpu_cache.calibration import mean_key_offsets

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model() -> Any:
    return load_model()


def test_captured_qkv_reproduce_the_models_attention_output(model: Any) -> None:
    ids = _pydoc_tokens(96, load_tokenizer(), reverse=False)
    seen: list[torch.Tensor] = []
    layer = model.model.layers[5].self_attn
    handle = layer.o_proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        qkv = capture_real_qkv(model, ids)
    finally:
        handle.remove()
    assert len(qkv) == model.config.num_hidden_layers
    q, k, v = qkv[5]
    assert q.shape == (9, 96, 64) and k.shape == (3, 96, 64) and v.shape == (3, 96, 64)
    ours = _attention(q, k, v, causal_offset=0)  # [Hq, T, D]
    theirs = seen[0][0].view(96, 9, 64).transpose(0, 1)
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-3)


def test_key_offsets_improve_tq4_attention_on_real_keys(model: Any) -> None:
    tok = load_tokenizer()
    calib = capture_real_qkv(model, _pydoc_tokens(256, tok, reverse=True))
    offsets = mean_key_offsets([k for _, k, _ in calib])
    qkv = capture_real_qkv(model, _pydoc_tokens(256, tok, reverse=False))
    codec = TQ4Codec(64)
    rt = lambda x: codec.decode(codec.encode(x))  # noqa: E731
    plain, centered = [], []
    for layer, (q, k, v) in enumerate(qkv):
        qs = q[:, -32:]
        ref = _attention(qs, k, v, causal_offset=k.shape[1] - 32)
        cos = lambda out: torch.nn.functional.cosine_similarity(  # noqa: E731
            out.flatten(0, 1), ref.flatten(0, 1), dim=-1)
        plain.append(cos(_attention(qs, rt(k), rt(v), causal_offset=k.shape[1] - 32)))
        mu = offsets[layer].unsqueeze(1)
        centered.append(cos(_attention(qs, rt(k - mu), rt(v), causal_offset=k.shape[1] - 32)))
    assert torch.cat(centered).mean() > torch.cat(plain).mean()
    assert torch.cat(centered).mean() > 0.985
