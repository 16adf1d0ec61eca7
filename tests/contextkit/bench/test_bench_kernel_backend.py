"""`bench kernel` measures the kernel the engine runs: on CPU, the fused compiled one."""

from __future__ import annotations

import torch

from contextkit.bench.kernel import _resolve_backend
from gpu_cache.kernels import cpu_decode


def test_auto_on_cpu_is_the_fused_kernel_when_it_builds() -> None:
    want = "cpu" if cpu_decode.fused_available() else "torch"
    assert _resolve_backend("auto", torch.device("cpu")) == want
    assert cpu_decode.backend() == "cpp"  # this machine kind has g++ and ninja


def test_an_explicit_backend_is_kept() -> None:
    for name in ("torch", "cpu", "triton"):
        assert _resolve_backend(name, torch.device("cpu")) == name
