"""TQ4 codebook and codec: reference values, nibble order, distortion, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_cache import CodecInputError, TQ4Codec, lloyd_max_codebook, rotation_matrix
from gpu_cache.kernels import cpu_fused

# SPEC 1.1: positive centroids at d=128, in units of 1/sqrt(d).
REFERENCE_D128 = [0.1279, 0.3864, 0.6536, 0.9371, 1.2478, 1.6043, 2.0459, 2.6889]


def test_codebook_matches_reference_values_at_d128() -> None:
    cb = lloyd_max_codebook(128, 4)
    scaled = [c * math.sqrt(128) for c in cb.centroids]
    assert len(scaled) == 16
    assert scaled[8:] == pytest.approx(REFERENCE_D128, abs=6e-5)
    assert scaled[:8] == pytest.approx([-c for c in reversed(REFERENCE_D128)], abs=6e-5)
    assert cb.mse_unit_vector == pytest.approx(0.0093, abs=1e-4)


@pytest.mark.parametrize("d", [16, 64, 96, 256])
def test_codebook_is_symmetric_sorted_and_cached(d: int) -> None:
    cb = lloyd_max_codebook(d, 4)
    c = torch.tensor(cb.centroids)
    assert torch.all(c[1:] > c[:-1])
    assert torch.allclose(c, -c.flip(0), atol=1e-9)
    b = torch.tensor(cb.boundaries)
    assert torch.allclose(b, (c[1:] + c[:-1]) / 2)
    assert lloyd_max_codebook(d, 4) is cb


def test_codebook_approaches_gaussian_lloyd_max_for_large_d() -> None:
    # The 4-bit Lloyd-Max quantizer of N(0,1) has its outermost level at 2.7326.
    cb = lloyd_max_codebook(4096, 4)
    assert cb.centroids[-1] * math.sqrt(4096) == pytest.approx(2.7326, abs=2e-3)


@pytest.mark.parametrize("d,pow2", [(64, True), (128, True), (96, False)])
def test_rotation_is_orthogonal_and_seeded(d: int, pow2: bool) -> None:
    r = rotation_matrix(d, seed=3)
    assert torch.allclose(r @ r.T, torch.eye(d), atol=1e-5)
    assert torch.equal(r, rotation_matrix(d, seed=3))
    assert not torch.equal(r, rotation_matrix(d, seed=4))
    if pow2:  # randomized Hadamard: every entry is +-1/sqrt(d)
        assert torch.allclose(r.abs(), torch.full_like(r, 1 / math.sqrt(d)))


def test_nibble_order_is_split_half_low_first() -> None:
    codec = TQ4Codec(8)
    idx = torch.tensor([[1, 2, 3, 4, 9, 10, 11, 15]], dtype=torch.uint8)
    packed = codec.pack(idx)
    # byte j = idx[j] | idx[j + d/2] << 4
    assert packed.tolist() == [[0x91, 0xA2, 0xB3, 0xF4]]
    assert torch.equal(codec.unpack(packed), idx)


def test_encoded_bytes_decode_the_indices_they_were_built_from() -> None:
    codec = TQ4Codec(8, cpu_kernels=False)
    # A vector already in the rotated frame: x = r @ R, so rotate(x) == r exactly.
    r = torch.tensor([[0.9, -0.3, 0.05, -0.02, 0.1, 0.2, -0.15, 0.0]])
    x = codec.unrotate(r / r.norm())
    enc = codec.encode(x)
    expected = torch.bucketize(codec.rotate(x / x.norm()), codec.boundaries).to(torch.uint8)
    assert torch.equal(codec.unpack(enc.packed), expected)
    lo, hi = enc.packed[0, 0] & 0xF, enc.packed[0, 0] >> 4
    assert int(lo) == int(expected[0, 0]) and int(hi) == int(expected[0, 4])


@pytest.mark.parametrize("cpu_kernels", [False, True], ids=["torch", "fused"])
def test_unit_vector_mse_and_length_preservation(cpu_kernels: bool) -> None:
    codec = TQ4Codec(128, cpu_kernels=cpu_kernels)
    u = torch.randn(8192, 128, generator=torch.Generator().manual_seed(0))
    u = u / u.norm(dim=-1, keepdim=True)
    enc = codec.encode(u)
    out = codec.decode(enc)
    mse = ((u - out) ** 2).sum(-1).mean().item()
    assert mse <= 0.0095
    assert mse == pytest.approx(codec.codebook.mse_unit_vector, rel=0.05)
    assert torch.allclose(out.norm(dim=-1), torch.ones(8192), atol=1e-4)


def test_fused_cpu_path_matches_torch_path() -> None:
    if not cpu_fused.available():
        pytest.fail("numba is part of the default install; the fused CPU path must be available")
    fused, plain = TQ4Codec(128), TQ4Codec(128, cpu_kernels=False)
    x = torch.randn(16384, 128, generator=torch.Generator().manual_seed(1))
    x = x * torch.logspace(-3, 3, 16384).unsqueeze(-1)  # widely varying norms
    a, b = fused.encode(x), plain.encode(x)
    differ = codec_index_mismatch(plain, a.packed, b.packed)
    # Only coordinates within float rounding of a boundary may land on the other side.
    assert differ <= 2e-5 * x.numel()
    rel = ((a.norms - b.norms).abs() / b.norms).max().item()
    assert rel < 1e-2
    assert torch.allclose(fused.decode(a), plain.decode(a), rtol=1e-4, atol=1e-4 * 1e3)


def codec_index_mismatch(codec: TQ4Codec, p1: torch.Tensor, p2: torch.Tensor) -> int:
    i1, i2 = codec.unpack(p1).int(), codec.unpack(p2).int()
    assert (i1 - i2).abs().max().item() <= 1
    return int((i1 != i2).sum())


def test_zero_vector_round_trips_to_zero() -> None:
    codec = TQ4Codec(64)
    x = torch.zeros(3, 64)
    # Seeded: one vector's cosine after 4-bit quantization varies around 0.995 and an
    # unseeded draw fell under 0.99 in about one run of ten.
    x[1] = torch.randn(64, generator=torch.Generator().manual_seed(0))
    out = codec.decode(codec.encode(x))
    assert torch.equal(out[0], torch.zeros(64)) and torch.equal(out[2], torch.zeros(64))
    assert torch.cosine_similarity(out[1], x[1], dim=0) > 0.99


def test_batch_shapes_are_preserved() -> None:
    codec = TQ4Codec(32)
    x = torch.randn(2, 3, 5, 32)
    enc = codec.encode(x)
    assert enc.packed.shape == (2, 3, 5, 16) and enc.packed.dtype == torch.uint8
    assert enc.norms.shape == (2, 3, 5) and enc.norms.dtype == torch.float32
    assert codec.decode(enc).shape == x.shape


@pytest.mark.parametrize(
    "bad,match",
    [
        (torch.zeros(4, 64, dtype=torch.int32), "floating"),
        (torch.zeros(4, 63), "last dimension"),
        (torch.zeros(4, 64, device="meta"), "move it"),
    ],
    ids=["int-dtype", "wrong-dim", "wrong-device"],
)
def test_encode_rejects_bad_input(bad: torch.Tensor, match: str) -> None:
    with pytest.raises(CodecInputError, match=match):
        TQ4Codec(64).encode(bad)


def test_decode_rejects_bad_packed_input() -> None:
    codec = TQ4Codec(64)
    enc = codec.encode(torch.randn(4, 64))
    with pytest.raises(CodecInputError, match="uint8"):
        codec.decode(type(enc)(enc.packed.int(), enc.norms))
    with pytest.raises(CodecInputError, match="norms must be float32"):
        codec.decode(type(enc)(enc.packed, enc.norms.double()))
    with pytest.raises(CodecInputError, match="last dimension"):
        codec.decode(type(enc)(enc.packed[:, :10], enc.norms))


def test_unsupported_bits_and_dims_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="use bits=4"):
        TQ4Codec(64, bits=3)
    with pytest.raises(ValueError, match="even"):
        TQ4Codec(63)
