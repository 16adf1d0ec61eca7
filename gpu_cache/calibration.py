"""Per-head key offsets: a calibrated mean key subtracted before TQ4 encoding.

Keys of a head share a large common component; quantizing ``k - mu`` instead of
``k`` spends the 4 bits on what differs between tokens. Attention needs no
correction: for one query every score shifts by the same ``q . mu``, and softmax is
invariant to that. Only code that needs the keys themselves (exporting plain KV to
another engine, or mixing cached keys with fresh uncentered ones) adds ``mu`` back
or subtracts it from the fresh ones. The offsets are part of the cache identity.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

__all__ = ["key_offset_digest", "mean_key_offsets"]


def mean_key_offsets(keys_per_layer: Sequence[torch.Tensor]) -> torch.Tensor:
    """Offsets ``[num_layers, num_kv_heads, head_dim]`` from calibration keys.

    Args:
        keys_per_layer: per layer, keys ``[num_kv_heads, num_tokens, head_dim]``
            (post-RoPE, as the cache stores them) from a calibration text.
    """
    if not keys_per_layer:
        raise ValueError("need calibration keys for at least one layer")
    return torch.stack([k.float().mean(dim=1) for k in keys_per_layer]).contiguous()


def key_offset_digest(offsets: torch.Tensor | None) -> str:
    """Short digest of the offsets for :class:`gpu_cache.CacheIdentity` (empty: none)."""
    if offsets is None:
        return ""
    data = offsets.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]
