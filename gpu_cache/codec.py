"""TurboQuant TQ4 codec: seeded rotation, Lloyd-Max 4-bit coordinates, float32 norms.

Encoding of one head vector ``x`` (dimension d):

1. ``n = ||x||``; ``u = x / n`` (a zero vector encodes as norm 0).
2. ``r = u @ R.T`` with one fixed, seeded orthogonal ``R`` (randomized Hadamard
   ``H @ diag(s) / sqrt(d)`` when d is a power of two, QR-Haar otherwise).
3. Each coordinate of ``r`` becomes the index of its nearest Lloyd-Max centroid.
4. The stored norm is ``n / ||c[idx]||`` so that decode is simply
   ``x_hat = norm * c[idx] @ R`` with no correction term: the reconstruction has
   exactly the input's length.

Packing ("split-half" nibble order, pinned by tests): byte ``j`` of a packed vector
holds coordinate ``j`` in its low nibble and coordinate ``j + d/2`` in its high nibble,
``byte = idx[j] | (idx[j + d/2] << 4)`` for ``j < d/2``. Kernels therefore see the two
halves of the rotated vector as two contiguous ``[d/2]`` slices, never interleaved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from gpu_cache._errors import CodecInputError
from gpu_cache.codebook import Codebook, lloyd_max_codebook
from gpu_cache.kernels import cpu_fused

__all__ = ["TQ4Codec", "TQ4Encoded", "rotation_matrix"]

SUPPORTED_BITS = (4,)


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@lru_cache(maxsize=32)
def _rotation_cpu(head_dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if _is_pow2(head_dim):
        signs = torch.randint(0, 2, (head_dim,), generator=gen, dtype=torch.int64) * 2 - 1
        rot = _hadamard(head_dim) * signs.to(torch.float64)[None, :] / math.sqrt(head_dim)
    else:
        a = torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float64)
        q, r = torch.linalg.qr(a)
        rot = q * torch.sign(torch.diagonal(r))[None, :]  # Haar-distributed
    return rot.to(torch.float32).contiguous()


def rotation_matrix(head_dim: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The codec's orthogonal rotation ``R``, shape ``[d, d]`` float32 (``r = u @ R.T``)."""
    return _rotation_cpu(head_dim, seed).to(device)


@dataclass(frozen=True, slots=True)
class TQ4Encoded:
    """Packed vectors: ``packed`` uint8 ``[..., d/2]`` and ``norms`` float32 ``[...]``."""

    packed: torch.Tensor
    norms: torch.Tensor


