"""vLLM's paged KV layouts: page views, K/V splits and the rows the load path decodes
into (no vLLM needed), and the bfloat16 AMX pages the connector casts its context into
(marked ``vllm``: checked against vLLM's own kernel)."""

from __future__ import annotations

import pytest
import torch

from integrations.vllm.layout import CPU_LAYOUT, SPLIT_LAYOUT

NB, H, N, D = 7, 3, 4, 8


def _layer() -> torch.Tensor:
    """One layer of vLLM's KV, logically ``[num_blocks, H, N, 2D]``."""
    return torch.randn(NB, H, N, 2 * D, generator=torch.Generator().manual_seed(1))


def test_cpu_rows_name_the_rows_that_split_reads_as_keys_and_values():
    kv = _layer()
    ids = torch.tensor([5, 0, 3])
    k, v = CPU_LAYOUT.split(CPU_LAYOUT.pages(kv)[ids])  # [n, H, N, D]
    assert CPU_LAYOUT.rows is not None
    k_rows, v_rows = CPU_LAYOUT.rows(ids, H, N)
    rows = kv.view(-1, D)
    # rows are in the stored blocks' order: block, token, head
    assert torch.equal(rows[k_rows].view(3, N, H, D), k.permute(0, 2, 1, 3))
    assert torch.equal(rows[v_rows].view(3, N, H, D), v.permute(0, 2, 1, 3))
    assert len(set(k_rows.tolist()) | set(v_rows.tolist())) == 2 * 3 * N * H


def test_writing_rows_writes_the_pages_join_would():
    kv, want = torch.zeros(NB, H, N, 2 * D), torch.zeros(NB, H, N, 2 * D)
    ids = torch.tensor([6, 2])
    k, v = torch.randn(2, N, H, D), torch.randn(2, N, H, D)  # contextkit's block layout
    k_rows, v_rows = CPU_LAYOUT.rows(ids, H, N)  # type: ignore[misc]
    kv.view(-1, D).index_copy_(0, k_rows, k.reshape(-1, D))
    kv.view(-1, D).index_copy_(0, v_rows, v.reshape(-1, D))
    CPU_LAYOUT.pages(want).index_copy_(0, ids, CPU_LAYOUT.join(k.permute(0, 2, 1, 3),
                                                               v.permute(0, 2, 1, 3)))
    assert torch.equal(kv, want)


def test_split_layout_has_no_rows_its_strides_may_be_permuted():
    assert SPLIT_LAYOUT.rows is None
    k, v = SPLIT_LAYOUT.split(SPLIT_LAYOUT.pages(_layer()))
    assert k.shape == v.shape == (NB, H, N, D)


@pytest.mark.vllm
@pytest.mark.parametrize("order", ["token", "dim"])
def test_the_fused_cast_lays_out_amx_pages_as_vllms_own_kernel(order: str) -> None:
    from integrations.vllm.layout import probe_amx_pages

    assert probe_amx_pages(order, 32, 64)
    assert probe_amx_pages(order, 64, 32)
    assert not probe_amx_pages(order, 16, 64)  # the AMX kernel's tiles need 32 tokens
