"""`bench kernel` measures the kernel the engine runs: on CPU, the fused compiled one."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from contextkit.bench.kernel import _resolve_backend, _sweep_configs, add_arguments, run
from gpu_cache.kernels import cpu_decode
from gpu_cache.kernels.decode_config import CUDA_DECODE, EXACT_DECODE, DecodeConfig

H100_SWEEP = Path(__file__).resolve().parents[3] / "bench/results/kernel-sweep-h100-3.json"


def test_auto_on_cpu_is_the_fused_kernel_when_it_builds() -> None:
    want = "cpu" if cpu_decode.fused_available() else "torch"
    assert _resolve_backend("auto", torch.device("cpu")) == want
    assert cpu_decode.backend() == "cpp"  # this machine kind has g++ and ninja


def test_an_explicit_backend_is_kept() -> None:
    for name in ("torch", "cpu", "triton"):
        assert _resolve_backend(name, torch.device("cpu")) == name


def test_sweep_starts_with_the_exact_launch_and_holds_each_setting_once() -> None:
    configs = _sweep_configs()
    assert configs[0] == EXACT_DECODE and CUDA_DECODE in configs
    assert len({c.label() for c in configs}) == len(configs)


def test_a_saved_gpu_result_is_drawn_without_measuring(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    png = tmp_path / "kernel.png"
    args = parser.parse_args(["--from-json", str(H100_SWEEP),
                              "--plot", str(png)])
    result = run(args)
    assert result["machine"]["device_name"] == "NVIDIA H100 80GB HBM3"
    assert png.stat().st_size > 10_000
    bad = tmp_path / "other.json"
    bad.write_text('{"bench": "quant"}')
    args = parser.parse_args(["--from-json", str(bad), "--plot", str(png)])
    with pytest.raises(SystemExit, match="not a `bench kernel` result"):
        run(args)


def test_launch_settings_refuse_what_the_kernel_cannot_compile() -> None:
    with pytest.raises(ValueError, match="power of two"):
        DecodeConfig(block_n=48)
    with pytest.raises(ValueError, match="lookup"):
        DecodeConfig(lookup="pairs")  # type: ignore[arg-type]