@dataclass(eq=False)
class TQ4Codec:
    """Encode and decode head vectors with TurboQuant at 4 bits.

    Args:
        head_dim: d, the per-head vector size (even, >= 4).
        seed: rotation seed; part of the cache identity.
        bits: bits per coordinate; only 4 is implemented.
        device: where the rotation and codebook tensors live.
        cpu_kernels: use the fused numba kernels for CPU tensors when available
            (same codes as the torch path up to boundary ties, several times
            faster). False forces the pure-torch path.
    """

    head_dim: int
    seed: int = 0
    bits: int = 4
    device: torch.device | str = "cpu"
    cpu_kernels: bool = True
    codebook: Codebook = field(init=False)
    rotation: torch.Tensor = field(init=False, repr=False)
    centroids: torch.Tensor = field(init=False, repr=False)
    boundaries: torch.Tensor = field(init=False, repr=False)
    _pair_lut: torch.Tensor = field(init=False, repr=False)
    _signs: torch.Tensor | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(
                f"bits={self.bits} is not implemented; use bits=4 (TQ4). "
                "2- and 3-bit codecs are planned."
            )
        if self.head_dim < 4 or self.head_dim % 2:
            raise ValueError(f"head_dim must be even and >= 4, got {self.head_dim}")
        # As tensors report it ("cuda" -> "cuda:0"), so device checks compare equal.
        self.device = torch.empty(0, device=torch.device(self.device)).device
        self.codebook = lloyd_max_codebook(self.head_dim, self.bits)
        self.rotation = rotation_matrix(self.head_dim, self.seed, self.device)
        self.centroids = torch.tensor(self.codebook.centroids, dtype=torch.float32,
                                      device=self.device)
        self.boundaries = torch.tensor(self.codebook.boundaries, dtype=torch.float32,
                                       device=self.device)
        # lut[byte] = (c[lo], c[hi]): one gather decodes both nibbles of a byte.
        codes = torch.arange(256, device=self.device)
        self._pair_lut = torch.stack(
            [self.centroids[codes & 0xF], self.centroids[codes >> 4]], dim=-1
        ).contiguous()
        if _is_pow2(self.head_dim):
            # R = H diag(s) / sqrt(d) and row 0 of H is all ones, so s = sqrt(d) * R[0].
            self._signs = (self.rotation[0] * math.sqrt(self.head_dim)).round().cpu()

    # ---------------------------------------------------------------- identity
    @property
    def packed_dim(self) -> int:
        """Bytes per packed head vector (``d/2`` at 4 bits)."""
        return self.head_dim * self.bits // 8

    # ---------------------------------------------------------------- checks
    def _check_vectors(self, x: torch.Tensor, what: str) -> None:
        if not isinstance(x, torch.Tensor):
            raise CodecInputError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise CodecInputError(
                f"{what} must be a floating tensor (float32/float16/bfloat16), got {x.dtype}; "
                "cast with .float()"
            )
        if x.dim() < 1 or x.shape[-1] != self.head_dim:
            raise CodecInputError(
                f"{what} must have last dimension head_dim={self.head_dim}, got shape "
                f"{tuple(x.shape)}"
            )
        if x.device != self.device:
            raise CodecInputError(
                f"{what} is on {x.device} but the codec lives on {self.device}; "
                f"move it with .to('{self.device}') or build the codec with device={x.device}"
            )

    def _check_packed(self, enc: TQ4Encoded) -> None:
        p, n = enc.packed, enc.norms
        if p.dtype != torch.uint8:
            raise CodecInputError(f"packed must be uint8, got {p.dtype}")
        if p.shape[-1] != self.packed_dim:
            raise CodecInputError(
                f"packed must have last dimension {self.packed_dim} (head_dim/2), got "
                f"{tuple(p.shape)}"
            )
        if n.dtype != torch.float32 or tuple(n.shape) != tuple(p.shape[:-1]):
            raise CodecInputError(
                f"norms must be float32 of shape {tuple(p.shape[:-1])}, got {n.dtype} "
                f"{tuple(n.shape)}"
            )
        if p.device != self.device or n.device != self.device:
            raise CodecInputError(
                f"packed/norms must be on {self.device}, got {p.device}/{n.device}"
            )

    # ---------------------------------------------------------------- encode
    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ R.T`` in float32; shape preserved."""
        return torch.matmul(x.float(), self.rotation.T)

    def unrotate(self, r: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`rotate` (``r @ R``)."""
        return torch.matmul(r, self.rotation)

    def pack(self, idx: torch.Tensor) -> torch.Tensor:
        """Pack 4-bit indices ``[..., d]`` into bytes ``[..., d/2]`` (split-half order)."""
        half = self.head_dim // 2
        return idx[..., :half] | (idx[..., half:] << 4)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`pack`: bytes ``[..., d/2]`` to indices ``[..., d]`` (uint8)."""
        return torch.cat([packed & 0xF, packed >> 4], dim=-1)

    @property
    def hadamard_signs(self) -> torch.Tensor | None:
        """The random signs ``s`` of ``R = H diag(s) / sqrt(d)`` (CPU float32), or None
        when ``d`` is not a power of two (no fast Walsh-Hadamard path)."""
        return self._signs

    def fused_cpu(self, device: torch.device, num_vectors: int) -> bool:
        """Whether the fused numba kernels serve ``num_vectors`` vectors on ``device``."""
        return (
            self.cpu_kernels
            and self._signs is not None
            and device.type == "cpu"
            and num_vectors >= 256  # below that, thread start-up costs dominate
            and cpu_fused.available()
        )

    def encode(self, x: torch.Tensor) -> TQ4Encoded:
        """Encode vectors ``x`` of shape ``[..., d]``.

        Returns:
            packed uint8 ``[..., d/2]`` and float32 norms ``[...]`` (length-corrected).

        Raises:
            CodecInputError: wrong dtype, last dimension or device.
        """
        self._check_vectors(x, "x")
        if self.fused_cpu(x.device, x.numel() // self.head_dim):
            return self._encode_fused(x)
        x = x.float()
        norms = torch.linalg.vector_norm(x, dim=-1)
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))
        r = self.rotate(x / safe.unsqueeze(-1))
        idx = torch.bucketize(r, self.boundaries)
        # ||c[idx]|| for the length correction.
        recon_norm = torch.linalg.vector_norm(self.centroids[idx], dim=-1)
        stored = torch.where(norms > 0, norms / recon_norm, torch.zeros_like(norms))
        return TQ4Encoded(packed=self.pack(idx.to(torch.uint8)), norms=stored)

    def _encode_fused(self, x: torch.Tensor) -> TQ4Encoded:
        assert self._signs is not None
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.head_dim).float().contiguous()
        packed = torch.empty(flat.shape[0], self.packed_dim, dtype=torch.uint8)
        norms = torch.empty(flat.shape[0], dtype=torch.float32)
        cpu_fused.encode_into(flat.numpy(), self._signs.numpy(), self.boundaries.numpy(),
                              self.centroids.numpy(), packed.numpy(), norms.numpy())
        return TQ4Encoded(packed=packed.reshape(*lead, self.packed_dim), norms=norms.reshape(lead))

    # ---------------------------------------------------------------- decode
    def decode_rotated(self, enc: TQ4Encoded) -> torch.Tensor:
        """Reconstruction in the rotated domain: ``norm * c[idx]``, float32 ``[..., d]``."""
        self._check_packed(enc)
        return self._rotated_values(enc)

    def _rotated_values(self, enc: TQ4Encoded) -> torch.Tensor:
        pairs = self._pair_lut[enc.packed.long()]  # [..., d/2, 2] = (lo, hi)
        vals = torch.cat([pairs[..., 0], pairs[..., 1]], dim=-1)
        return vals * enc.norms.unsqueeze(-1)

    def decode(self, enc: TQ4Encoded) -> torch.Tensor:
        """Decode to float32 vectors ``[..., d]``.

        Raises:
            CodecInputError: wrong dtype, shape or device of packed/norms.
        """
        self._check_packed(enc)
        if self.fused_cpu(enc.packed.device, enc.norms.numel()):
            return self._decode_fused(enc)
        return self.unrotate(self._rotated_values(enc))

    def _decode_fused(self, enc: TQ4Encoded) -> torch.Tensor:
        assert self._signs is not None
        lead = enc.packed.shape[:-1]
        packed = enc.packed.reshape(-1, self.packed_dim).contiguous()
        norms = enc.norms.reshape(-1).contiguous()
        out = torch.empty(packed.shape[0], self.head_dim, dtype=torch.float32)
        cpu_fused.decode_into(packed.numpy(), norms.numpy(), self._signs.numpy(),
                              self.centroids.numpy(), out.numpy())
        return out.reshape(*lead, self.head_dim)
