"""Moving stored chunks into pages (no vLLM needed): the fused kernel and the torch
path write the same K/V, each moved key rotated by its position delta."""

from __future__ import annotations

import pytest
import torch

from gpu_cache import hash_token_blocks
from gpu_cache.kernels import cpu_fused
from integrations.vllm.chunk_forward import PagedKV, ServedLlama
from integrations.vllm.chunk_placement import ChunkPlacement
from integrations.vllm.chunk_planning import MovedChunk
from integrations.vllm.config import ConnectorConfig
from integrations.vllm.identity import vllm_cache_identity
from integrations.vllm.layout import CPU_LAYOUT, keys_by_token
from integrations.vllm.precision import BlockLabel
from integrations.vllm.store import ConnectorStore

from .test_store import _model_dir

BS, LAYERS, HEADS, DIM, SOURCES, BLOCKS = 16, 2, 2, 64, 4, 12


def rotation(delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos/sin for ``delta`` (theta 10000), as ServedLlama.rotation gives them."""
    freq = 10000.0 ** (-torch.arange(0, DIM, 2, dtype=torch.float32) / DIM)
    angle = delta.float()[:, None] * freq[None, :]
    return angle.cos()[:, None, :], angle.sin()[:, None, :]


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[ConnectorStore, list[bytes]]:
    root = tmp_path_factory.mktemp("placement")
    ident = vllm_cache_identity(str(_model_dir(root, "tiny")), BS, "tq4")
    store = ConnectorStore(ident, ConnectorConfig(
        block_size=BS, shadow_url="", local_store=f"file://{root / 'local'}", host_blocks=8,
        shadow_on_save=False))
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(LAYERS, SOURCES, BS, HEADS, DIM, generator=g) for _ in range(2))
    keys = hash_token_blocks(ident.digest(), "t", list(range(SOURCES * BS)), BS)
    store.save(k, v, keys, "t", [BlockLabel("documents", fmt="tq4")] * SOURCES)
    return store, keys


def place(stored: tuple[ConnectorStore, list[bytes]], order: str, fused: bool,
          isa: str | None = None) -> list[torch.Tensor]:
    """The two chunks placed into empty pages: by the fused kernel, or by torch ops
    (through vLLM's cache kernel for ``isa``)."""
    store, keys = stored
    # two chunks: one across source blocks 0-2 moved forward, one from block 3 moved back
    chunks = [MovedChunk([keys[0], keys[1], keys[2]], 5, 5, 61, 30, "documents"),
              MovedChunk([keys[3]], 2, 50, 20, 9, "documents")]
    sources = {key: i for i, key in enumerate(keys)}
    layers = [torch.zeros(BLOCKS, HEADS, BS, 2 * DIM) for _ in range(LAYERS)]
    paged = PagedKV([CPU_LAYOUT.pages(t) for t in layers], CPU_LAYOUT.split, order,
                    list(range(BLOCKS - 1, -1, -1)), BS, isa="vec" if fused else isa)
    parts = store.export_all(keys, "t")
    assert parts is not None
    ChunkPlacement.of(chunks, sources, BS, rotation).run(
        parts, paged, CPU_LAYOUT.rows if fused else None)
    return layers


@pytest.mark.skipif(not cpu_fused.available(), reason="numba is not installed")
@pytest.mark.parametrize("order", ["token", "dim"])
def test_the_fused_kernel_writes_what_the_torch_path_writes(
        stored: tuple[ConnectorStore, list[bytes]], order: str) -> None:
    fused, reference = place(stored, order, True), place(stored, order, False)
    for a, b in zip(fused, reference, strict=True):
        assert (b != 0).any() and torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("order", ["token", "dim"])
def test_a_moved_key_is_the_stored_key_rotated_by_its_delta(
        stored: tuple[ConnectorStore, list[bytes]], order: str) -> None:
    """Token 61 of the request is slot 5 of source block 0, computed at 5."""
    store, keys = stored
    layers = place(stored, order, cpu_fused.available())
    k_stored, v_stored = store.read(keys, "t")
    page = CPU_LAYOUT.pages(layers[1])[BLOCKS - 1 - 61 // BS]  # block ids run backwards
    k_page, v_page = CPU_LAYOUT.split(page[None])
    k_here = keys_by_token(k_page, order)[0, :, 61 % BS]
    # stored blocks are pages: their key half in the pages' order
    k_source = keys_by_token(k_stored[1, 0].permute(1, 0, 2), order)[:, 5]
    want = ServedLlama.rotate_with(k_source[None], *rotation(torch.tensor([56])))[0]
    assert torch.allclose(k_here, want, atol=1e-5)
    assert torch.allclose(v_page[0, :, 61 % BS], v_stored[1, 0, 5], atol=1e-6)
    # the tokens around the chunks stay untouched
    assert not keys_by_token(k_page, order)[0, :, 60 % BS].any()
    assert not v_page[0, :, 60 % BS].any()


@pytest.mark.vllm
def test_the_fused_kernel_writes_what_vllms_cache_kernel_writes(
        stored: tuple[ConnectorStore, list[bytes]]) -> None:
    from integrations.vllm.layout import probe_cpu_key_order

    isa = "vec"  # vLLM's CPU kernel for float32 pages on x86
    order = probe_cpu_key_order(isa, BS, DIM)
    assert order is not None
    fused, vllm_written = place(stored, order, True), place(stored, order, False, isa)
    for a, b in zip(fused, vllm_written, strict=True):
        assert (b != 0).any() and torch.allclose(a, b, atol=1e-5)
