"""Chunk reuse's model check and its refusals (no vLLM needed)."""

from __future__ import annotations

import torch

from integrations.vllm.chunk_forward import (
    attention_dtype,
    cpu_has_amx_bf16,
    cpu_multiplies_bf16,
    matmul_dtype,
    served_llama,
)
from integrations.vllm.chunk_gate import compare_logits


def test_a_model_the_connector_cannot_drive_is_refused_with_its_reason() -> None:
    model, why = served_llama(None)
    assert model is None and why is not None and "--load-format contextkit" in why

    class GPT2LMHeadModel(torch.nn.Module):
        pass

    model, why = served_llama(GPT2LMHeadModel())
    assert model is None and why is not None
    assert why.startswith("GPT2LMHeadModel is not a Llama-family decoder")

    class LlamaForCausalLM(torch.nn.Module):  # the name, not the layout
        pass

    model, why = served_llama(LlamaForCausalLM())
    assert model is None and why is not None and "Llama module layout" in why


def test_the_gate_passes_agreeing_logits_and_fails_a_constructed_bad_case() -> None:
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(30, 50, generator=gen)
    same = compare_logits(full + 1e-4 * torch.randn(30, 50, generator=gen), full,
                          min_agreement=0.9, max_kl=0.1)
    assert same.passed and same.agreement == 1.0 and same.reason() is None
    bad = compare_logits(full.roll(1, dims=0), full, min_agreement=0.9, max_kl=0.1)
    assert not bad.passed and bad.agreement < 0.9
    reason = bad.reason()
    assert reason is not None and "check failed" in reason and "30 tokens" in reason


def test_chunk_settings_are_checked_with_one_line_each() -> None:
    import pytest

    from integrations.vllm.config import ConnectorConfig, ConnectorConfigError

    with pytest.raises(ConnectorConfigError, match="chunk_repair_ratio must be in"):
        ConnectorConfig(chunk_repair_ratio=1.5)
    with pytest.raises(ConnectorConfigError, match="chunk_gate_min_agreement"):
        ConnectorConfig(chunk_gate_min_agreement=2.0)
    with pytest.raises(ConnectorConfigError, match="chunk_min_tokens"):
        ConnectorConfig(chunk_min_tokens=0)
    with pytest.raises(ConnectorConfigError,
                       match="chunk_matmul_dtype must be one of auto, model, bfloat16"):
        ConnectorConfig(chunk_matmul_dtype="float16")
    config = ConnectorConfig(chunk_reuse=True, chunk_layers="documents, user_turn")
    assert config.chunk_labels == frozenset({"documents", "user_turn"})
    assert ConnectorConfig().chunk_labels is None
    again = ConnectorConfig.from_extra_config(config.to_extra_config())
    assert again.chunk_reuse and again.chunk_layers == config.chunk_layers


def test_the_connector_forward_multiplies_in_bfloat16_where_the_cpu_has_bf16_dot_products(
        tmp_path) -> None:
    amx = tmp_path / "amx"
    amx.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile\n")
    zen = tmp_path / "zen"
    zen.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n")
    plain = tmp_path / "plain"
    plain.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n")
    assert cpu_has_amx_bf16(str(amx)) and not cpu_has_amx_bf16(str(zen))
    assert not cpu_has_amx_bf16(str(tmp_path / "missing"))
    assert cpu_multiplies_bf16(str(amx)) and cpu_multiplies_bf16(str(zen))
    assert not cpu_multiplies_bf16(str(plain))
    assert not cpu_multiplies_bf16(str(tmp_path / "missing"))
    assert matmul_dtype("bfloat16", "cpu") is torch.bfloat16
    assert matmul_dtype("model", "cpu") is None
    # auto: bfloat16 on a CPU with bfloat16 dot products (this machine's flags decide)
    assert matmul_dtype("auto", "cpu") is (torch.bfloat16 if cpu_multiplies_bf16() else None)
    assert matmul_dtype("auto", "meta") is None
    # attention follows bfloat16 projections onto AMX only (vLLM's AMX kernel)
    amx = cpu_has_amx_bf16()
    assert attention_dtype(torch.bfloat16, "cpu") is (torch.bfloat16 if amx else None)
    assert attention_dtype(None, "cpu") is None
    assert attention_dtype(torch.bfloat16, "meta") is None
