"""Chunk reuse's attention over chosen tokens: torch's SDPA over the context, and vLLM's
own CPU cache and attention kernels straight over the pages; and its low-precision
projections, through torch or vLLM's prepacked GEMM (the tests marked ``vllm`` need
vLLM's CPU build: ``make test-vllm``)."""

from __future__ import annotations

import math

import pytest
import torch

from integrations.vllm.chunk_forward import ContiguousKV, LowLinear, PagedKV, Runs, attend_sdpa
from integrations.vllm.layout import CPU_LAYOUT

H, H_KV, D, N = 6, 2, 32, 32
#: a long run (a changed document), seams of 3 and 1 tokens, a run ending the range
POSITIONS = [*range(5, 9), *range(40, 43), 70, *range(90, 120)]


def _qkv(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(t, H, D, generator=gen), torch.randn(t, H_KV, D, generator=gen),
            torch.randn(t, H_KV, D, generator=gen))


def _context(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V ``[length, H_kv, D]`` of every position (the reused context)."""
    _, k, v = _qkv(length, seed=1)
    return k, v


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int]
           ) -> torch.Tensor:
    """Each query at position p over keys 0..p, one softmax at a time."""
    out = torch.empty_like(q)
    group = H // H_KV
    for row, p in enumerate(positions):
        for h in range(H):
            scores = k[:p + 1, h // group] @ q[row, h] / math.sqrt(D)
            out[row, h] = torch.softmax(scores, 0) @ v[:p + 1, h // group]
    return out


def _paged(order: str, isa: str | None) -> PagedKV:
    blocks = 12
    pages = [CPU_LAYOUT.pages(torch.zeros(blocks, H_KV, N, 2 * D))]
    ids = [int(i) for i in torch.randperm(blocks, generator=torch.Generator().manual_seed(2))]
    return PagedKV(pages, CPU_LAYOUT.split, order, ids, N, isa=isa)


def _attend(kv: ContiguousKV | PagedKV, positions: list[int],
            dtype: torch.dtype | None = None) -> torch.Tensor:
    """Write the context, then the chosen tokens' K/V over it, and attend (in
    ``dtype``)."""
    length = max(positions) + 1
    k, v = _context(length)
    kv.write(0, torch.arange(length), k, v)
    q, k_new, v_new = _qkv(len(positions), seed=3)
    runs = Runs.of(positions)
    kv.write(0, runs.positions, k_new, v_new)
    return kv.attend(0, q, runs, 1 / math.sqrt(D), dtype)


def test_runs_group_consecutive_positions() -> None:
    runs = Runs.of(POSITIONS)
    assert runs.spans == ((0, 4, 9), (4, 7, 43), (7, 8, 71), (8, 38, 120))
    assert runs.upto == 120


def test_sdpa_over_the_context_is_causal_attention_at_each_position() -> None:
    length = max(POSITIONS) + 1
    k, v = _context(length)
    q, k_new, v_new = _qkv(len(POSITIONS), seed=3)
    at = torch.tensor(POSITIONS)
    k[at], v[at] = k_new, v_new
    got = attend_sdpa(q, k.transpose(0, 1), v.transpose(0, 1), Runs.of(POSITIONS),
                      1 / math.sqrt(D))
    torch.testing.assert_close(got, _naive(q, k, v, POSITIONS), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("order", ["token", "dim"])
def test_paged_attention_is_the_contiguous_attention(order: str) -> None:
    want = _attend(ContiguousKV(1, H_KV, max(POSITIONS) + 1, D), POSITIONS)
    torch.testing.assert_close(_attend(_paged(order, None), POSITIONS), want)


@pytest.mark.vllm
def test_vllms_kernels_write_and_attend_as_the_torch_path_does() -> None:
    from integrations.vllm.layout import probe_cpu_key_order

    isa = "vec"  # vLLM's CPU kernel for float32 pages of 32 tokens on x86
    order = probe_cpu_key_order(isa, N, D)
    assert order is not None
    torch_path, kernels = _paged(order, None), _paged(order, isa)
    want = _attend(torch_path, POSITIONS)
    got = _attend(kernels, POSITIONS)
    # the kernel wrote every token where the torch path did, in the same key order
    for a, b in zip(torch_path.context(0, 120), kernels.context(0, 120), strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


#: bfloat16 keeps 8 bits of mantissa: attention outputs of order 1 within this
BF16_ATOL = 2e-2


def test_attention_in_bfloat16_is_the_float32_attention_to_its_precision() -> None:
    length = max(POSITIONS) + 1
    want = _attend(ContiguousKV(1, H_KV, length, D), POSITIONS)
    got = _attend(ContiguousKV(1, H_KV, length, D), POSITIONS, torch.bfloat16)
    assert got.dtype == torch.float32
    assert not torch.equal(got, want)  # computed in bfloat16, not float32
    torch.testing.assert_close(got, want, atol=BF16_ATOL, rtol=0)


@pytest.mark.vllm
def test_vllms_kernel_attends_in_bfloat16_over_a_copy_of_float32_pages() -> None:
    from integrations.vllm.layout import probe_cpu_key_order

    isa = "vec"
    order = probe_cpu_key_order(isa, N, D)
    assert order is not None
    torch_path, kernels = _paged(order, None), _paged(order, isa)
    want = _attend(torch_path, POSITIONS, torch.bfloat16)  # torch's SDPA in bfloat16
    got = _attend(kernels, POSITIONS, torch.bfloat16)  # AMX's kernel where the CPU has it
    # the pages keep the float32 K/V written, as the float32 path leaves them
    for a, b in zip(torch_path.context(0, 120), kernels.context(0, 120), strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    torch.testing.assert_close(got, want, atol=BF16_ATOL, rtol=0)
    # and again on the same pages: the bfloat16 copy follows what was written since
    q, k_new, v_new = _qkv(1, seed=5)
    runs = Runs.of([119])
    for kv in (torch_path, kernels):
        kv.write(0, runs.positions, k_new, v_new)
    torch.testing.assert_close(kernels.attend(0, q, runs, 1 / math.sqrt(D), torch.bfloat16),
                               torch_path.attend(0, q, runs, 1 / math.sqrt(D), torch.bfloat16),
                               atol=BF16_ATOL, rtol=0)


def _projection() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    weight = (torch.randn(96, 64, generator=gen) * 0.05).to(torch.bfloat16)
    return weight, torch.randn(96, generator=gen), torch.randn(5, 64, generator=gen)


def test_a_low_projection_is_the_product_in_its_dtype_plus_the_bias() -> None:
    weight, bias, x = _projection()
    got = LowLinear(weight, bias)(x)  # no prepacked GEMM: torch's linear
    want = (x.to(torch.bfloat16).float() @ weight.float().T).to(torch.bfloat16).float() + bias
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


@pytest.mark.vllm
def test_vllms_prepacked_gemm_gives_torchs_products() -> None:
    weight, bias, x = _projection()
    packed = LowLinear.of(weight, bias)
    assert packed.gemm is not None  # vLLM's CPU build prepacks it
    torch.testing.assert_close(packed(x), LowLinear(weight, bias)(x), atol=1e-6, rtol=0)
