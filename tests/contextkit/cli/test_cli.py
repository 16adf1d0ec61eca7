"""The CLI: help is true, benchmarks print one JSON object as the last stdout line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from contextkit.bench import BENCHMARKS
from contextkit.cli.commands import build_parser, main

ROOT = Path(__file__).resolve().parents[3]


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "contextkit.cli", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_help_lists_every_command_and_benchmark() -> None:
    out = run_cli("--help")
    assert out.returncode == 0
    for command in ("demo", "recover", "bench"):
        assert command in out.stdout
    bench = run_cli("bench", "--help")
    for name in BENCHMARKS:
        assert name in bench.stdout


def test_version_prints_the_installed_distribution_version() -> None:
    from importlib import metadata

    out = run_cli("--version")
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout == f"contextkit {metadata.version('contextkit')}\n"
    help_text = run_cli("--help").stdout
    assert "--version" in help_text and "--debug" in help_text
    assert "--debug" in run_cli("status", "--help").stdout


def test_unknown_benchmark_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", "nope"])
    assert exc.value.code == 2


def test_bench_quant_json_reports_exact_sizes_and_quality(capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    assert main(["bench", "quant", "--json", "--no-real", "--vectors", "8192"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last)
    assert result["bytes_per_token_tq4"] == 34816
    assert result["bytes_per_token_fp16"] == 131072
    assert result["shapes"]["smollm2_135m"]["bytes_per_token_tq4"] == 2 * 30 * 3 * (32 + 4)
    assert result["mse_unit"] <= 0.0095
    assert result["attn_cosine_random"] >= 0.99
    assert result["encode_vectors_per_s"] > 0 and result["decode_vectors_per_s"] > 0


def test_bench_tiers_json_counts_four_copies_whatever_the_layers(
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "tiers", "--json", "--blocks", "64", "--layers", "32", "1", "--repeats", "2"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["copies_per_move"] == 4
    assert result["copies_per_move_by_layers"] == {"32": 4, "1": 4}
    assert result["warm_gbps"] > 0 and result["memcpy_gbps"] > 0


def test_the_console_script_is_the_main_function() -> None:
    """``contextkit`` (pyproject's console script ``contextkit.cli:main``) runs the CLI."""
    from importlib import metadata

    (script,) = [ep for ep in metadata.entry_points(group="console_scripts")
                 if ep.name == "contextkit"]
    assert script.value == "contextkit.cli:main"
    entry = script.load()
    assert callable(entry) and entry is main
    assert entry(["config", "show", "--json"]) == 0
